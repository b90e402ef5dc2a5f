"""The package's layering, checked on its source (AST, function-local imports counted).

The layers, top to bottom (`LAYERS`; ARCHITECTURE.md draws the same list). A module imports
only modules of its own layer or of the layers below it; inside a layer, only its own package
(two packages of one layer never import each other). Imports under `if TYPE_CHECKING:` are
annotations, not imports, and are not counted.

1. No import cycles among numbisect modules.
2. The layer order above.
3. The core (every layer below the UI) never imports textual or click.
4. The torch-free layers (`numbisect.report`, `numbisect.common`, `numbisect.search`) never
   import torch, transformers or vllm, directly or through what they import; and `bisect report show|validate|md|diff` run in a fresh
   interpreter leave no torch in sys.modules.
5. No annotation runs up either: with `if TYPE_CHECKING:` imports counted, the layer order
   still holds (`annotation_violations`).
6. Outside numbisect/backends/, no module imports a backend's folder (`ENGINE_FOLDERS`:
   numbisect.backends.hf, .vllm, .dump or any module in them), annotations included: the
   layers above reach an engine kind through the registry only (numbisect.backends, its
   `services(kind)`; base.py, options.py, steps.py, protocols.py).

An import of a package counts as an import of its `__init__` only (not of its parents).
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest
from conftest import ROOT

PKG = ROOT / "numbisect"
# Top to bottom. Each entry is a layer: the packages (or modules) under numbisect in it.
LAYERS = (
    ("__main__", "cli", "tui"),  # the UI: the `bisect` command and the Textual app
    ("live",),  # the Python API over live objects (a trainer's model, a running engine): the verbs
    # (compare, run, the weight check) on them, as the CLI runs them on directories
    ("commands",),  # one module per verb's orchestration
    ("session",),  # one trace, one reference, one engine, the trials run on them
    ("search",),  # the culprit search: pure, torch-free
    ("pipeline",),  # one comparison and the analysis done at comparison time
    ("backends",),  # one folder per engine, the registry, the interface
    ("patching",),  # engine-neutral changes a backend carries out, and its probes
    ("model",),  # arch maps, units, traces, engine configs, checkpoint diff
    ("report",),  # the report document and its readers: torch-free
    ("common", "dump"),  # errors, safe IO, text and number formatting (torch-free); the engine-side dump writer
)
UI_ORDER = ("__main__", "cli", "tui")  # inside the UI layer, each imports only those after it
TORCH_FREE = ("report", "common", "search")
ENGINE_FOLDERS = ("hf", "vllm", "dump")  # numbisect/backends/ folders only the backends import
HEAVY = ("torch", "transformers", "vllm")


def layer_of(mod: str) -> tuple[int, str]:
    """(layer index, package) of a numbisect module; the root package is below every layer."""
    parts = mod.split(".")
    if len(parts) == 1:
        return len(LAYERS), ""
    for i, packages in enumerate(LAYERS):
        if parts[1] in packages:
            return i, parts[1]
    raise AssertionError(f"{mod} is in no layer: add its package to LAYERS and ARCHITECTURE.md")


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _import_nodes(tree: ast.AST, annotations: bool = False, top_level: bool = False):
    """Every import statement, function-local ones included, but not under `if TYPE_CHECKING:`
    (with `annotations`, those too). `top_level`: only those that run when the module is
    imported (none inside a function's body)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if _type_checking(node) and not annotations:
            stack.extend(node.orelse)
            continue
        if top_level and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_targets(node: ast.Import | ast.ImportFrom, here: str, files) -> list[str]:
    """The modules an import statement imports: `from pkg import mod` names the module,
    `from mod import name` the module; relative imports resolved from package `here`."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        base = ".".join([*here.split(".")[: len(here.split(".")) - node.level + 1], *filter(None, [base])])
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]


@functools.lru_cache(maxsize=None)
def _tree(path: str, mtime: int, extra: str) -> ast.AST:
    return ast.parse(Path(path).read_text() + extra, path)


def imports(pkg: Path, extra: dict | None = None, annotations: bool = False,
            top_level: bool = False) -> tuple[nx.DiGraph, dict[str, set[str]]]:
    """numbisect module -> numbisect modules it imports (a graph), and -> the outside
    top-level packages it imports. `extra`: text appended to files (path relative to
    `pkg`), as a test plants a forbidden import without copying the package.
    `annotations`, `top_level`: as `_import_nodes`."""
    extra = {str(pkg / k): v for k, v in (extra or {}).items()}
    files = {".".join(p.relative_to(pkg.parent).with_suffix("").parts).removesuffix(".__init__"): p for p in pkg.rglob("*.py")}
    g, outside = nx.DiGraph(), {m: set() for m in files}
    g.add_nodes_from(files)
    for mod, path in files.items():
        here = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        tree = _tree(str(path), path.stat().st_mtime_ns, extra.get(str(path), ""))
        for node in _import_nodes(tree, annotations, top_level):
            for t in import_targets(node, here, files):
                if t.split(".")[0] != pkg.name:
                    outside[mod].add(t.split(".")[0])
                elif t != mod:
                    g.add_edge(mod, t)
    return g, outside


def check(pkg: Path = PKG, extra: dict | None = None) -> list[str]:
    """Every violation of the rules above, one line each (empty when the package keeps them)."""
    g, outside = imports(pkg, extra)
    return _check_cycles(g) + _check_order(g, outside) + _check_backend_folders(imports(pkg, extra, annotations=True)[0], pkg)


def _check_backend_folders(g: nx.DiGraph, pkg: Path = PKG) -> list[str]:
    """Rule 6: an import of a backend's folder from outside numbisect/backends/, named by
    the importing file and the module it imports."""
    out = []
    for mod in sorted(g):
        if mod.split(".")[1:2] == ["backends"]:
            continue
        for t in sorted(g.successors(mod)):
            parts = t.split(".")
            if parts[1:2] == ["backends"] and parts[2:3] and parts[2] in ENGINE_FOLDERS:
                rel = Path(*mod.split("."))
                path = rel.with_suffix(".py") if (pkg.parent / rel.with_suffix(".py")).is_file() else rel / "__init__.py"
                out.append(f"imports a backend's folder: {path} imports {t} (outside numbisect/backends/ an engine "
                           "kind is reached through the registry: numbisect.backends.services(kind))")
    return out


def _check_cycles(g: nx.DiGraph) -> list[str]:
    out = []
    for c in sorted(map(sorted, nx.strongly_connected_components(g))):
        if len(c) > 1:  # one cycle of the component, and the component
            loop = [a for a, _ in nx.find_cycle(g.subgraph(c), source=c[0])]
            out.append(f"import cycle: {' -> '.join(loop + loop[:1])} (among {', '.join(c)})")
    return out


def _check_order(g: nx.DiGraph, outside: dict[str, set[str]]) -> list[str]:
    out = []
    for mod in sorted(g):
        (i, p) = layer_of(mod)
        for t in sorted(g.successors(mod)):
            (j, q) = layer_of(t)
            if j < i:
                out.append(f"imports a layer above: {mod} (layer {p}) imports {t} (layer {q})")
            elif j == i and p != q and not (i == 0 and UI_ORDER.index(q) > UI_ORDER.index(p)):
                out.append(f"imports a sibling package: {mod} imports {t} (both in layer {i})")
        if i > 0:
            for bad in sorted(outside[mod] & {"textual", "click"}):
                out.append(f"core imports the UI: {mod} imports {bad}")
        if p in TORCH_FREE:  # and everything it imports, transitively
            for dep in [mod, *nx.descendants(g, mod)]:
                for bad in sorted(outside[dep] & set(HEAVY)):
                    via = "" if dep == mod else f" (via {dep})"
                    out.append(f"torch-free layer imports {bad}: {mod}{via}")
    return out


def test_the_package_keeps_its_layers():
    assert check() == []


def test_every_package_is_in_a_layer():
    named = {p for layer in LAYERS for p in layer}
    present = {p.name for p in PKG.iterdir() if (p / "__init__.py").exists()} | {
        p.stem for p in PKG.glob("*.py") if p.stem != "__init__"}
    assert present == named


@pytest.mark.parametrize(
    ("module", "line", "expected"),
    [
        ("backends/hf/__init__.py", "import numbisect.search.search", "imports a layer above: numbisect.backends.hf (layer backends) imports numbisect.search.search"),
        ("backends/options.py", "from numbisect.session import session", "imports a layer above: numbisect.backends.options"),
        ("report/document.py", "import torch", "torch-free layer imports torch: numbisect.report.document"),
        ("common/textsafe.py", "def f():\n    from transformers import AutoConfig", "torch-free layer imports transformers: numbisect.common.textsafe"),
        ("report/summary.py", "from numbisect.pipeline import measure", "imports a layer above: numbisect.report.summary"),
        ("model/units.py", "import numbisect.model.arch", "import cycle: numbisect.model.arch -> "),
        ("backends/options.py", "from numbisect.backends import open_backend", "import cycle: numbisect.backends -> "),
        ("pipeline/metrics.py", "from numbisect.tui import model", "imports a layer above: numbisect.pipeline.metrics (layer pipeline) imports numbisect.tui.model"),
        ("search/search.py", "def f():\n    import click", "core imports the UI: numbisect.search.search imports click"),
        ("search/search.py", "import torch", "torch-free layer imports torch: numbisect.search.search"),
        ("patching/swap.py", "from numbisect.backends.base import Backend", "imports a layer above: numbisect.patching.swap"),
        ("tui/model.py", "from numbisect.cli import main", "imports a sibling package: numbisect.tui.model imports numbisect.cli"),
        ("live/probe.py", "from numbisect.backends.vllm.readback import unit_reader",
         "imports a backend's folder: numbisect/live/probe.py imports numbisect.backends.vllm.readback"),
        ("cli.py", "def f():\n    from numbisect.backends import hf", "imports a backend's folder: numbisect/cli.py imports numbisect.backends.hf"),
        ("session/session.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from numbisect.backends.dump.runner import DumpBackend",
         "imports a backend's folder: numbisect/session/session.py imports numbisect.backends.dump.runner"),
    ],
)
def test_the_checker_finds_a_forbidden_import(module, line, expected):
    found = check(PKG, {module: f"\n{line}\n"})
    assert any(v.startswith(expected) for v in found), found


def test_type_checking_imports_are_not_imports():
    planted = "\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from numbisect.session.session import Session\n"
    assert check(PKG, {"model/trace.py": planted}) == []


def annotation_violations(pkg: Path = PKG, extra: dict | None = None) -> list[str]:
    """The layer order again with `if TYPE_CHECKING:` imports counted: no lower layer names a
    class of a layer above, even in an annotation (patching/ and model/ name the
    `HasUnits` / `Swappable` protocols, never `backends.base.Backend`). Cycles are not
    asked of annotations (model.units names model.arch's ArchMap, which imports it)."""
    return [v for v in _check_order(*imports(pkg, extra, annotations=True)) if v.startswith("imports a layer above")]


def test_no_annotation_names_a_layer_above():
    assert annotation_violations() == []
    planted = "\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from numbisect.backends.base import Backend\n"
    assert annotation_violations(PKG, {"patching/swap.py": planted}) == [
        "imports a layer above: numbisect.patching.swap (layer patching) imports numbisect.backends.base (layer backends)"]


REPORTS = ROOT / "fixtures" / "reports"


@pytest.mark.parametrize(
    "argv",
    [["show", "qwen3_moe_planted_fault.json"], ["validate", "qwen3_moe_planted_fault.json"],
     ["md", "qwen3_moe_compare_vllm.json"], ["diff", "qwen3_moe_planted_fault.json", "qwen3_moe_compare_vllm.json", "--json"],
     ["plot", "qwen3_moe_planted_fault.json", "--out", "{tmp}/plot.svg"]],
)
def test_report_commands_load_no_torch(argv, tmp_path):
    """harlequin's check: run the command in a fresh interpreter, then look at sys.modules."""
    args = ["report", argv[0], *(str(REPORTS / a) if a.endswith(".json") else a.format(tmp=tmp_path) for a in argv[1:])]
    code = (
        "import contextlib, io, sys\n"
        "from numbisect.cli import main\n"
        f"with contextlib.redirect_stdout(io.StringIO()):\n    rc = main({args!r})\n"
        "print(rc, sorted(m for m in ('torch', 'transformers', 'vllm', 'textual') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rc, loaded = out.stdout.split(maxsplit=1)
    assert rc in ("0", "1"), out.stdout + out.stderr  # show exits 1 on a diverged report
    assert loaded.strip() == "[]"

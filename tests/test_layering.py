"""The package's layering, checked on its source (AST, function-local imports counted).

1. No import cycles among numbisect modules.
2. The core (all but numbisect.cli, numbisect.__main__ and numbisect.tui.*) never imports
   the CLI, the TUI, textual or click.
3. Report tooling (`REPORT_TOOLS` and every numbisect module they import, transitively)
   never imports torch, transformers or vllm; and `bisect report show|validate|md|diff`
   run in a fresh interpreter leave no torch in sys.modules.
4. Backends (numbisect.backends.*) never import the search (search, run, session,
   selftest), directly or transitively.

An import of a package counts as an import of its `__init__` only (not of its parents).
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest
from conftest import ROOT

PKG = ROOT / "numbisect"
UI = ("numbisect.cli", "numbisect.__main__", "numbisect.tui")
REPORT_TOOLS = ("numbisect.report", "numbisect.reporttools", "numbisect.render", "numbisect.routing_render",
                "numbisect.decode_render", "numbisect.formatting", "numbisect.reportview", "numbisect.jsonsafe", "numbisect.textsafe",
                "numbisect.safeio", "numbisect.errors", "numbisect.findings")
HEAVY = ("torch", "transformers", "vllm")
SEARCH = ("numbisect.search", "numbisect.run", "numbisect.session", "numbisect.selftest")


def _under(mod: str, prefixes) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in prefixes)


def imports(pkg: Path) -> tuple[nx.DiGraph, dict[str, set[str]]]:
    """numbisect module -> numbisect modules it imports (a graph), and -> the outside
    top-level packages it imports; every import statement, function-local ones included."""
    files = {".".join(p.relative_to(pkg.parent).with_suffix("").parts).removesuffix(".__init__"): p for p in pkg.rglob("*.py")}
    g, outside = nx.DiGraph(), {m: set() for m in files}
    g.add_nodes_from(files)
    for mod, path in files.items():
        here = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join([*here.split(".")[: len(here.split(".")) - node.level + 1], *filter(None, [base])])
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            for t in targets:
                if t.split(".")[0] != pkg.name:
                    outside[mod].add(t.split(".")[0])
                elif t != mod:
                    g.add_edge(mod, t)
    return g, outside


def check(pkg: Path = PKG) -> list[str]:
    """Every violation of the rules above, one line each (empty when the package keeps them)."""
    g, outside = imports(pkg)
    out = []
    for c in sorted(map(sorted, nx.strongly_connected_components(g))):
        if len(c) > 1:  # one cycle of the component, and the component
            loop = [a for a, _ in nx.find_cycle(g.subgraph(c), source=c[0])]
            out.append(f"import cycle: {' -> '.join(loop + loop[:1])} (among {', '.join(c)})")
    for mod in sorted(g):
        if _under(mod, UI):
            continue
        for bad in sorted(outside[mod] & {"textual", "click"}) + sorted(t for t in g.successors(mod) if _under(t, UI)):
            out.append(f"core imports the UI: {mod} imports {bad}")
    reached = {}  # module -> the report tool it is reached from
    for tool in REPORT_TOOLS:
        for mod in [tool, *nx.descendants(g, tool)]:
            reached.setdefault(mod, tool)
    for mod, tool in sorted(reached.items()):
        for bad in sorted(outside[mod] & set(HEAVY)):
            via = " -> ".join(nx.shortest_path(g, tool, mod))
            out.append(f"report tooling imports {bad}: {mod}" + (f" (via {via})" if mod != tool else ""))
    for mod in sorted(m for m in g if _under(m, ("numbisect.backends",))):
        for bad in sorted(t for t in nx.descendants(g, mod) if t in SEARCH):
            out.append(f"backend imports the search: {mod} reaches {bad}")
    return out


def test_the_package_keeps_its_layers():
    assert check() == []


@pytest.mark.parametrize(
    ("module", "line", "expected"),
    [
        ("backends/hf/__init__.py", "import numbisect.search", "backend imports the search: numbisect.backends.hf reaches numbisect.search"),
        ("backends/options.py", "from numbisect import session", "backend imports the search: numbisect.backends.options reaches numbisect.session"),
        ("report.py", "import torch", "report tooling imports torch: numbisect.report"),
        ("formatting.py", "from numbisect.compare import sanitize", "report tooling imports torch: numbisect.compare (via numbisect.re"),
        ("textsafe.py", "def f():\n    from transformers import AutoConfig", "report tooling imports transformers: numbisect.textsafe"),
        ("units.py", "import numbisect.arch", "import cycle: numbisect.arch -> "),
        ("backends/options.py", "from numbisect.backends import open_backend", "import cycle: numbisect.backends -> "),
        ("metrics.py", "from numbisect.tui import model", "core imports the UI: numbisect.metrics imports numbisect.tui.model"),
        ("search.py", "def f():\n    import click", "core imports the UI: numbisect.search imports click"),
        ("swap.py", "from numbisect.cli import main", "core imports the UI: numbisect.swap imports numbisect.cli"),
    ],
)
def test_the_checker_finds_a_forbidden_import(tmp_path, module, line, expected):
    pkg = shutil.copytree(PKG, tmp_path / "numbisect", ignore=shutil.ignore_patterns("__pycache__"))
    assert check(pkg) == []
    with open(pkg / module, "a") as f:
        f.write(f"\n{line}\n")
    found = check(pkg)
    assert any(v.startswith(expected) for v in found), found


REPORTS = ROOT / "fixtures" / "reports"


@pytest.mark.parametrize(
    "argv",
    [["show", "qwen3_moe_planted_fault.json"], ["validate", "qwen3_moe_planted_fault.json"],
     ["md", "qwen3_moe_compare_vllm.json"], ["diff", "qwen3_moe_planted_fault.json", "qwen3_moe_compare_vllm.json", "--json"]],
)
def test_report_commands_load_no_torch(argv):
    """harlequin's check: run the command in a fresh interpreter, then look at sys.modules."""
    args = ["report", argv[0], *(str(REPORTS / a) if a.endswith(".json") else a for a in argv[1:])]
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

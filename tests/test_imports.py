"""One rule for imports inside functions: torch, transformers, vllm, safetensors, textual and
pyarrow stay lazy by rule (they are heavy, or read the environment when imported); any other
import inside a function says why on its lines (`# lazy: REASON`: an import cycle, a
heavy package it would pull into a light module, an optional package), and that reason is
true of the import graph (`untrue_lazy_reasons`, below)."""

from __future__ import annotations

import ast
import functools
import re

import test_layering
from conftest import ROOT

HEAVY = {"torch", "transformers", "vllm", "safetensors", "textual", "pyarrow"}


def unexplained(pkg=ROOT / "numbisect") -> list[str]:
    out = []
    for path in sorted(pkg.rglob("*.py")):
        src = path.read_text().splitlines()
        tree = ast.parse("\n".join(src))
        funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]
        for f in funcs:
            for node in ast.walk(f):
                if not isinstance(node, (ast.Import, ast.ImportFrom)):
                    continue
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or "."]
                if {n.split(".")[0] for n in names} <= HEAVY or any("# lazy: " in ln for ln in src[node.lineno - 1:node.end_lineno]):
                    continue
                out.append(f"{path.relative_to(pkg.parent)}:{node.lineno}: {src[node.lineno - 1].strip()}")
    return sorted(set(out))


def test_every_lazy_import_is_heavy_or_says_why():
    assert unexplained() == []


def test_the_rule_finds_an_unexplained_import(tmp_path):
    import shutil

    pkg = shutil.copytree(ROOT / "numbisect", tmp_path / "numbisect", ignore=shutil.ignore_patterns("__pycache__"))
    with open(pkg / "model" / "units.py", "a") as f:
        f.write("\n\ndef _late():\n    import json\n    from torch import nn  # heavy: allowed\n    return json, nn\n")
    assert unexplained(pkg) == ["numbisect/model/units.py:" + str(len((pkg / "model" / "units.py").read_text().splitlines()) - 2)
                                + ": import json"]


def private_imports(pkg=ROOT / "numbisect", extra: dict[str, str] | None = None) -> list[str]:
    """`from numbisect.a.b import _name` where the importing module is outside package
    `numbisect.a` (its folder): a private name used across packages is a coupling nobody
    sees when they change it (the live weight check once broke on ckptdiff's private
    checkpoint class). `extra`: path -> source, modules added to the scan."""
    out = []
    files = {str(p.relative_to(pkg.parent)): p.read_text() for p in sorted(pkg.rglob("*.py"))}
    files.update(extra or {})
    for rel, text in files.items():
        here = rel[:-3].replace("/", ".").rsplit(".", 1)[0]  # the importing module's package
        for node in ast.walk(ast.parse(text)):
            if not (isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("numbisect")):
                continue
            there = node.module.rsplit(".", 1)[0]
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__") and there != here:
                    out.append(f"{rel}:{node.lineno}: {a.name} from {node.module}")
    return out


def test_no_private_name_is_imported_across_packages():
    assert private_imports() == []


def test_the_private_import_rule_finds_one_and_allows_a_sibling():
    got = private_imports(extra={"numbisect/live/x.py": "from numbisect.model.ckptdiff import _Checkpoint\n",
                                 "numbisect/model/y.py": "from numbisect.model.ckptdiff import _Checkpoint\n"})
    assert got == ["numbisect/live/x.py:1: _Checkpoint from numbisect.model.ckptdiff"]


# -- the `# lazy:` reasons, checked against the import graph ---------------------------------------
# A `# lazy: REASON` must be true. The reasons a deferred import may give, each checked on the
# import graph `tests/test_layering.py` builds (only the imports that run when a module is
# imported, through every package above it):
#
# - `keeps X[, Y] out of importing M`: M is the module the import stands in, importing M loads
#   no X (neither M nor a package above it imports X at load), and the deferred module does;
# - `import cycle (A imports B at load)`: A imports B at load, and importing the deferred
#   module at load would import this one (the cycle);
# - `P loads only when this runs`: importing this module loads no P;
# - `optional: WHY`: the import stands in a `try` (its absence is handled).
#
# X may be torch, transformers, vllm or textual. What an outside package loads in turn is in
# `OUTSIDE_LOADS` (importing torch loads numpy).

OUTSIDE_LOADS = {"torch": {"numpy"}, "transformers": {"torch", "numpy"}, "vllm": {"torch", "transformers", "numpy"},
                 "trl": {"torch", "transformers"}, "accelerate": {"torch"}}
KEEPS = re.compile(r"keeps ([\w, ]+) out of importing ([\w.]+)")
CYCLE = re.compile(r"import cycle \(([\w.]+) imports ([\w.]+) at load\)")
ONLY = re.compile(r"(\w+) loads only when this runs")
OPTIONAL = re.compile(r"optional: .+")


def _load_graph(pkg, extra=None):
    return test_layering.imports(pkg, extra, top_level=True)


def loaded_by(g, outside, mods) -> tuple[set[str], set[str]]:
    """(numbisect modules, outside packages) that importing `mods` runs: each one's packages
    above it too, and what they import at load, transitively."""
    seen, todo = set(), [m for m in mods if m in g]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        parts = m.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))] + list(g.successors(m))
    out = set().union(*(outside[m] for m in seen)) if seen else set()
    while True:  # what the outside packages load in turn
        more = set().union(*(OUTSIDE_LOADS.get(p, set()) for p in out)) - out
        if not more:
            return seen, out
        out |= more


def _lazy_imports(pkg, extra=None):
    """(path, line, importing module, deferred numbisect modules, outside packages, reason, in a try)."""
    files = {".".join(p.relative_to(pkg.parent).with_suffix("").parts).removesuffix(".__init__"): p for p in pkg.rglob("*.py")}
    for mod, path in sorted(files.items()):
        src = path.read_text() + (extra or {}).get(str(path.relative_to(pkg)), "")
        lines = src.splitlines()
        tree = ast.parse(src)
        parents = {c: n for n in ast.walk(tree) for c in ast.iter_child_nodes(n)}
        here = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for f in ast.walk(tree):
            if not isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(f):
                if not isinstance(node, (ast.Import, ast.ImportFrom)):
                    continue
                reasons = [ln.split("# lazy: ", 1)[1].strip() for ln in lines[node.lineno - 1:node.end_lineno] if "# lazy: " in ln]
                if not reasons:
                    continue
                names = test_layering.import_targets(node, here, files)
                ours = {n for n in names if n.split(".")[0] == pkg.name}
                theirs = {n.split(".")[0] for n in names} - {pkg.name}
                p, in_try = parents.get(node), False
                while p is not None and p is not f:
                    in_try |= isinstance(p, ast.Try) and any(node in ast.walk(b) for b in p.body)
                    p = parents.get(p)
                yield path.relative_to(pkg.parent), node.lineno, mod, ours, theirs, reasons[0], in_try


@functools.lru_cache(maxsize=None)
def _graph(pkg):
    return _load_graph(pkg)


def untrue_lazy_reasons(pkg=ROOT / "numbisect", extra: dict | None = None) -> list[str]:
    """Each `# lazy:` reason that the import graph contradicts, one line each."""
    g, outside = _load_graph(pkg, extra) if extra else _graph(pkg)
    out = []
    for path, line, mod, ours, theirs, reason, in_try in _lazy_imports(pkg, extra):
        at = f"{path}:{line}: "
        if m := KEEPS.fullmatch(reason):
            kept, named = [x.strip() for x in m.group(1).split(",")], m.group(2)
            if named != mod:
                out.append(at + f"says it keeps {m.group(1)} out of importing {named}, but it stands in {mod}")
                continue
            _, here_loads = loaded_by(g, outside, [mod])
            _, it_loads = loaded_by(g, outside, ours)
            it_loads |= theirs | set().union(*(OUTSIDE_LOADS.get(t, set()) for t in theirs))
            for x in kept:
                if x in here_loads:
                    out.append(at + f"keeps {x} out of importing {mod}, which loads {x} anyway")
                elif x not in it_loads:
                    out.append(at + f"keeps {x} out, but {', '.join(sorted(ours | theirs))} loads no {x}")
        elif m := CYCLE.fullmatch(reason):
            a, b = m.groups()
            mods, _ = loaded_by(g, outside, ours)
            if b not in loaded_by(g, outside, [a])[0]:
                out.append(at + f"says {a} imports {b} at load: it does not")
            elif mod not in mods:
                out.append(at + f"says import cycle, but importing {', '.join(sorted(ours))} at load does not import {mod}")
        elif m := ONLY.fullmatch(reason):
            _, here_loads = loaded_by(g, outside, [mod])
            if m.group(1) in here_loads:
                out.append(at + f"says {m.group(1)} loads only when this runs, but importing {mod} loads it")
        elif OPTIONAL.fullmatch(reason):
            if not in_try:
                out.append(at + "says optional, but stands in no try")
        else:
            out.append(at + f"a reason the graph cannot check: {reason!r}")
    return sorted(set(out))


def test_every_lazy_reason_is_true():
    assert untrue_lazy_reasons() == []


def test_the_lazy_rule_finds_untrue_reasons():
    planted = {
        # session.py imports torch through numbisect.session.session's own imports
        "session/session.py": "\n\ndef _a():\n    import json  # lazy: keeps torch out of importing numbisect.session.session\n",
        # common.errors loads no torch
        "cli.py": "\n\ndef _b():\n    from numbisect.common import errors  # lazy: keeps torch out of importing numbisect.cli\n",
        "report/view.py": "\n\ndef _c():\n    from numbisect.common import textsafe  # lazy: import cycle (numbisect.common.textsafe imports numbisect.report.view at load)\n",
        "model/trace.py": "\n\ndef _d():\n    import numpy  # lazy: numpy loads only when this runs\n",
    }
    got = untrue_lazy_reasons(ROOT / "numbisect", planted)
    n = {k: len((ROOT / "numbisect" / k).read_text().splitlines()) + 4 for k in planted}
    for want in (f"numbisect/session/session.py:{n['session/session.py']}: keeps torch out of importing numbisect.session.session, which loads torch anyway",
                 f"numbisect/cli.py:{n['cli.py']}: keeps torch out, but numbisect.common.errors loads no torch",
                 f"numbisect/report/view.py:{n['report/view.py']}: says numbisect.common.textsafe imports numbisect.report.view at load: it does not",
                 f"numbisect/model/trace.py:{n['model/trace.py']}: says numpy loads only when this runs, but importing numbisect.model.trace loads it"):
        assert want in got, got

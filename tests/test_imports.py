"""One rule for imports inside functions: torch, transformers, vllm, safetensors, textual and
pyarrow stay lazy by rule (they are heavy, or read the environment when imported); any other
import inside a function says why on its lines (`# lazy: REASON`: an import cycle, a
heavy package it would pull into a light module, an optional package)."""

from __future__ import annotations

import ast

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

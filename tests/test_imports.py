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

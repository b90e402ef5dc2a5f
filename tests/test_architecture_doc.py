"""ARCHITECTURE.md matches the folders: every package under numbisect is named in it, and
every module or folder it names exists (so the page cannot drift from the layout)."""

from __future__ import annotations

import re

from conftest import ROOT
from test_layering import LAYERS

DOC = (ROOT / "ARCHITECTURE.md").read_text()
PKG = ROOT / "numbisect"


def _named_paths() -> set[str]:
    """Paths the page names: `numbisect/...` anywhere, and `dir/file.py` or `dir/` inside the
    layer diagram and the tables (relative to numbisect/)."""
    out = set(re.findall(r"numbisect/([\w/]+(?:\.py|/))", DOC))
    out |= {m for m in re.findall(r"(?<![\w/.])((?:[a-z_]+/)+[a-z_]+\.py)\b", DOC)}
    return out


def test_every_named_module_exists():
    files = [str(f.relative_to(PKG)) + ("/" if f.is_dir() else "") for f in PKG.rglob("*") if "__pycache__" not in f.parts]
    missing = sorted(p for p in _named_paths()
                     if not ((ROOT / p).exists() or any(f == p or f.endswith("/" + p) for f in files)))
    assert missing == []


def test_every_package_and_layer_is_named():
    packages = sorted(str(p.parent.relative_to(PKG)) for p in PKG.rglob("__init__.py") if p.parent != PKG)
    unnamed = [p for p in packages if f"{p}/" not in DOC and f" {p.rpartition('/')[2]}/" not in DOC]
    assert unnamed == []
    diagram = DOC.split("```")[1]
    for layer in LAYERS:
        for name in layer:
            assert f"numbisect/{name}" in diagram, name


def test_every_module_of_a_layer_package_is_named():
    """Each module file of a layer folder appears in the diagram by its file name."""
    diagram = DOC.split("```")[1]
    unnamed = sorted(str(p.relative_to(PKG)) for p in PKG.rglob("*.py")
                     if p.name != "__init__.py" and p.parent != PKG and p.relative_to(PKG).parts[0] not in ("tui",)
                     and p.relative_to(PKG).parts[:2] not in (("backends", "hf"), ("backends", "vllm"), ("model", "arch"),
                                                            ("report", "sections"), ("patching", "probes"))
                     and p.name not in diagram)
    assert unnamed == []

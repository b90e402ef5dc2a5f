"""The registry is the one place an engine kind is named: the rollout's own log-probs are an
entry like any backend, every KIND:DIR form a message offers comes from it, and the
reference opens as the kind that was accepted. Torch-free and fast."""

from __future__ import annotations

import re

import pytest
from conftest import ROOT

import ast

from numbisect.backends import BACKENDS, Registered, forms, open_backend, parse_spec, require_weights, source, weights_kind
from numbisect.backends.protocols import EngineServices, ReferenceServices, members
from numbisect.common.errors import InputError


def test_rollout_is_an_entry_given_alone():
    assert parse_spec("rollout", "--engine") == ("rollout", None)
    assert source("rollout") == "trace" and not BACKENDS["rollout"].runs
    assert parse_spec("vllm:some/dir", "--engine") == ("vllm", "some/dir")
    with pytest.raises(InputError) as e:
        parse_spec("rollout", "--ref")
    assert e.value.message == "bad --ref 'rollout': expected hf:DIR or vllm:DIR"
    with pytest.raises(InputError) as e:
        parse_spec("rollout:dir", "--engine")  # the rollout takes no directory
    assert e.value.message == "bad --engine 'rollout:dir': expected hf:DIR, vllm:DIR, dump:DIR or rollout"


def test_the_rollout_is_never_opened():
    with pytest.raises(InputError):
        open_backend("rollout", "x", "bfloat16", {})


def test_a_new_entry_shows_in_every_form_a_message_offers(monkeypatch):
    monkeypatch.setitem(BACKENDS, "sglang", Registered("x:y"))
    monkeypatch.setitem(BACKENDS, "replay", Registered(None, runs=False, reference=False, source="trace", takes_path=False))
    assert forms("--engine") == "hf:DIR, vllm:DIR, dump:DIR, rollout, sglang:DIR or replay"
    assert parse_spec("replay", "--engine") == ("replay", None)


def test_no_module_but_the_registry_names_an_engine_kind_in_code():
    """No `== "rollout"` (or any kind) special case, no reference opened as the literal "hf"
    and no services asked of a literal kind outside numbisect/backends/__init__.py (the
    registry)."""
    bad = []
    kinds = r"""["'](?:hf|vllm|rollout)["']"""  # ("dump" is also a `source`, compared as one)
    pattern = re.compile(rf"""(==|!=)\s*{kinds}|{kinds}\s*(==|!=)|(open_backend|check_opts|_open|_side|services)\(\s*["']hf["']|services\(\s*{kinds}""")
    for p in sorted((ROOT / "numbisect").rglob("*.py")):
        if p == ROOT / "numbisect" / "backends" / "__init__.py":
            continue
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if pattern.search(line.split("#")[0]):
                bad.append(f"{p.relative_to(ROOT)}:{i}: {line.strip()}")
    assert bad == []


def _top_level_names(module: str) -> set[str]:
    """The names a module binds at its top level (read from its source: nothing imported)."""
    path = ROOT.joinpath(*module.split("."))
    path = path.with_suffix(".py") if path.with_suffix(".py").is_file() else path / "__init__.py"
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                out |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
    return out


def test_each_services_module_offers_its_protocol():
    """What numbisect.live and the session reach of an engine kind (`services(kind)`) is all
    there: every member of the protocol of the entry's part (the weight check's reference or
    engine) is defined by the module the entry names."""
    with_services = {k: e for k, e in BACKENDS.items() if e.services}
    assert {k: e.weights for k, e in with_services.items()} == {"hf": "reference", "vllm": "engine"}
    for kind, entry in with_services.items():
        protocol = EngineServices if entry.weights == "engine" else ReferenceServices
        lacking = sorted(set(members(protocol)) - _top_level_names(entry.services))
        assert lacking == [], f"{entry.services} lacks {lacking}"


def test_bisect_weights_asks_the_registry(monkeypatch):
    """`bisect weights` takes the kinds registered for each part of a weight check, and its
    refusal names them from the registry."""
    assert (weights_kind("reference"), weights_kind("engine")) == ("hf", "vllm")
    require_weights("hf", "hf:x", "reference")
    require_weights("vllm", "vllm:x", "engine")
    with pytest.raises(InputError) as e:
        require_weights("dump", "dump:x", "engine")
    assert e.value.message.startswith("--engine must be vllm:DIR for `bisect weights`"), e.value.message
    monkeypatch.setitem(BACKENDS, "sglang", Registered("x:y", weights="engine"))
    require_weights("sglang", "sglang:x", "engine")  # a new engine kind that can be read back: accepted
    with pytest.raises(InputError) as e:
        require_weights("vllm", "vllm:x", "reference")
    assert e.value.message == "--ref must be hf:DIR (got 'vllm:x')"
    with pytest.raises(InputError) as e:
        require_weights("hf", "hf:x", "engine")
    assert "vllm:DIR or sglang:DIR" in e.value.message
    with pytest.raises(InputError):
        weights_kind("engine")  # two kinds play it: numbisect.live cannot pick one

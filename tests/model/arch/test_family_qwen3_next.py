"""Qwen3-Next (Qwen3NextForCausalLM, fixtures/models/qwen3_next): compare, run and planted
faults on hf engines.

The family's facts that matter (numbisect/model/arch/qwen3_next.py): layers 0-2 have Gated
DeltaNet linear attention (`linear_attn` with the fused per-key-head projections
`in_proj_qkvz` and `in_proj_ba`, conv, gates, recurrent state, gated output norm), layer 3
gated full attention (`self_attn` with an output gate); each is the unit `layers.{i}.attn`.
Every layer a MoE block (softmax top-2 renormalised, `norm_topk_prob`) with a shared expert
whose sigmoid gate lives in the block (sub-unit `shared_expert_gate`). vLLM-CPU:
test_family_qwen3_next_vllm.py. Ground truth is planted faults on an fp32 hf engine against
the fp32 reference (floor exactly 0), and damaged checkpoint copies.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import bound, damaged_copy, hf, model_dir, search, session, trace_path

from numbisect.cli import main
from numbisect.common.errors import ExitCode
from numbisect.model.arch import arch_for
from numbisect.pipeline import routing as R

pytestmark = pytest.mark.usefixtures("one_thread")

NAME = "qwen3_next"
N = 6  # samples for the searches (the reference GDN code is slow on 2 cores)


# -- the map ------------------------------------------------------------------------------------
def test_map_puts_each_layers_attn_unit_on_its_own_attention_module():
    b = hf(NAME, "float32")
    assert arch_for(b.config).name == NAME
    attn = {u.layer: u for u in b.units if u.kind == "attn"}
    assert [attn[i].variant for i in range(4)] == ["linear", "linear", "linear", ""]
    for i in range(3):
        assert b.module_path(f"layers.{i}.attn") == f"model.layers.{i}.linear_attn"
        gdn = b.module(f"layers.{i}.attn")
        assert type(gdn).__name__ == "Qwen3NextGatedDeltaNet"
        # the fused projections Qwen3.5 split: every weight the unit reads sits under its module
        assert hasattr(gdn, "in_proj_qkvz") and hasattr(gdn, "in_proj_ba") and not hasattr(gdn, "in_proj_qkv")
    assert b.module_path("layers.3.attn") == "model.layers.3.self_attn"
    assert type(b.module("layers.3.attn")).__name__ == "Qwen3NextAttention"
    for i in range(4):
        assert type(b.module(f"layers.{i}.moe.shared_expert")).__name__ == "Qwen3NextMLP"
        assert b.module_path(f"layers.{i}.moe.shared_expert_gate") == f"model.layers.{i}.mlp.shared_expert_gate"
        assert b.unit(f"layers.{i}.moe.shared_expert_gate").kind == "shared_expert_gate"
    assert not any(u.kind == "mlp" for u in b.units)


def test_dense_layers_from_the_config_are_mlp_units():
    # decoder_sparse_step / mlp_only_layers make a layer's FFN a dense MLP (as Qwen3-MoE)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir(NAME))
    config.mlp_only_layers = [1]
    kinds = [arch_for(config).ffn_kind(config, i) for i in range(4)]
    assert kinds == ["moe", "mlp", "moe", "moe"]


def test_select_and_weights_reproduce_the_transformers_router():
    b = hf(NAME, "float32")
    spec = R.router_spec(b.config)
    assert (spec.top_k, spec.num_experts, spec.scoring, spec.norm_topk) == (2, 8, "softmax", True)
    g = torch.Generator().manual_seed(0)
    for u in R.router_units(b):
        x = torch.randn(200, b.config.hidden_size, generator=g)
        with torch.no_grad():
            logits, w, ids = b.module(u)(x)
        assert not bool(R.experts_differ(R.select(logits, spec), ids).any())
        assert torch.allclose(R.weights_for(logits, ids, spec), w.float(), atol=1e-6)


# -- hf engines -----------------------------------------------------------------------------------
def test_bf16_engine_against_the_fp32_reference_and_its_self_check():
    s = session(NAME, "hf", ref_dtype="float32", engine_dtype="bfloat16", threshold=1e-10, samples=None)
    body, code = search(s)
    g = body["baseline"]["groups"]["completion"]
    k = g["k3"]
    print(f"k3 mean {k['mean']:.2g} p99 {k['p99']:.2g} max {k['max']:.2g} ({g['tokens']} tokens, top-1 {g['top1_agree']:.3f})")
    assert 0 < g["k3"]["mean"] < 3e-4 and g["k3"]["count"] == g["tokens"]
    sc = body["self_check"]
    print("self-check", [(c["swapped"], c["k3_mean"]) for c in sc["checks"]])
    assert sc["passed"] and not sc["dtypes_match"]
    blocks = next(c for c in sc["checks"] if c["swapped"] == "blocks")
    # every block swapped leaves only the engine's bf16 residual adds
    assert blocks["k3_mean"] < g["k3"]["mean"] / 5


def test_decode_mode_runs_through_the_cache_and_differs_from_prefill_first_at_an_attention():
    # decode: one token at a time through the cache (the GDN's recurrent rule and conv state);
    # prefill: the chunked rule over the whole sequence
    s = session(NAME, "hf", ref_dtype="float32", engine_dtype="bfloat16", samples=3, engine_mode="decode")
    m = s.compare()["engine_modes"]
    assert m["mode"] == "decode"
    d = m["decode_vs_prefill"]
    print(f"decode vs prefill {d['value']:.3g}, first unit {d['first_unit']}; prefill vs reference "
          f"{m['prefill_vs_reference']['value']:.3g}")
    # the two paths part inside an attention (measured: bitwise first at layers.0.attn.out_gate,
    # one element of the output gate's [tokens, 256] per sample, off by 2e-9 to 4e-9, which
    # out_proj rounds away: the attention outputs of the linear layers keep the same bits;
    # 4.8e-11 against 6.5e-5 for prefill against the reference)
    assert d["first_unit"]["bitwise"].startswith("layers.0.attn")
    assert 0 < m["decode_vs_prefill"]["value"] < m["prefill_vs_reference"]["value"] / 100
    assert sorted(m["not_swappable"]["kinds"]) == ["attn", "conv", "gates", "layer"]


HF_CASES = [
    ("output_noise=1e-2@layers.1.attn", "layers.1.attn"),  # linear attention (Gated DeltaNet)
    ("weight_noise=1e-2@layers.0.attn", "layers.0.attn"),  # in_proj_qkvz/_ba, conv, gates, norm all perturbed
    ("output_noise=1e-2@layers.3.attn", "layers.3.attn"),  # gated full attention
    ("weight_noise=1e-2@layers.2.attn.conv", "layers.2.attn.conv"),  # the causal conv's weight
    ("output_noise=1e-2@layers.1.attn.gates", "layers.1.attn.gates"),  # the decay g and beta
    ("output_noise=1e-2@layers.2.attn.out_gate", "layers.2.attn.out_gate"),  # the gated RMSNorm
    ("weight_noise=1e-2@layers.1.attn.out_proj", "layers.1.attn.out_proj"),
    ("output_noise=1e-2@layers.2.moe.experts", "layers.2.moe.experts"),
    ("output_noise=1e-2@layers.1.moe.shared_expert", "layers.1.moe.shared_expert"),
    ("output_noise=1e-1@layers.3.moe.shared_expert_gate", "layers.3.moe.shared_expert_gate"),
    ("output_noise=1e-2@layers.0.moe.router", "layers.0.moe.router"),
    ("moe_combine_bf16@layers.2.moe", "layers.2.moe.experts"),
]


@pytest.mark.parametrize("fault,unit", HF_CASES)
def test_planted_fault_is_named_on_an_fp32_hf_engine_within_the_bound(fault, unit):
    s = session(NAME, "hf", ref_dtype="float32", engine_dtype="float32", faults=[fault], threshold=1e-10, samples=N)
    body, code = search(s)
    print(f"{fault}: baseline {body['baseline']['value']:.3g}, {body['search']['trials_used']}/{bound(s)} trials")
    assert code == ExitCode.DIVERGED
    assert [c["unit"] for c in body["culprits"]] == [unit]
    assert body["search"]["trials_used"] <= bound(s)
    # the swaps carry every module whole: with the fault planted, every block swapped gives
    # the reference exactly (a weight fault in the fused projections would stay otherwise)
    assert body["self_check"]["passed"] and body["self_check"]["k3_mean"] == 0.0


def test_cli_compare_and_run_on_an_hf_engine(tmp_path, capsys):
    d = model_dir(NAME)
    base = ["--ref", f"hf:{d}", "--engine", f"hf:{d}", "--trace", trace_path(NAME), "-q"]
    out = tmp_path / "c.json"
    code = main(["compare", *base, "--out", str(out)])
    capsys.readouterr()
    assert code == ExitCode.ALIGNED
    r = json.loads(out.read_text())
    assert r["inputs"]["engine"]["arch"] == NAME
    assert r["routing"]["spec"]["top_k"] == 2 and r["routing"]["spec"]["norm_topk"] is True
    out = tmp_path / "r.json"
    code = main(["run", *base, "--ref-dtype", "float32", "--engine-dtype", "float32", "--threshold", "1e-10",
                 "--engine-fault", "output_noise=1e-2@layers.2.attn", "--out", str(out)])
    capsys.readouterr()
    assert code == ExitCode.DIVERGED
    r = json.loads(out.read_text())
    assert [c["unit"] for c in r["culprits"]] == ["layers.2.attn"] and r["self_check"]["passed"]


def _scale_rows(key: str, rows: slice, by: float):
    def edit(w):
        assert key in w, key
        t = w[key].float()
        t[rows] *= by
        w[key] = t.to(w[key].dtype)
    return edit


# in_proj_qkvz rows, per key head (one here): q 128, k 128, v 2x128, z 2x128; in_proj_ba: b 2, a 2
CKPT_CASES = [
    # the output gate z, the last rows of the fused in_proj_qkvz
    ("model.layers.1.linear_attn.in_proj_qkvz.weight", slice(512, 768), 0.5, "layers.1.attn"),
    # beta's projection b, the first rows of the fused in_proj_ba
    ("model.layers.2.linear_attn.in_proj_ba.weight", slice(0, 2), -1.0, "layers.2.attn"),
    # the shared expert's sigmoid gate: a sub-unit of its own
    ("model.layers.2.mlp.shared_expert_gate.weight", slice(None), -1.0, "layers.2.moe.shared_expert_gate"),
]


@pytest.mark.parametrize("key,rows,by,unit", CKPT_CASES, ids=[c[0].split(".", 3)[-1] for c in CKPT_CASES])
def test_damaged_checkpoint_is_diffed_and_searched_to_its_unit(key, rows, by, unit, tmp_path, capsys):
    bad = damaged_copy(NAME, tmp_path, _scale_rows(key, rows, by))
    out = tmp_path / "r.json"
    code = main(["run", "--ref", f"hf:{model_dir(NAME)}", "--engine", f"hf:{bad}", "--trace", trace_path(NAME),
                 "--ref-dtype", "float32", "--engine-dtype", "float32", "--threshold", "1e-10", "-q",
                 "--out", str(out)])
    capsys.readouterr()
    assert code == ExitCode.DIVERGED
    r = json.loads(out.read_text())
    assert [c["unit"] for c in r["culprits"]] == [unit]
    assert list(r["inputs"]["checkpoint_diff"]["units"]) == [unit]

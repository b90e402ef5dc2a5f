"""Qwen3.5-MoE, text model (Qwen3_5MoeForCausalLM, fixtures/models/qwen3_5_moe): compare,
run and planted faults on hf engines.

The family's facts that matter (numbisect/model/arch/qwen3_5_moe.py): layers 0-2 have Gated
DeltaNet linear attention (`linear_attn`: conv, gates, recurrent state, gated output norm),
layer 3 gated full attention (`self_attn` with an output gate); each is the unit
`layers.{i}.attn`. Every layer a MoE block with a shared expert whose sigmoid gate lives in
the block (sub-unit `shared_expert_gate`). vLLM-CPU: test_family_qwen3_5_moe_vllm.py. Ground truth is planted faults on an fp32 hf engine against the fp32
reference (floor exactly 0), and damaged checkpoint copies.
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

NAME = "qwen3_5_moe"
N = 6  # samples for the searches (the reference GDN code is slow on 2 cores)


# -- the map ------------------------------------------------------------------------------------
def test_map_puts_each_layers_attn_unit_on_its_own_attention_module():
    b = hf(NAME, "float32")
    assert arch_for(b.config).name == NAME
    attn = {u.layer: u for u in b.units if u.kind == "attn"}
    assert [attn[i].variant for i in range(4)] == ["linear", "linear", "linear", ""]
    for i in range(3):
        assert b.module_path(f"layers.{i}.attn") == f"model.layers.{i}.linear_attn"
        assert type(b.module(f"layers.{i}.attn")).__name__ == "Qwen3_5MoeGatedDeltaNet"
    assert b.module_path("layers.3.attn") == "model.layers.3.self_attn"
    assert type(b.module("layers.3.attn")).__name__ == "Qwen3_5MoeAttention"
    for i in range(4):
        assert type(b.module(f"layers.{i}.moe.shared_expert")).__name__ == "Qwen3_5MoeMLP"
        assert b.module_path(f"layers.{i}.moe.shared_expert_gate") == f"model.layers.{i}.mlp.shared_expert_gate"
        assert b.unit(f"layers.{i}.moe.shared_expert_gate").kind == "shared_expert_gate"
    assert not any(u.kind == "mlp" for u in b.units)


def test_linear_attention_layers_have_the_conv_gates_output_gate_and_projection_as_sub_units():
    b = hf(NAME, "float32")
    for i in range(3):
        subs = [b.unit(f"layers.{i}.attn.{k}") for k in ("conv", "gates", "out_gate", "out_proj")]
        assert [(u.kind, u.parent) for u in subs] == [(k, f"layers.{i}.attn") for k in ("conv", "gates", "out_gate", "out_proj")]
        assert [u.order for u in subs] == sorted(u.order for u in subs) and subs[-1].order < b.unit(f"layers.{i}.attn").order
        assert type(b.module(f"layers.{i}.attn.out_gate")).__name__ == "Qwen3_5MoeRMSNormGated"
    assert not [u.name for u in b.units if u.name.startswith("layers.3.attn.")]  # full attention has none
    # canonical form, one row per token: the conv's q, k, v channels; (g, beta) per value head;
    # [tokens, value heads * head dim]
    names = [f"layers.0.attn.{k}" for k in ("conv", "gates", "out_gate", "out_proj")]
    samples = session(NAME, "hf", samples=1).samples
    res = b.forward(samples, capture=names, capture_inputs=names[:2])
    n = len(samples[0].ids)
    shapes = [tuple(res.captures[u][0].shape) for u in names]
    assert shapes == [(n, 2 * 128 + 2 * 128), (n, 2 * 2), (n, 2 * 128), (n, b.config.hidden_size)]
    assert res.captures["layers.0.attn.gates"][0].dtype == torch.float32
    # the gates are transformers' own formula on the captured (a, b): g < 0, 0 < beta < 1
    g, beta = res.captures["layers.0.attn.gates"][0].chunk(2, dim=-1)
    assert bool((g < 0).all()) and bool(((beta > 0) & (beta < 1)).all())


def test_the_conv_and_gates_modules_leave_transformers_results_as_they_were():
    # conv and gates are modules numbisect routes transformers' own conv function and inline
    # gates through (backends/hf/gdn.py): the engine's log-probs are those of the model
    # loaded by transformers alone, bit for bit
    from transformers import AutoModelForCausalLM

    b = hf(NAME, "bfloat16")
    samples = session(NAME, "hf", samples=3).samples
    res = b.forward(samples, full_logits=True)
    plain = AutoModelForCausalLM.from_pretrained(model_dir(NAME), dtype=torch.bfloat16).eval()
    for s, got in zip(samples, res.full_logprobs):
        with torch.no_grad():
            want = plain(torch.tensor([s.ids])).logits[0, :-1].float().log_softmax(-1)
        assert torch.equal(want, got)


def test_the_fp32_unit_whatif_on_the_gates_hands_them_back_in_float32():
    # A bf16 engine computes g in float32 already (transformers upcasts a and A_log): "upcast
    # the gates to fp32" must leave g as it was, not round it to bf16 on the way out (measured
    # before the fix: a rounded g moved k3-mean 7.4e-5 -> 4.9e-5 on 6 samples, a spurious effect).
    from numbisect.backends.base import WHATIF_UNIT
    from numbisect.patching.ledger import Ledger

    s = session(NAME, "hf", ref_dtype="float32", engine_dtype="bfloat16", samples=2)
    eng, name = s.engine, "layers.0.attn.gates"
    plain = eng.forward(s.samples, capture=[name]).captures[name]
    with Ledger() as ledger:
        eng.install_whatif(WHATIF_UNIT, eng.unit(name), s.ref, [], ledger)
        upcast = eng.forward(s.samples, capture=[name]).captures[name]
    for want, got in zip(plain, upcast):
        assert got.dtype == torch.float32
        assert torch.equal(want.chunk(2, dim=-1)[0], got.chunk(2, dim=-1)[0])  # g, bit for bit


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
    s = session(NAME, "hf", ref_dtype="float32", engine_dtype="bfloat16", threshold=1e-10)
    body, code = search(s)
    g = body["baseline"]["groups"]["completion"]
    assert 0 < g["k3"]["mean"] < 3e-4 and g["k3"]["count"] == g["tokens"]
    sc = body["self_check"]
    assert sc["passed"] and not sc["dtypes_match"]
    blocks = next(c for c in sc["checks"] if c["swapped"] == "blocks")
    # every block swapped leaves only the engine's bf16 residual adds (measured 2.2e-6 against 5.6e-5)
    assert blocks["k3_mean"] < g["k3"]["mean"] / 5


def test_decode_mode_runs_the_recurrent_step_and_differs_from_prefill_first_in_linear_attention():
    # decode: one token at a time through the cache (the GDN's recurrent rule and conv state);
    # prefill: the chunked rule over the whole sequence
    s = session(NAME, "hf", ref_dtype="float32", engine_dtype="bfloat16", samples=3, engine_mode="decode")
    m = s.compare()["engine_modes"]
    assert m["mode"] == "decode"
    # the first unit to differ is the output gate, the first module after the recurrence
    # (the core output it takes differs; the gate and projection are per-token)
    assert m["decode_vs_prefill"]["first_unit"]["bitwise"] == "layers.0.attn.out_gate"
    # measured: 4.6e-8 between the two paths, 5.4e-5 against the reference
    assert 0 < m["decode_vs_prefill"]["value"] < m["prefill_vs_reference"]["value"] / 100
    assert sorted(m["not_swappable"]["kinds"]) == ["attn", "conv", "gates", "layer"]


HF_CASES = [
    ("output_noise=1e-2@layers.1.attn", "layers.1.attn"),  # linear attention (Gated DeltaNet)
    ("weight_noise=1e-2@layers.0.attn", "layers.0.attn"),  # conv, gates, A_log, dt_bias, norm all perturbed
    ("output_noise=1e-2@layers.3.attn", "layers.3.attn"),  # gated full attention
    ("weight_noise=1e-2@layers.1.attn.conv", "layers.1.attn.conv"),  # the causal conv's weight
    ("output_noise=1e-2@layers.0.attn.gates", "layers.0.attn.gates"),  # the decay g and beta
    ("output_noise=1e-2@layers.1.attn.out_gate", "layers.1.attn.out_gate"),  # the gated RMSNorm
    ("weight_noise=1e-1@layers.2.attn.out_gate", "layers.2.attn.out_gate"),  # its weight, per head dim
    ("weight_noise=1e-2@layers.0.attn.out_proj", "layers.0.attn.out_proj"),
    ("output_noise=1e-2@layers.2.moe.experts", "layers.2.moe.experts"),
    ("output_noise=1e-2@layers.1.moe.shared_expert", "layers.1.moe.shared_expert"),
    ("output_noise=1e-1@layers.3.moe.shared_expert_gate", "layers.3.moe.shared_expert_gate"),
    ("moe_combine_bf16@layers.2.moe", "layers.2.moe.experts"),
]


@pytest.mark.parametrize("fault,unit", HF_CASES)
def test_planted_fault_is_named_on_an_fp32_hf_engine_within_the_bound(fault, unit):
    s = session(NAME, "hf", ref_dtype="float32", engine_dtype="float32", faults=[fault], threshold=1e-10, samples=N)
    body, code = search(s)
    assert code == ExitCode.DIVERGED
    assert [c["unit"] for c in body["culprits"]] == [unit]
    assert body["search"]["trials_used"] <= bound(s)
    # the swaps carry every module whole: with the fault planted, every block swapped gives
    # the reference exactly (a weight fault in the GDN's conv or gates would stay otherwise)
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


def _scale(key: str, by: float):
    def edit(w):
        assert key in w, key
        w[key] = (w[key].float() * by).to(w[key].dtype)
    return edit


CKPT_CASES = [
    # the decay of a linear-attention layer (A_log): the gates unit reads it
    ("model.layers.1.linear_attn.A_log", 0.5, "layers.1.attn.gates"),
    # the causal conv's weight
    ("model.layers.0.linear_attn.conv1d.weight", 1.05, "layers.0.attn.conv"),
    # the shared expert's sigmoid gate: a sub-unit of its own
    ("model.layers.2.mlp.shared_expert_gate.weight", -1.0, "layers.2.moe.shared_expert_gate"),
]


@pytest.mark.parametrize("key,by,unit", CKPT_CASES, ids=[c[2] for c in CKPT_CASES])
def test_damaged_checkpoint_is_diffed_and_searched_to_its_unit(key, by, unit, tmp_path, capsys):
    bad = damaged_copy(NAME, tmp_path, _scale(key, by))
    out = tmp_path / "r.json"
    code = main(["run", "--ref", f"hf:{model_dir(NAME)}", "--engine", f"hf:{bad}", "--trace", trace_path(NAME),
                 "--ref-dtype", "float32", "--engine-dtype", "float32", "--threshold", "1e-10", "-q",
                 "--out", str(out)])
    capsys.readouterr()
    assert code == ExitCode.DIVERGED
    r = json.loads(out.read_text())
    assert [c["unit"] for c in r["culprits"]] == [unit]
    assert list(r["inputs"]["checkpoint_diff"]["units"]) == [unit]


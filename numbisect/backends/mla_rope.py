"""MLA's rotary part as a unit of its own (`layers.{i}.attn.rope`, kind `rope`): the layout
both engines agree on.

Multi-head latent attention (DeepSeek-V3, GLM-5) rotates only the last `qk_rope_head_dim`
dims of each query head (`q_pe`, [.., heads, rope]) and the one shared rope key (`k_pe`,
[.., 1, rope]). Neither engine has a module of its own for it (transformers calls a
module-level function, vLLM a rotary embedding shared by every layer), so each backend puts
one in per layer (numbisect.backends.hf.rope, numbisect.backends.vllm.rope) whose call is
one packed tensor per token:

- input: `pack(q_pe, k_pe)`, [.., (heads + 1) * rope], the query heads then the key, in the
  order the projections produce them (the same in both engines);
- output: the rotated `pack(q_pe, k_pe)` in transformers' order. DeepSeek's rope dims come
  in interleaved pairs (x0, x1), (x2, x3) ... (`rope_interleave`): transformers'
  `apply_rotary_pos_emb_interleave` returns each head's rotated pairs split in halves
  (all first elements, then all second), vLLM's GPT-J-style kernel keeps them interleaved;
  `split_pairs` / `join_pairs` go between the two.

So the engine's output and input tensors stand for the same numbers as the reference's, the
generic capture, feed and noise hooks apply as they do to any unit, and a swap hands the
donor's module the packed input.
"""

from __future__ import annotations

import torch


def width(text_config) -> int:
    """Values per token of a rope unit's input and output: every query head's rope dims and the key's."""
    return (text_config.num_attention_heads + 1) * text_config.qk_rope_head_dim


def pack(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """[.., heads, rope] queries and the [.., 1, rope] key as one [.., (heads + 1) * rope] tensor."""
    return torch.cat([q.flatten(-2), k.flatten(-2)], dim=-1)


def unpack(x: torch.Tensor, rope: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`pack`'s inverse: fresh [.., heads, rope] queries and [.., 1, rope] key (copies: an
    in-place rotary kernel must not write into the packed tensor a hook captured or fed)."""
    heads = x.shape[-1] // rope - 1
    q = x[..., : heads * rope].unflatten(-1, (heads, rope)).clone()
    k = x[..., heads * rope :].unflatten(-1, (1, rope)).clone()
    return q, k


def split_pairs(x: torch.Tensor) -> torch.Tensor:
    """Interleaved pairs (x0, x1, x2, x3, ..) -> (x0, x2, .., x1, x3, ..), per head."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


def join_pairs(x: torch.Tensor) -> torch.Tensor:
    """`split_pairs`'s inverse."""
    half = x.shape[-1] // 2
    return torch.stack([x[..., :half], x[..., half:]], dim=-1).flatten(-2)

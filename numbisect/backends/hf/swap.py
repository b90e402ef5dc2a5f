"""Swaps on a transformers engine: the donor's module behind a `CastAdapter`.

The engine and the donor share transformers' calling convention, so the adapter only
casts: tensors in to the donor's dtype, float outputs back to the engine's (logits from
a swapped `lm_head` stay in the donor's dtype: the backend takes a float32 log-softmax
of them). Attention and whole layers recompute their rotary cos/sin with the donor's
own rotary embedding, in the donor's dtype (under M-RoPE from the 3-D position ids the
engine's rotary embedding was called with), so the donor's rope_theta is carried; so does a
swapped MLA `rope` unit (numbisect.backends.hf.rope hands it the layer's position ids).

The attention mask is built at model level too (transformers' `masking_utils`, from the
config's `layer_types`, `sliding_window`, `attention_chunk_size`), outside every unit. When the
donor's config gives a swapped attention or layer another mask than the engine's (a converted
checkpoint with `sliding_window` or `layer_types` changed), the adapter rebuilds it as the
donor's model would, from the donor's config and the padding mask the engine's model was called
with (`MaskSwap`), so a swap carries the mask as it carries the rotary embedding.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from numbisect.backends.base import hidden_arg
from numbisect.patching.ledger import Ledger
from numbisect.patching.torchops import text_rotary

# Unit kinds whose output a donor (or an fp32 copy) hands back in its own dtype, not the
# engine's: the logits, and a Gated DeltaNet's gates (g and beta, float32 in the engine too).
KEEP_OUT_DTYPE = ("lm_head", "gates")


def _cast(x: Any, dtype: torch.dtype, only: torch.dtype | None = None) -> Any:
    """`x` with its float tensors cast to `dtype`; with `only`, just the tensors of that
    dtype (the activations), so an fp32 side value (a router's top-k weights) stays fp32."""
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if x.is_floating_point() and (only is None or x.dtype == only) else x
    if isinstance(x, tuple):
        return tuple(_cast(v, dtype, only) for v in x)
    if isinstance(x, list):
        return [_cast(v, dtype, only) for v in x]
    if isinstance(x, dict):  # a plain dict or a transformers ModelOutput (keep its class)
        return type(x)(**{k: _cast(v, dtype, only) for k, v in x.items()})
    return x


# The layer types whose mask `masking_utils` builds from the config alone (a linear
# attention's is the padding mask, the same whatever the config says).
MASKED = ("full_attention", "sliding_attention", "chunked_attention")


def mask_of(config, layer: int) -> tuple:
    """What the model-level mask of `layer` depends on in `config`: its layer type (full when
    the config has no `layer_types`), the sliding window of a sliding layer, the chunk of a
    chunked one."""
    text = config.get_text_config()
    types = getattr(text, "layer_types", None) or ()
    kind = types[layer] if layer < len(types) else "full_attention"
    return (kind, getattr(text, "sliding_window", None) if kind == "sliding_attention" else None,
            getattr(text, "attention_chunk_size", None) if kind == "chunked_attention" else None)


class MaskSwap:
    """The mask a donor's model would hand a swapped attention or layer (module docstring):
    built from the donor's text config for the donor's layer type, from the padding mask the
    engine's model was called with (`padding`, recorded by a pre-hook on it each forward)."""

    def __init__(self, config, kind: str):
        self.config = config.get_text_config()
        self.kind = kind
        self.padding: dict = {}

    def record(self, mod, args, kwargs) -> None:
        self.padding["mask"] = kwargs.get("attention_mask")

    def __call__(self, x: torch.Tensor, ids):
        from transformers.masking_utils import LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING as build

        if ids is None:
            ids = torch.arange(x.shape[1], device=x.device)[None]
        return build[self.kind](config=self.config, inputs_embeds=x, attention_mask=self.padding.get("mask"),
                                past_key_values=None, position_ids=ids)


class CastAdapter(nn.Module):
    """Run `inner` in `inner_dtype`; hand its float outputs back in `out_dtype` (None: keep)."""

    def __init__(self, inner: nn.Module, inner_dtype: torch.dtype, out_dtype: torch.dtype | None, rotary=None,
                 positions: dict | None = None, mask: MaskSwap | None = None):
        super().__init__()
        self.inner = inner
        self.inner_dtype = inner_dtype
        self.out_dtype = out_dtype
        self.rotary = rotary  # donor rotary embedding: recompute cos/sin in the donor's dtype
        self.positions = positions  # M-RoPE: {"ids": the engine rotary's 3-D position ids this forward}
        self.mask = mask  # the donor's mask, where its config gives another than the engine's

    def forward(self, *args, **kwargs):
        # Only the activations change dtype: inputs in the engine's dtype (that of the hidden
        # states), outputs in the donor's; other float values (fp32 routing weights) pass as they are.
        x = hidden_arg(args, kwargs)
        outer = x.dtype if x is not None else None
        args, kwargs = _cast(args, self.inner_dtype, outer), _cast(kwargs, self.inner_dtype, outer)
        ids = kwargs.get("position_ids") if self.positions is None else self.positions.get("ids")
        if self.rotary is not None and ids is not None and "position_embeddings" in kwargs:
            x = kwargs.get("hidden_states", args[0] if args else None)
            kwargs["position_embeddings"] = self.rotary(x, ids)
        if self.mask is not None and "attention_mask" in kwargs:
            x = kwargs.get("hidden_states", args[0] if args else None)
            kwargs["attention_mask"] = self.mask(x, kwargs.get("position_ids"))
        out = self.inner(*args, **kwargs)
        return out if self.out_dtype is None else _cast(out, self.out_dtype, self.inner_dtype)

    def __getattr__(self, name):
        # Callers read attributes of the module they think they hold (a vision tower's
        # `dtype`, `spatial_merge_size`): answer for the inner module.
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("_modules", {}).get("inner")
            if inner is None or name.startswith("__"):  # half-built, copy/pickle probes
                raise
            return getattr(inner, name)


class IndexerAdapter(CastAdapter):
    """A sparse-attention indexer (GLM-5's DSA), called positionally with (hidden_states,
    q_resid, (cos, sin), mask, position_ids): named, so that `CastAdapter` recomputes cos/sin
    with the donor's rotary embedding in the donor's dtype (the rope the indexer reads)."""

    def forward(self, hidden_states, q_resid, position_embeddings, attention_mask, position_ids=None, **kwargs):
        return super().forward(hidden_states=hidden_states, q_resid=q_resid, position_embeddings=position_embeddings,
                               attention_mask=attention_mask, position_ids=position_ids, **kwargs)


def swap_unit(engine, unit, donor, ledger: Ledger) -> None:
    """Put the donor's module for `unit` in the engine, behind a `CastAdapter`."""
    ref = donor.module(unit.name)
    out_dtype = None if unit.kind in KEEP_OUT_DTYPE else engine.dtype
    rotary = text_rotary(donor.arch, donor.arch.layer_rotary(donor.model)) if unit.kind in ("attn", "layer", "indexer", "rope") else None
    positions = None
    if unit.kind in ("attn", "layer") and donor.arch.mrope:
        # M-RoPE: a layer's 1-D position ids cannot give cos/sin, the 3-D ids the engine's own
        # rotary embedding is called with in this forward can: the donor's rotary (its
        # rope_theta, mrope_section) recomputes them from those.
        rotary, positions = donor.arch.rotary(donor.model), {}

        def record(mod, args, kwargs):
            positions["ids"] = args[1] if len(args) > 1 else kwargs.get("position_ids")

        ledger.hooks(engine.arch.rotary(engine.root), pre=record)
    mask = None
    if unit.kind in ("attn", "layer") and unit.layer is not None:
        want = mask_of(donor.config, unit.layer)
        if want != mask_of(engine.config, unit.layer) and want[0] in MASKED:
            mask = MaskSwap(donor.model.config, want[0])  # the loaded model's: it holds the attention implementation
            ledger.hooks(engine.root, pre=mask.record)
    adapter = IndexerAdapter if unit.kind == "indexer" else CastAdapter
    ledger.replace(engine.root, engine.module_path(unit.name), adapter(ref, donor.dtype, out_dtype, rotary, positions, mask))

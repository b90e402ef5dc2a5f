"""Swap adapters on vLLM: a donor transformers module given vLLM's calling convention.

vLLM keeps flat `[tokens, hidden]` activations, returns `(hidden, residual)` from its
layers, fuses RMSNorm with the residual add, calls attention as `(positions, hidden)`
(DeepSeek's MLA attention and layers with one more argument, `llama_4_scaling`, None
in practice; gpt-oss's as `(hidden, positions)`, layers `(hidden, positions, residual)`:
`hidden_first` tells them apart) and takes logits from a logits processor. Each unit kind has
an adapter here (`ADAPTERS`; `KIND@VARIANT` for a variant of a kind: Qwen3.5's linear
attention, whose sub-units `conv`, `gates`, `out_gate` and `out_proj` have theirs); the donor module keeps
its own weights and dtype, and the adapter casts at the boundary. The MoE sub-units (router, experts) are swapped inside vLLM's fused-MoE runner
instead (`moe.py`).
"""

from __future__ import annotations

import torch
from torch import nn

from numbisect.backends.base import carry_layer_flags
from numbisect.common.errors import BackendError
from numbisect.patching.torchops import text_rotary


class VllmHF(nn.Module):
    """Base for vLLM-side adapters around a donor transformers module."""

    def __init__(self, inner: nn.Module, donor, engine_dtype: torch.dtype):
        super().__init__()
        self.inner = inner
        self.rdt = donor.dtype
        self.edt = engine_dtype
        self._donor_model = [donor.model]  # in a list: not a submodule of the engine
        self._donor_arch = donor.arch  # where the donor's family keeps its rotary embedding

    def sliding(self) -> bool:
        """The donor attention (or the attention of a donor layer) is a sliding-window one
        (gpt-oss's even layers): its mask is then the sliding-window causal mask."""
        attn = getattr(self.inner, "self_attn", self.inner)
        return getattr(attn, "sliding_window", None) is not None

    def hf_context(self, x: torch.Tensor, positions: torch.Tensor):
        """What the transformers model hands a layer for one unpadded sequence."""
        from transformers.masking_utils import (
            create_causal_mask,
            create_sliding_window_causal_mask,
        )

        model = self._donor_model[0]
        pos = positions.view(1, -1).long()
        x3 = x.view(1, x.shape[-2], x.shape[-1])
        mask = (create_sliding_window_causal_mask if self.sliding() else create_causal_mask)(
            config=model.config,
            inputs_embeds=x3,
            attention_mask=torch.ones(1, x3.shape[1], dtype=torch.long),
            past_key_values=None,
            position_ids=pos,
        )
        return {"attention_mask": mask, "position_ids": pos, "position_embeddings": text_rotary(self._donor_arch, self._donor_arch.rotary(model))(x3, pos)}


class VllmEmbed(VllmHF):
    def forward(self, input_ids):
        return self.inner(input_ids.long()).to(self.edt)


class VllmNorm(VllmHF):
    """vLLM RMSNorm: `norm(x)` or fused `norm(x, residual) -> (norm(x + residual), x + residual)`."""

    def forward(self, x, residual=None):
        if residual is None:
            return self.inner(x.to(self.rdt)).to(self.edt)
        stream = x + residual  # the residual add, in the engine's dtype as the engine keeps it
        return self.inner(stream.to(self.rdt)).to(self.edt), stream


def _no_extra(unit: str, extra: tuple) -> None:
    """vLLM's DeepSeek layers pass attention and layers one more argument, `llama_4_scaling`
    (None unless the config asks for it): the donor transformers module has no such input."""
    if any(v is not None for v in extra):
        raise BackendError(f"vLLM calls this {unit} with an argument the transformers module has no counterpart "
                           "for (llama_4_scaling in config.json): cannot swap it")


def hidden_first(a, b) -> tuple:
    """(positions, hidden) of a vLLM attention or layer call whose first two arguments are
    `a, b`: most families pass `(positions, hidden)`, gpt-oss `(hidden, positions)`;
    positions are integers, hidden states floats."""
    return (b, a) if isinstance(a, torch.Tensor) and a.is_floating_point() else (a, b)


class VllmAttn(VllmHF):
    """Attention, MLA included: `(positions, hidden[, llama_4_scaling]) -> hidden`. The donor
    gets transformers' inputs (position_embeddings, causal mask); an MLA donor computes its
    compressed latent itself."""

    def forward(self, positions, hidden_states, *extra):
        positions, hidden_states = hidden_first(positions, hidden_states)
        _no_extra("attention", extra)
        x = hidden_states.to(self.rdt)[None]
        out = self.inner(hidden_states=x, **{k: v for k, v in self.hf_context(x, positions).items() if k != "position_ids"})
        return out[0][0].to(self.edt)


class VllmRope(VllmHF):
    """MLA's rotary part (numbisect.backends.vllm.rope): `(packed q/k rope dims, positions) ->
    rotated`, computed by the donor's `MlaRope` (transformers' rotary function) with cos/sin
    from the donor's rotary embedding, in the donor's dtype (the engine's strides are its kernel's
    concern: unused)."""

    def forward(self, x, positions, strides=None):
        x3 = x.to(self.rdt)[None]
        rotary = text_rotary(self._donor_arch, self._donor_arch.rotary(self._donor_model[0]))
        cos_sin = rotary(x3, positions.view(1, -1).long())
        return self.inner(x3, position_embeddings=cos_sin)[0].to(self.edt)


class VllmLinearAttn(VllmHF):
    """Linear attention (Qwen3.5's Gated DeltaNet): `(hidden_states) -> hidden`. The donor runs
    on the one unpadded sequence from a zero conv and recurrent state: right for a prefill of
    the whole sequence (decode mode refuses attention swaps: numbisect.pipeline.decode)."""

    def forward(self, hidden_states):
        return self.inner(hidden_states=hidden_states.to(self.rdt)[None])[0].to(self.edt)


class VllmGatedNorm(VllmHF):
    """Linear attention's gated RMSNorm (the output gate): `(core, z) -> norm(core) * silu(z)`,
    both [tokens, heads, head dim] in vLLM; the donor normalises over the last dimension
    whatever the leading ones, so it takes them as they are."""

    def forward(self, x, z):
        return self.inner(x.to(self.rdt), z.to(self.rdt)).to(self.edt)


class VllmConv(VllmHF):
    """Gated DeltaNet's causal conv (numbisect.backends.vllm.gdn): `(x [tokens, channels], call)`,
    computed by the donor's `GdnConv` in the donor's dtype. The engine's own call still runs
    first, its output dropped: it writes the conv-state cache a later decode step reads."""

    def forward(self, x, call):
        fn, kwargs = call
        fn(x=x.transpose(0, 1), **kwargs)
        return self.inner(x.to(self.rdt)[None])[0].to(self.edt)


class VllmGates(VllmHF):
    """Gated DeltaNet's gates: `(ab [tokens, 2 * heads], call) -> (g, beta)` in float32, computed
    by the donor's `GdnGates` on its own `A_log` and `dt_bias`."""

    def forward(self, ab, call):
        return self.inner(ab.to(self.rdt)).float()


class VllmGatedShared(VllmHF):
    """A shared expert vLLM gates itself (Qwen3.5-MoE's Qwen2MoeMLP with `expert_gate`): the
    donor (transformers' ungated MLP), times the sigmoid of the block's `shared_expert_gate`
    as the block holds it now (the engine's, or its swap), as vLLM computes it."""

    def __init__(self, inner, donor, engine_dtype, block):
        super().__init__(inner, donor, engine_dtype)
        self._block = [block]  # in a list: not a submodule

    def forward(self, x):
        out = self.inner(x.to(self.rdt)).to(self.edt)
        return torch.sigmoid(self._block[0].shared_expert_gate(x)[0]) * out


class VllmLinearOut(VllmHF):
    """A vLLM linear layer (ReplicatedLinear: `x -> (out, bias)`) from a transformers nn.Linear."""

    def forward(self, x):
        return self.inner(x.to(self.rdt)).to(self.edt), None


class VllmBlock(VllmHF):
    """A whole MLP or MoE block: `[tokens, hidden] -> [tokens, hidden]` (a transformers block
    that returns `(hidden, router scores)`, gpt-oss's, gives its hidden states)."""

    def forward(self, hidden_states):
        out = self.inner(hidden_states.to(self.rdt)[None])
        return (out[0] if isinstance(out, tuple) else out)[0].to(self.edt)


class VllmLayer(VllmHF):
    """A whole decoder layer: `(positions, hidden, residual) -> (stream, zeros)`."""

    def keep_flags(self, old) -> None:
        """The flags the model reads from its layers (`base.LAYER_FLAGS`: vLLM's Qwen3-Next and
        Qwen3.5 read `use_attn_reduce_scatter_for_moe`), from the replaced layer; a layer
        under sequence-parallel MoE is refused (the adapter has no such path)."""
        if getattr(old, "use_attn_reduce_scatter_for_moe", False):
            raise BackendError("cannot swap a whole layer under vLLM's sequence-parallel MoE")
        carry_layer_flags(self, old)

    def forward(self, positions, hidden_states, residual, *extra):
        positions, hidden_states = hidden_first(positions, hidden_states)
        _no_extra("layer", extra)
        stream = hidden_states if residual is None else hidden_states + residual
        x = stream.to(self.rdt)[None]
        ctx = self.hf_context(x, positions)
        if hasattr(self.inner, "linear_attn"):  # its linear attention takes a 2-D padding mask, none here
            ctx["attention_mask"] = None
        out = self.inner(x, **ctx)
        out = (out[0] if isinstance(out, tuple) else out)[0].to(self.edt)
        return out, torch.zeros_like(out)


class VllmLogits(VllmHF):
    """The logits processor: `(lm_head, hidden) -> logits`, computed by the donor's lm_head."""

    def forward(self, lm_head, hidden_states, embedding_bias=None, *args, **kwargs):
        return self.inner(hidden_states.to(self.rdt))


ADAPTERS = {
    "embed": VllmEmbed,
    "norm": VllmNorm,
    "attn": VllmAttn,
    "attn@linear": VllmLinearAttn,
    "rope": VllmRope,
    "moe": VllmBlock,
    "mlp": VllmBlock,
    "shared_expert": VllmBlock,
    "shared_expert_gate": VllmLinearOut,
    "conv": VllmConv,
    "gates": VllmGates,
    "out_gate": VllmGatedNorm,
    "out_proj": VllmLinearOut,
    "layer": VllmLayer,
    "lm_head": VllmLogits,
}

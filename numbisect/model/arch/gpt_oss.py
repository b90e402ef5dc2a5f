"""gpt-oss (GptOssForCausalLM): every layer a sparse MoE block; attention with learned
per-head sinks, alternating sliding-window and full layers.

What differs from the other families, and where numbisect keeps it:

- Attention sinks: one learned logit per head (`self_attn.sinks` in transformers, `attn.sinks`
  in vLLM, read by its attention backend) joins every row's softmax and is dropped after it.
  It is a parameter of the attention module, so the `attn` unit carries it: a swapped
  attention is transformers' whole module, sinks included. Sliding-window layers
  (`layer_types`, even layers as released; vLLM hard-codes "every even layer") are a
  property of the same module: the swap's causal mask is built from the donor's config.
- Router: a linear layer with a bias (`mlp.router`); top-k of its logits, softmax over the
  chosen k (the same weights as a softmax over all experts renormalised over the top k).
- Experts: clamped SwiGLU (`swiglu_alpha` 1.702, `swiglu_limit` 7.0; interleaved gate/up
  columns; `(up + 1) * gate * sigmoid(alpha * gate)`) with biases on both projections, all
  held by transformers' `mlp.experts`, which a swap carries. vLLM's fused-MoE runner applies
  the same activation ("swigluoai", its alpha and limit fixed at the released values).

Module names: transformers `model.embed_tokens`, `self_attn`, `mlp.router`, `mlp.experts`;
vLLM `model.embedding`, `attn`, `mlp.router` (a GateLinear returning the logits alone),
`mlp.experts` (FusedMoE). vLLM's layers and attention take the hidden states first,
`(hidden_states, positions[, residual])`, where the other families' take the positions
first: the vLLM adapters and captures tell them apart by dtype. vLLM builds every RMSNorm
with eps 1e-5 whatever config.json says (the fixture keeps the released 1e-5).
"""

from numbisect.model.arch.base import ArchMap, RouterSpec

_HF = {
    "embed": "model.embed_tokens",
    "layers.{i}.input_norm": "model.layers.{i}.input_layernorm",
    "layers.{i}.attn": "model.layers.{i}.self_attn",
    "layers.{i}.post_attn_norm": "model.layers.{i}.post_attention_layernorm",
    "layers.{i}.moe": "model.layers.{i}.mlp",
    "layers.{i}.moe.router": "model.layers.{i}.mlp.router",
    "layers.{i}.moe.experts": "model.layers.{i}.mlp.experts",
    "layers.{i}": "model.layers.{i}",
    "final_norm": "model.norm",
    "lm_head": "lm_head",
}

ARCH = ArchMap(
    name="gpt_oss",
    architectures=("GptOssForCausalLM",),
    hf=_HF,
    vllm={
        **_HF,
        "embed": "model.embedding",
        "layers.{i}.attn": "model.layers.{i}.attn",
        "lm_head": "logits_processor",  # logits come from vLLM's logits processor
    },
    ffn_kind=lambda config, i: "moe",
    moe_sub_units=("router", "experts"),
    # Top-k of the logits, softmax over those k: softmax over all, renormalised over the top k.
    router_spec=lambda c: RouterSpec(c.num_experts_per_tok, c.num_local_experts, "softmax", True),
)

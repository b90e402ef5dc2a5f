"""Qwen3-MoE (Qwen3MoeForCausalLM): attention with q/k norm, a sparse MoE block per layer.

transformers: `mlp.gate` is a top-k router returning (logits, weights, indices);
`mlp.experts` takes (hidden, indices, weights). vLLM: `mlp.gate` is a GateLinear
returning (logits, bias); top-k, renormalisation and the weighted sum run inside
`mlp.experts` (FusedMoE).
"""

from numbisect.model.arch.base import ArchMap, RouterSpec


def _ffn_kind(config, i: int) -> str:
    sparse = config.num_experts > 0 and (i + 1) % config.decoder_sparse_step == 0
    return "moe" if sparse and i not in (config.mlp_only_layers or []) else "mlp"


def _router(config) -> RouterSpec:
    """Softmax over the experts, top-k, renormalised when norm_topk_prob."""
    return RouterSpec(config.num_experts_per_tok, config.num_experts, "softmax", bool(config.norm_topk_prob))


# transformers and vLLM name these modules alike; only the logits differ.
_HF = {
    "embed": "model.embed_tokens",
    "layers.{i}.input_norm": "model.layers.{i}.input_layernorm",
    "layers.{i}.attn": "model.layers.{i}.self_attn",
    "layers.{i}.post_attn_norm": "model.layers.{i}.post_attention_layernorm",
    "layers.{i}.moe": "model.layers.{i}.mlp",
    "layers.{i}.moe.router": "model.layers.{i}.mlp.gate",
    "layers.{i}.moe.experts": "model.layers.{i}.mlp.experts",
    "layers.{i}.mlp": "model.layers.{i}.mlp",
    "layers.{i}": "model.layers.{i}",
    "final_norm": "model.norm",
    "lm_head": "lm_head",
}

ARCH = ArchMap(
    name="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM",),
    hf=_HF,
    vllm={**_HF, "lm_head": "logits_processor"},  # logits come from vLLM's logits processor
    ffn_kind=_ffn_kind,
    moe_sub_units=("router", "experts"),
    router_spec=_router,
)

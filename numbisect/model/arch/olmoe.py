"""OLMoE (OlmoeForCausalLM): every layer a sparse MoE block; attention with q/k norms over
the whole projection (all heads at once, not per head).

transformers and vLLM name the modules as Qwen3-MoE does (`self_attn`, `mlp.gate`,
`mlp.experts`), and the checkpoint keeps transformers' per-expert names. Routing:
softmax over the experts, top-k; the chosen weights are renormalised only when
`norm_topk_prob` (False in the released OLMoE models). vLLM 0.32's OLMoE never
renormalises and builds every RMSNorm with eps 1e-5, whatever config.json says: a
checkpoint with `norm_topk_prob: true` or another `rms_norm_eps` diverges there for that
reason (the fixture keeps both at the released values).
"""

from numbisect.model.arch.base import ArchMap, RouterSpec
from numbisect.model.arch.qwen3_moe import ARCH as _QWEN

ARCH = ArchMap(
    name="olmoe",
    architectures=("OlmoeForCausalLM",),
    hf=_QWEN.hf,
    vllm=_QWEN.vllm,
    ffn_kind=lambda config, i: "moe",
    moe_sub_units=("router", "experts"),
    router_spec=lambda c: RouterSpec(c.num_experts_per_tok, c.num_experts, "softmax", bool(c.norm_topk_prob)),
)

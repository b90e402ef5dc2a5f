"""GLM-4-MoE (Glm4MoeForCausalLM): dense first layers, then MoE blocks with a shared expert.

transformers: `mlp.gate` (top-k router), `mlp.experts`, `mlp.shared_experts`; the
block adds the shared expert's output to the routed sum. vLLM: `mlp.gate` is a
GateLinear; FusedMoE `mlp.experts` runs routing, the routed sum and the shared expert.
"""

from numbisect.model.arch.base import ArchMap, RouterSpec
from numbisect.model.arch.qwen3_moe import ARCH as _QWEN


def _router(c) -> RouterSpec:
    """Sigmoid scores; the choice adds e_score_correction_bias and keeps the best topk_group of
    n_group groups; weights are the unbiased scores, renormalised, times routed_scaling_factor."""
    return RouterSpec(c.num_experts_per_tok, c.n_routed_experts, "sigmoid", bool(c.norm_topk_prob),
                      n_group=c.n_group, topk_group=c.topk_group, scaling=float(c.routed_scaling_factor), biased=True)

ARCH = ArchMap(
    name="glm4_moe",
    architectures=("Glm4MoeForCausalLM",),
    hf={**_QWEN.hf, "layers.{i}.moe.shared_expert": "model.layers.{i}.mlp.shared_experts"},
    vllm={**_QWEN.vllm, "layers.{i}.moe.shared_expert": "model.layers.{i}.mlp.shared_experts"},
    ffn_kind=lambda config, i: "moe" if i >= config.first_k_dense_replace else "mlp",
    moe_sub_units=("router", "experts", "shared_expert"),
    router_spec=_router,
)

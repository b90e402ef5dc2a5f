"""Mixtral (MixtralForCausalLM): every layer a sparse MoE block, no shared expert.

transformers names the block `mlp`; vLLM names it `block_sparse_moe`.
"""

from numbisect.model.arch.base import ArchMap, RouterSpec
from numbisect.model.arch.qwen3_moe import ARCH as _QWEN

_VLLM_BLOCK = "model.layers.{i}.block_sparse_moe"

ARCH = ArchMap(
    name="mixtral",
    architectures=("MixtralForCausalLM",),
    hf=_QWEN.hf,
    vllm={
        **_QWEN.vllm,
        "layers.{i}.moe": _VLLM_BLOCK,
        "layers.{i}.moe.router": _VLLM_BLOCK + ".gate",
        "layers.{i}.moe.experts": _VLLM_BLOCK + ".experts",
    },
    ffn_kind=lambda config, i: "moe",
    moe_sub_units=("router", "experts"),
    # Softmax over the experts, top-k, always renormalised.
    router_spec=lambda c: RouterSpec(c.num_experts_per_tok, c.num_local_experts, "softmax", True),
    # Checkpoints keep the original names: `block_sparse_moe`, experts' w1 (gate), w3 (up), w2 (down).
    ckpt_renames={"block_sparse_moe.": "mlp."},
    ckpt_expert_weights={"w1": "gate", "w3": "up", "w2": "down"},
)

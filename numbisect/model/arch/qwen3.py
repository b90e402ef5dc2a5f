"""Dense Qwen3 (Qwen3ForCausalLM): the same layer as Qwen3-MoE with a dense MLP."""

from numbisect.model.arch.base import ArchMap
from numbisect.model.arch.qwen3_moe import ARCH as _MOE

ARCH = ArchMap(
    name="qwen3",
    architectures=("Qwen3ForCausalLM",),
    hf={k: v for k, v in _MOE.hf.items() if ".moe" not in k},
    vllm={k: v for k, v in _MOE.vllm.items() if ".moe" not in k},
    ffn_kind=lambda config, i: "mlp",
)

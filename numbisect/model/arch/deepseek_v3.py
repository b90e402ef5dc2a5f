"""DeepSeek-V3 (DeepseekV3ForCausalLM): MLA attention, dense first layers, then MoE blocks
with a shared expert and the noaux_tc router.

Attention is multi-head latent attention (MLA): queries through a low-rank `q_a_proj` /
`q_b_proj`, keys and values from one compressed latent (`kv_a_proj_with_mqa`, normed, then
`kv_b_proj`); the `attn` unit is the whole of it in both backends. transformers calls it
with `position_embeddings` and a mask, vLLM's `DeepseekV2MLAAttention` with `(positions,
hidden, llama_4_scaling)`; the vLLM attention adapter takes either. Its rotary part is a
unit of its own, `layers.{i}.attn.rope` (kind `rope`): the rotated query heads' and shared
key's rope dims (numbisect.backends.mla_rope). Neither engine has a module for it per layer:
transformers calls a module-level function, vLLM's `mla_attn.rotary_emb` is one rotary
embedding shared by every layer; each backend puts one in (`self_attn.rope` by
numbisect.backends.hf.rope, `self_attn.mla_attn.rotary_emb.unit` by
numbisect.backends.vllm.rope).

The MoE block is GLM-4-MoE's: transformers `mlp.gate` (sigmoid router with
`e_score_correction_bias` and expert groups), `mlp.experts`, `mlp.shared_experts`; vLLM
`mlp.gate` (GateLinear), FusedMoE `mlp.experts`, `mlp.shared_experts`. vLLM applies
`routed_scaling_factor` to the routed sum, not to the weights (the fused-MoE code in
`backends/vllm/moe.py` accounts for it). vLLM reads the router from config.json's
`topk_method` ("noaux_tc": with the correction bias) and `scoring_func` ("sigmoid").
"""

from numbisect.model.arch.base import ArchMap, RouterSpec
from numbisect.model.arch.glm4_moe import ARCH as _GLM


def _router(c) -> RouterSpec:
    """Sigmoid scores; the choice adds e_score_correction_bias and keeps the best topk_group of
    n_group groups (a group scored by its two best); weights are the unbiased scores,
    renormalised when norm_topk_prob, times routed_scaling_factor."""
    return RouterSpec(c.num_experts_per_tok, c.n_routed_experts, "sigmoid", bool(c.norm_topk_prob),
                      n_group=c.n_group or 1, topk_group=c.topk_group or 1,
                      scaling=float(c.routed_scaling_factor), biased=True)


ARCH = ArchMap(
    name="deepseek_v3",
    architectures=("DeepseekV3ForCausalLM",),
    # transformers and vLLM name the modules as GLM-4-MoE does; the rope modules are numbisect's
    hf={**_GLM.hf, "layers.{i}.attn.rope": "model.layers.{i}.self_attn.rope"},
    vllm={**_GLM.vllm, "layers.{i}.attn.rope": "model.layers.{i}.self_attn.mla_attn.rotary_emb.unit"},
    ffn_kind=lambda config, i: "moe" if i >= config.first_k_dense_replace else "mlp",
    moe_sub_units=("router", "experts", "shared_expert"),
    attn_sub_units=("rope",),
    router_spec=_router,
)

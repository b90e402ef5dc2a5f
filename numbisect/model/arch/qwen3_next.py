"""Qwen3-Next (Qwen3NextForCausalLM): a hybrid of linear attention and gated full
attention, sparse MoE blocks with a gated shared expert; the family Qwen3.5 grew from.

`config.layer_types[i]` says which attention layer i has (by default every fourth layer
is full attention, `full_attention_interval` 4):
- "linear_attention": Gated DeltaNet, transformers `linear_attn` (Qwen3NextGatedDeltaNet).
  Unlike Qwen3.5's split projections it has two fused ones, grouped per key head:
  `in_proj_qkvz` gives, for each key head, [q, k, v, z] (v and z for the value heads of
  that group) and `in_proj_ba` gives [b, a] per group; then the causal depthwise `conv1d`
  over q, k, v, beta = sigmoid(b), the decay g from `A_log`/`dt_bias`/a, the delta-rule
  recurrence, the gated RMSNorm `norm` with z as its gate, `out_proj`. vLLM's
  QwenGatedDeltaNetAttention loads the same two checkpoint tensors into its own
  `in_proj_qkvz`/`in_proj_ba` (`gqa_interleaved_layout`). The unit is `layers.{i}.attn`
  with variant "linear": a swap carries the whole transformers module (both projections
  in transformers' layout, conv, gates, norm, out_proj: everything it reads), called by
  vLLM as `(hidden_states=...)` and run on the one unpadded sequence from a zero state.
  Its sub-units `layers.{i}.attn.conv`, `.gates`, `.out_gate` (the gated RMSNorm) and
  `.out_proj` are Qwen3.5-MoE's (conv channels q, k, v and gates a, b after transformers'
  regrouping, as vLLM's kernel sees them; both sides order the value heads alike: transformers' per-key-head
  grouping and vLLM's `fix_query_key_value_ordering` give z and the core output in the
  same head order).
- "full_attention": transformers `self_attn` (Qwen3NextAttention): q/k norms, an output
  gate from `q_proj` (queries and a per-head gate, sigmoid(gate) scales the attention
  output before `o_proj`), partial rotary; vLLM `(hidden_states=..., positions=...)`.
The FFN: a sparse MoE block where `(i + 1) % decoder_sparse_step == 0` and i is not in
`mlp_only_layers`, else a dense MLP (`ffn_kind`, as Qwen3-MoE). The MoE block: `mlp.gate`
(softmax top-k router, renormalised when `norm_topk_prob`, which both transformers and
vLLM honour), `mlp.experts`, `mlp.shared_expert` and `mlp.shared_expert_gate` (a linear map
to one logit whose sigmoid scales the shared expert's output): the sub-unit
`shared_expert_gate`, handled as Qwen3.5-MoE's (backends/vllm/moe.py, adapters.py). Norms
are zero-centred RMSNorms (weight + 1) on both sides. Logits come from vLLM's logits
processor.
"""

from numbisect.model.arch.base import ArchMap
from numbisect.model.arch.qwen3_5_moe import (  # the same module tree and layer pattern
    _HF,
    LINEAR_SUB_UNITS,
    LINEAR_TENSORS,
    _attn_variant,
)
from numbisect.model.arch.qwen3_moe import _ffn_kind, _router

ARCH = ArchMap(
    name="qwen3_next",
    architectures=("Qwen3NextForCausalLM",),
    hf=_HF,
    vllm={**_HF, "lm_head": "logits_processor"},  # vLLM names the modules alike
    ffn_kind=_ffn_kind,
    moe_sub_units=("router", "experts", "shared_expert", "shared_expert_gate"),
    router_spec=_router,
    attn_variant=_attn_variant,
    variant_attn_sub_units=LINEAR_SUB_UNITS,
    hf_tensors=LINEAR_TENSORS,
)

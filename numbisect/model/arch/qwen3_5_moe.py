"""Qwen3.5-MoE, text model (Qwen3_5MoeForCausalLM): a hybrid of linear attention and gated
full attention, every layer a sparse MoE block with a gated shared expert.

`config.layer_types[i]` says which attention layer i has:
- "linear_attention" (most layers): Gated DeltaNet, transformers `linear_attn`
  (Qwen3_5MoeGatedDeltaNet): `in_proj_qkv` then a causal depthwise `conv1d`, the gates
  `in_proj_b` (beta, sigmoid) and `in_proj_a` with `A_log`/`dt_bias` (the decay g), the
  delta-rule recurrence over a per-head [k, v] state, the gated RMSNorm `norm` with
  `in_proj_z` as its output gate, `out_proj`. The unit is `layers.{i}.attn` with variant
  "linear": a swap carries the whole module (conv, gates, state handling); it takes no
  rotary cos/sin. Four sub-units, in execution order:
  `layers.{i}.attn.conv` (kind `conv`: the causal depthwise conv and its activation,
  [tokens, q + k + v channels], in and out) and `layers.{i}.attn.gates` (kind `gates`:
  [tokens, 2 * value heads] (a, b) in, (g, beta) out, float32): modules numbisect puts in on
  both sides, as transformers computes both without a module call of its own and vLLM-CPU
  inside its custom op `cpu_gdn_attention_core` (backends/hf/gdn.py, backends/vllm/gdn.py;
  prefill only: a decode step's conv and gates are not routed); then `layers.{i}.attn.out_gate`
  (kind `out_gate`, the gated RMSNorm `norm(core, z)` = rmsnorm(core) * silu(z), per value
  head; canonical output [tokens, value heads * head dim] in head order, as transformers
  flattens [tokens * heads, head dim] and vLLM [tokens, heads, head dim]) and
  `layers.{i}.attn.out_proj` (kind `out_proj`, the projection back to the hidden size).
  The delta-rule recurrence is no unit (its state is: numbisect.pipeline.recurrent); a fault there
  is named as the attention unit, with no sub-unit fixing it.
- "full_attention": transformers `self_attn` (Qwen3_5MoeAttention): Qwen3's attention
  with q/k norms and an output gate (`q_proj` gives the queries and a per-head gate,
  sigmoid(gate) scales the attention output before `o_proj`), partial rotary.
The MoE block: `mlp.gate` (softmax top-k router, always renormalised; it ignores
`norm_topk_prob`), `mlp.experts`, `mlp.shared_expert`, and `mlp.shared_expert_gate` (a
linear map to one logit; the block multiplies the shared expert's output by its sigmoid
before adding it): the sub-unit `shared_expert_gate` of kind `shared_expert_gate`, so a
damaged gate is a sub-unit of its own and the sub-unit swaps cover every weight.
vLLM (Qwen3_5MoeForCausalLM, vllm/model_executor/models/qwen3_5.py and qwen3_next.py) names
the modules alike: `linear_attn` is called `(hidden_states=...)` (the adapter runs the
transformers module on the one unpadded sequence from a zero state: prefill only, as for
any attention); `self_attn` `(hidden_states=..., positions=...)`; norms are GemmaRMSNorm
(weight + 1, as transformers'). vLLM's shared expert (Qwen2MoeMLP) applies its gate
itself (`expert_gate`, the block's `shared_expert_gate`): its capture is read at its
`down_proj`, before the gate, as transformers' `shared_expert` gives it, and a swapped
shared expert is gated by the engine's (or the swapped) `shared_expert_gate`
(backends/vllm/moe.py). Logits come from vLLM's logits processor.
"""

from numbisect.model.arch.base import ArchMap, RouterSpec
from numbisect.model.arch.qwen3_moe import _HF as _QWEN_HF

_HF = {
    **_QWEN_HF,
    "layers.{i}.attn@linear": "model.layers.{i}.linear_attn",
    "layers.{i}.attn.conv": "model.layers.{i}.linear_attn.conv",
    "layers.{i}.attn.gates": "model.layers.{i}.linear_attn.gates",
    "layers.{i}.attn.out_gate": "model.layers.{i}.linear_attn.norm",
    "layers.{i}.attn.out_proj": "model.layers.{i}.linear_attn.out_proj",
    "layers.{i}.moe.shared_expert": "model.layers.{i}.mlp.shared_expert",
    "layers.{i}.moe.shared_expert_gate": "model.layers.{i}.mlp.shared_expert_gate",
}


def _attn_variant(config, i: int) -> str:
    return "linear" if config.layer_types[i] == "linear_attention" else ""


LINEAR_SUB_UNITS = {"linear": ("conv", "gates", "out_gate", "out_proj")}  # Gated DeltaNet's sub-units, in execution order
# The attention's tensors the conv and gates modules read (backends/hf/gdn.py)
LINEAR_TENSORS = {
    "layers.{i}.attn.conv": ("model.layers.{i}.linear_attn.conv1d",),
    "layers.{i}.attn.gates": ("model.layers.{i}.linear_attn.A_log", "model.layers.{i}.linear_attn.dt_bias"),
}


ARCH = ArchMap(
    name="qwen3_5_moe",
    architectures=("Qwen3_5MoeForCausalLM",),
    rotary_ids_3d=True,
    hf=_HF,
    vllm={**_HF, "lm_head": "logits_processor"},  # vLLM names the modules alike
    ffn_kind=lambda config, i: "moe",
    moe_sub_units=("router", "experts", "shared_expert", "shared_expert_gate"),
    router_spec=lambda c: RouterSpec(c.num_experts_per_tok, c.num_experts, "softmax", True),
    attn_variant=_attn_variant,
    variant_attn_sub_units=LINEAR_SUB_UNITS,
    hf_tensors=LINEAR_TENSORS,
)

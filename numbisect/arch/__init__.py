"""Architecture maps: per model family, where each canonical unit lives in each backend.

One file per family, mostly data (like a state-dict name map): `hf` and `vllm` map a
unit pattern to a module path; `{i}` is the layer index. How a module's output is read
into canonical form is set by the unit kind (see `backends.base.READERS`), with
per-family overrides in `hf_readers` / `vllm_readers`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from numbisect.errors import InputError
from numbisect.units import Unit, build_units


@dataclass(frozen=True)
class ArchMap:
    name: str  # family name, e.g. "qwen3_moe"
    architectures: tuple[str, ...]  # config.json `architectures` values it covers
    hf: dict[str, str]  # unit pattern -> module path in the transformers model
    vllm: dict[str, str]  # unit pattern -> module path in the vLLM model
    ffn_kind: Callable[[Any, int], str]  # (config, layer) -> "moe" or "mlp"
    moe_sub_units: tuple[str, ...] = ()  # sub-units of a moe block, in execution order
    hf_readers: dict[str, str] = field(default_factory=dict)  # unit pattern -> reader override
    vllm_readers: dict[str, str] = field(default_factory=dict)
    hf_auto: str = "AutoModelForCausalLM"  # the transformers auto class that loads it
    hf_rotary: str = "model.rotary_emb"  # the text model's rotary embedding (cos/sin from positions)
    mrope: bool = False  # cos/sin from 3-D positions (M-RoPE): a layer's 1-D position ids cannot give them
    vision: bool = False  # has `vision` and `vision.projector` units (image inputs)
    router_spec: Callable[[Any], Any] | None = None  # text config -> routing.RouterSpec (None: dense)
    # Checkpoint names where they differ from the transformers modules' (the layer stream reads
    # the safetensors files itself): name fragments renamed, and one expert's weights' names
    # -> their role in transformers' fused `experts.gate_up_proj` / `down_proj`.
    ckpt_renames: dict[str, str] = field(default_factory=dict)
    ckpt_expert_weights: dict[str, str] = field(
        default_factory=lambda: {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"})

    def units(self, config) -> list[Unit]:
        text = config.get_text_config()
        n = text.num_hidden_layers
        return build_units(n, [self.ffn_kind(text, i) for i in range(n)], self.moe_sub_units, vision=self.vision)

    def path(self, backend: str, unit: Unit) -> str | None:
        table = self.hf if backend == "hf" else self.vllm
        pattern = table.get(unit.pattern)
        return None if pattern is None else pattern.format(i=unit.layer)

    def hf_path(self, pattern: str, layer: int | None = None) -> str:
        """The transformers module path of a unit pattern (`layers.{i}.attn`, `final_norm`)."""
        return self.hf[pattern].format(i=layer)

    def rotary(self, model):
        """The rotary embedding module of a transformers `model` of this family."""
        return model.get_submodule(self.hf_rotary)

    def layer_rotary(self, model):
        """The rotary embedding a swapped or upcast attention/layer recomputes its cos/sin with,
        in its own dtype, from the position ids its layer gets; None under M-RoPE, where those
        1-D ids cannot give them (the adapter then keeps the engine's cos/sin, cast)."""
        return None if self.mrope else self.rotary(model)


def _registry() -> dict[str, ArchMap]:
    from numbisect.arch import glm4_moe, mixtral, qwen3, qwen3_moe, qwen3_vl_moe

    maps = [qwen3_moe.ARCH, qwen3.ARCH, glm4_moe.ARCH, mixtral.ARCH, qwen3_vl_moe.ARCH]
    return {a: m for m in maps for a in m.architectures}


def supported() -> list[str]:
    return sorted(_registry())


def arch_for(config) -> ArchMap:
    archs = getattr(config, "architectures", None) or []
    archs = [archs] if isinstance(archs, str) else archs
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise InputError(f"config.json: architectures must be a list of class names, got {archs!r}")
    reg = _registry()
    for a in archs:
        if a in reg:
            return reg[a]
    raise InputError(
        f"unsupported architecture {', '.join(archs) or '(none in config.json)'}; "
        f"supported: {', '.join(supported())}"
    )

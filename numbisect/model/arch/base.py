"""What an architecture map is: `ArchMap` (one per model family, in the family's file)
and `RouterSpec` (how a MoE family routes: top-k and scoring, read from its config).

Pure data, no torch: the family files, `arch_for` (numbisect.model.arch) and `numbisect.pipeline.routing`
all import from here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable

from numbisect.model.units import Unit, build_units


@dataclass(frozen=True)
class RouterSpec:
    top_k: int  # experts chosen per token
    num_experts: int  # routed experts
    scoring: str  # "softmax" or "sigmoid": how logits become scores
    norm_topk: bool  # chosen weights renormalised to sum to 1
    n_group: int = 1  # expert groups (GLM): only the best topk_group groups are eligible
    topk_group: int = 1
    scaling: float = 1.0  # routed_scaling_factor applied to the weights
    biased: bool = False  # e_score_correction_bias added to the scores for the choice only

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ArchMap:
    name: str  # family name, e.g. "qwen3_moe"
    architectures: tuple[str, ...]  # config.json `architectures` values it covers
    hf: dict[str, str]  # unit pattern -> module path in the transformers model
    vllm: dict[str, str]  # unit pattern -> module path in the vLLM model
    ffn_kind: Callable[[Any, int], str]  # (config, layer) -> "moe" or "mlp"
    moe_sub_units: tuple[str, ...] = ()  # sub-units of a moe block, in execution order
    attn_sub_units: tuple[str, ...] = ()  # sub-units of attention (MLA: "rope"; GLM-5: "indexer"), in execution order
    hf_readers: dict[str, str] = field(default_factory=dict)  # unit pattern -> reader override
    vllm_readers: dict[str, str] = field(default_factory=dict)
    hf_auto: str = "AutoModelForCausalLM"  # the transformers auto class that loads it
    hf_rotary: str = "model.rotary_emb"  # the text model's rotary embedding (cos/sin from positions)
    mrope: bool = False  # cos/sin from 3-D positions (M-RoPE): a layer's 1-D position ids cannot give them
    # Its rotary embedding takes M-RoPE's (3, batch, n) ids even in the text model, whose own
    # forward expands text positions to them (Qwen3.5 under transformers before 5.19; 5.19
    # expands inside the rotary embedding): whoever calls it alone expands them too.
    rotary_ids_3d: bool = False
    vision: bool = False  # has `vision` and `vision.projector` units (image inputs)
    router_spec: Callable[[Any], Any] | None = None  # text config -> RouterSpec (None: dense)
    # Checkpoint names where they differ from the transformers modules' (the layer stream reads
    # the safetensors files itself): name fragments renamed, and one expert's weights' names
    # -> their role in transformers' fused `experts.gate_up_proj` / `down_proj`.
    ckpt_renames: dict[str, str] = field(default_factory=dict)
    ckpt_expert_weights: dict[str, str] = field(
        default_factory=lambda: {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"})
    # Families whose layers differ in their attention module (Qwen3.5: linear attention in most
    # layers): (config, layer) -> "" or a variant name; the unit stays `layers.{i}.attn` and its
    # module path is looked up under `layers.{i}.attn@VARIANT` first.
    attn_variant: Callable[[Any, int], str] | None = None
    # Sub-units of attention in the layers of one variant only (Qwen3.5's linear attention:
    # "out_gate", "out_proj"), after `attn_sub_units`, in execution order.
    variant_attn_sub_units: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # Checkpoint tensors (transformers paths, unit pattern -> paths) a unit reads that its own
    # module path does not prefix: a module numbisect puts in (Gated DeltaNet's `conv` and
    # `gates` read the attention's `conv1d`, `A_log` and `dt_bias`). numbisect.model.ckptdiff names
    # a damaged tensor's unit by them.
    hf_tensors: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def units(self, config) -> list[Unit]:
        text = config.get_text_config()
        n = text.num_hidden_layers
        variants = [self.attn_variant(text, i) if self.attn_variant else "" for i in range(n)]
        subs = [self.attn_sub_units + self.variant_attn_sub_units.get(v, ()) for v in variants]
        units = build_units(n, [self.ffn_kind(text, i) for i in range(n)], self.moe_sub_units, vision=self.vision,
                            attn_sub_units=subs)
        if self.attn_variant is None:
            return units
        return [replace(u, variant=self.attn_variant(text, u.layer)) if u.kind == "attn" else u for u in units]

    def path(self, names: str, unit: Unit) -> str | None:
        """The module path of `unit` in a model whose modules are named as `names` says
        ("hf": transformers, "vllm": vLLM; a backend's `module_names`); None when the
        family has no such module there."""
        tables = {"hf": self.hf, "vllm": self.vllm}
        if names not in tables:
            raise ValueError(f"no module-name table {names!r} in {self.name} (have: hf, vllm)")
        table = tables[names]
        pattern = table.get(f"{unit.pattern}@{unit.variant}") if unit.variant else None
        pattern = pattern or table.get(unit.pattern)
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

"""Checkpoint faults: damaged copies of the reference checkpoint, as ground truth for the
search (`bisect selftest --checkpoint-faults`).

The planted faults of `numbisect.faults` are runtime noise on the engine's own copy of the
reference; these are the bugs a conversion ships. Each kind writes a copy of the
reference directory with one kind of damage, at a layer drawn by a seeded RNG:

- `norm_scale`: one RMSNorm weight (input or post-attention, drawn) times 1.5;
- `gate_up_swap`: gate and up projections swapped in one layer's FFN (dense MLP, every
  expert, the shared expert; Mixtral's w1/w3);
- `experts_swap`: two experts of one MoE layer trade their weights (MoE families);
- `heads_permuted`: the query projection's first two heads trade places (two or more heads);
- `config_eps`: `rms_norm_eps` times 100 in config.json (every norm reads it);
- `every_layer_norm`: every layer's post-attention norm weight times 1.2 (one kind, every layer).

`expected` says what a correct search names: the units whose tensors were damaged (the
search may name their parent block, or sub-units of them), or, for the last two, the
kind-level culprit (`kinds`).
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path

KINDS = ("norm_scale", "gate_up_swap", "experts_swap", "heads_permuted", "config_eps", "every_layer_norm")


@dataclass
class CkptFault:
    kind: str
    where: str  # what was damaged, in words ("layer 2", "experts 3 and 5 of layer 1")
    units: list[str] = field(default_factory=list)  # units whose tensors were damaged
    kinds: list[str] = field(default_factory=list)  # a kind-level culprit expected instead (config, every layer)
    tensors: list[str] = field(default_factory=list)  # checkpoint tensor names changed
    config: dict = field(default_factory=dict)  # config.json fields changed: name -> new value

    def to_dict(self) -> dict:
        return {"kind": self.kind, "where": self.where, "units": self.units, "kinds": self.kinds,
                "tensors": len(self.tensors), "config": self.config}


def _keys(path: str) -> list[str]:
    from safetensors import safe_open

    keys = []
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            keys += list(fh.keys())
    return keys


def plan(ref_path: str, raw_config: dict, config, kinds=KINDS, seed: int = 0) -> tuple[list[CkptFault], list[dict]]:
    """The faults to write for this checkpoint (one per kind it has), and the kinds skipped
    with why. `raw_config`: its config.json; `config`: its transformers config."""
    from numbisect.arch import arch_for
    from numbisect.ckptdiff import _apply, _unit_of, _unit_prefixes

    rng = random.Random(seed)
    arch = arch_for(config)
    text = config.get_text_config()
    n = text.num_hidden_layers
    keys = _keys(ref_path)
    prefixes = _unit_prefixes(arch, config)

    def unit(key: str) -> str | None:
        return _unit_of(_apply(key, arch.ckpt_renames), prefixes)

    def layer_keys(i: int, *parts: str) -> list[str]:
        return [k for k in keys if f"layers.{i}." in k and any(p in k for p in parts)]

    out, skipped = [], []
    for kind in kinds:
        if kind not in KINDS:
            raise ValueError(f"unknown checkpoint fault {kind!r}")
        i = rng.randrange(n)
        if kind == "norm_scale":
            which = rng.choice(["input_layernorm", "post_attention_layernorm"])
            ks = layer_keys(i, f".{which}.weight")
            out.append(CkptFault(kind, f"{which} of layer {i} x1.5", sorted({unit(k) for k in ks}), tensors=ks))
        elif kind == "gate_up_swap":
            ks = layer_keys(i, "gate_proj", ".w1.")
            out.append(CkptFault(kind, f"gate/up of layer {i}", sorted({unit(k) for k in ks}), tensors=ks))
        elif kind == "experts_swap":
            moe = [j for j in range(n) if layer_keys(j, ".experts.0.")]
            if not moe:
                skipped.append({"kind": kind, "reason": f"{arch.name} has no routed experts"})
                continue
            i = rng.choice(moe)
            count = len({k.split(".experts.")[1].split(".")[0] for k in layer_keys(i, ".experts.")})
            a, b = rng.sample(range(count), 2)
            ks = [k for k in layer_keys(i, f".experts.{a}.")]
            out.append(CkptFault(kind, f"experts {a} and {b} of layer {i}", sorted({unit(k) for k in ks}),
                                 tensors=ks + [k.replace(f".experts.{a}.", f".experts.{b}.") for k in ks]))
        elif kind == "heads_permuted":
            if text.num_attention_heads < 2:
                skipped.append({"kind": kind, "reason": "one attention head"})
                continue
            ks = layer_keys(i, "self_attn.q_proj.weight")
            out.append(CkptFault(kind, f"query heads 0 and 1 of layer {i}", sorted({unit(k) for k in ks}), tensors=ks))
        elif kind == "config_eps":
            eps = raw_config.get("rms_norm_eps", (raw_config.get("text_config") or {}).get("rms_norm_eps"))
            if not isinstance(eps, (int, float)):
                skipped.append({"kind": kind, "reason": "no rms_norm_eps in config.json"})
                continue
            out.append(CkptFault(kind, f"rms_norm_eps {eps:g} -> {eps * 100:g}", kinds=["norm"],
                                 config={"rms_norm_eps": eps * 100}))
        elif kind == "every_layer_norm":
            ks = [k for j in range(n) for k in layer_keys(j, ".post_attention_layernorm.weight")]
            out.append(CkptFault(kind, f"post_attention_layernorm of all {n} layers x1.2", kinds=["norm"], tensors=ks))
    return out, skipped


def write_copy(ref_path: str, dest: str, fault: CkptFault, head_dim: int) -> str:
    """A copy of the reference directory under `dest` with `fault` applied; returns its path."""
    import torch
    from safetensors.torch import load_file, save_file

    out = Path(dest) / fault.kind
    shutil.copytree(ref_path, out)
    for f in sorted(out.glob("*.safetensors")):
        w = load_file(f)
        touched = False
        for k in [k for k in fault.tensors if k in w]:
            touched = True
            if fault.kind == "norm_scale":
                w[k] = w[k] * 1.5
            elif fault.kind == "every_layer_norm":
                w[k] = w[k] * 1.2
            elif fault.kind == "heads_permuted":
                blocks = list(w[k].split(head_dim))
                w[k] = torch.cat([blocks[1], blocks[0], *blocks[2:]]).contiguous()
        if fault.kind == "gate_up_swap":
            for k in [k for k in fault.tensors if k in w]:
                other = k.replace("gate_proj", "up_proj").replace(".w1.", ".w3.")
                w[k], w[other] = w[other], w[k]
        if fault.kind == "experts_swap":
            half = len(fault.tensors) // 2
            for a, b in zip(fault.tensors[:half], fault.tensors[half:]):
                if a in w and b in w:
                    w[a], w[b] = w[b], w[a]
        if touched:
            save_file(w, f, metadata={"format": "pt"})
    if fault.config:
        cfg_path = out / "config.json"
        cfg = json.loads(cfg_path.read_text())
        scope = cfg["text_config"] if "text_config" in cfg and "rms_norm_eps" not in cfg else cfg
        scope.update(fault.config)
        cfg_path.write_text(json.dumps(cfg, indent=2))
    return str(out)


def named(fault: CkptFault, culprits: list[str], systematic: dict | None, parent_of) -> str | None:
    """How the search's answer matches the damage, or None (missed): "exact" (the damaged
    units), "parent" (their one common block, not a layer), "sub-unit" (inside them), or
    "kind" (a kind-level culprit holding the expected kinds)."""
    if fault.kinds:
        got = (systematic or {}).get("kinds") or []
        return "kind" if set(fault.kinds) <= set(got) else None
    if not culprits:
        return None
    if sorted(culprits) == sorted(fault.units):
        return "exact"
    parents = {parent_of(u) for u in fault.units}
    if len(parents) == 1 and culprits == list(parents) and not culprits[0].split(".")[-1].isdigit():
        return "parent"
    if all(any(c.startswith(u + ".") for u in fault.units) for c in culprits):
        return "sub-unit"
    return None

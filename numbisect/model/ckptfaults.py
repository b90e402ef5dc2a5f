"""Checkpoint faults: damaged copies of the reference checkpoint, as ground truth for the
search (`bisect selftest --checkpoint-faults`).

The planted faults of `numbisect.patching.faults` are runtime noise on the engine's own copy of the
reference; these are the bugs a conversion ships. Each kind writes a copy of the
reference directory with one kind of damage, at a layer drawn by a seeded RNG:

- `norm_scale`: one RMSNorm weight (input or post-attention, drawn) times 1.5;
- `gate_up_swap`: gate and up projections swapped in one layer's FFN (dense MLP, every
  expert, the shared expert; Mixtral's w1/w3; the two halves of a fused
  `experts.gate_up_proj`, Qwen3-VL-MoE);
- `experts_swap`: two experts of one MoE layer trade their weights (MoE families; their
  slices of the fused expert tensors where the checkpoint keeps them fused);
- `heads_permuted`: the query projection's first two heads trade places (two or more heads);
- `every_layer_norm`: every layer's post-attention norm weight times 1.2 (one kind, every layer);
- config.json fields (`CONFIG_FAULTS`), each read by one kind of unit in every layer:
  `config_eps` (`rms_norm_eps` x100: norms), `config_rope_theta` (`rope_theta` / 100:
  attention; transformers 5 keeps it in `rope_parameters`), `config_routed_scaling_factor`
  (x2.5: the router's top-k weights; GLM-4-MoE) and `config_norm_topk_prob` (flipped: the
  router's renormalisation; families whose config.json has it). A family whose config.json
  lacks the field, or whose router does not read it (Qwen3-VL-MoE always renormalises),
  skips the kind, saying so.

A fault says what a correct search names: the units whose tensors were damaged (`units`;
the search may name their parent block, or sub-units of them), or, for a config field and
a norm scaled in every layer, the kind-level culprit (`kinds`).

Copies are written with plain file writes (a shard is serialised in memory, then written),
so a full disk surfaces as an `OSError` with its errno (ENOSPC, EFBIG, EDQUOT) and the
path being written, for the selftest to report.
"""

from __future__ import annotations

import copy
import json
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from numbisect.model.arch import arch_for
from numbisect.model.ckptdiff import apply_renames, unit_of, unit_prefixes

# kind -> (config.json field paths to look for, in order; its new value from the old; the
# unit kinds that read it in every layer; the change in words)
CONFIG_FAULTS = {
    "config_eps": (("rms_norm_eps",), lambda v: v * 100, ["norm"], "x100"),
    "config_rope_theta": (("rope_parameters.rope_theta", "rope_theta"), lambda v: v / 100, ["attn"], "/100"),
    "config_routed_scaling_factor": (("routed_scaling_factor",), lambda v: v * 2.5, ["router"], "x2.5"),
    "config_norm_topk_prob": (("norm_topk_prob",), lambda v: not v, ["router"], "flipped"),
}
KINDS = ("norm_scale", "gate_up_swap", "experts_swap", "heads_permuted", "config_eps", "every_layer_norm",
         "config_rope_theta", "config_routed_scaling_factor", "config_norm_topk_prob")


@dataclass
class CkptFault:
    kind: str
    where: str  # what was damaged, in words ("layer 2", "experts 3 and 5 of layer 1")
    units: list[str] = field(default_factory=list)  # units whose tensors were damaged
    kinds: list[str] = field(default_factory=list)  # a kind-level culprit expected instead (config, every layer)
    tensors: list[str] = field(default_factory=list)  # checkpoint tensor names changed
    config: dict = field(default_factory=dict)  # config.json fields changed: path ("rope_parameters.rope_theta") -> new value
    experts: list[int] = field(default_factory=list)  # experts_swap on fused [experts, ...] tensors: the two indices
    head_rows: int = 0  # heads_permuted: rows per head in q_proj (head_dim, or 2 x head_dim where a gate rides along)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "where": self.where, "units": self.units, "kinds": self.kinds,
                "tensors": len(self.tensors), "config": self.config}


def _shapes(path: str) -> dict[str, list[int]]:
    """Every tensor of a checkpoint directory: name -> shape (headers only)."""
    from safetensors import safe_open

    shapes = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                shapes[k] = list(fh.get_slice(k).get_shape())
    return shapes


# Experts stored fused, one [experts, hidden, 2 x intermediate] gate_up tensor and one down
# tensor per layer (Qwen3-VL-MoE's checkpoint; transformers transposes them on load).
_FUSED_GATE_UP = ".experts.gate_up_proj"
_FUSED_DOWN = ".experts.down_proj"


def config_value(raw_config: dict, path: str):
    """The value of field `path` (dotted: `rope_parameters.rope_theta`) in config.json, at
    the top level or else under `text_config`; None when neither has it."""
    for scope in (raw_config, raw_config.get("text_config")):
        v = scope
        for part in path.split("."):
            v = v.get(part) if isinstance(v, dict) else None
        if v is not None:
            return v
    return None


def _set_config(cfg: dict, path: str, value) -> None:
    """Set field `path` where the family keeps it: the top level when its first part is
    there, else `text_config` (a multimodal family's text model)."""
    first, *rest = path.split(".")
    scope = cfg if first in cfg or not isinstance(cfg.get("text_config"), dict) else cfg["text_config"]
    for part in [first, *rest][:-1]:
        scope = scope.setdefault(part, {})
    scope[path.split(".")[-1]] = value


def _router_reads(arch, text, path: str, value) -> bool:
    """Whether the family's router reads config field `path`: its routing (`arch.router_spec`,
    which mirrors the transformers router) changes when the field is `value`. Qwen3-VL-MoE's
    router always renormalises, whatever norm_topk_prob says."""
    if arch.router_spec is None:
        return False
    changed = copy.copy(text)
    setattr(changed, path, value)
    return arch.router_spec(changed) != arch.router_spec(text)


def plan(ref_path: str, raw_config: dict, config, kinds=KINDS, seed: int = 0) -> tuple[list[CkptFault], list[dict]]:
    """The faults to write for this checkpoint (one per kind of `kinds` it has), and the
    kinds skipped with why. `raw_config`: its config.json; `config`: its transformers
    config. Each kind's layer comes from `seed` alone, whichever kinds are asked for."""
    rng = random.Random(seed)
    arch = arch_for(config)
    text = config.get_text_config()
    n = text.num_hidden_layers
    shapes = _shapes(ref_path)
    keys = list(shapes)
    prefixes = unit_prefixes(arch, config)

    def unit(key: str) -> str | None:
        return unit_of(apply_renames(key, arch.ckpt_renames), prefixes)

    def layer_keys(i: int, *parts: str) -> list[str]:
        return [k for k in keys if f"layers.{i}." in k and any(p in k for p in parts)]

    for kind in kinds:
        if kind not in KINDS:
            raise ValueError(f"unknown checkpoint fault {kind!r}")
    out, skipped = [], []
    for kind in KINDS:  # every kind draws, so a kind's layer does not depend on which others are asked for
        i = rng.randrange(n)
        if kind == "norm_scale":
            which = rng.choice(["input_layernorm", "post_attention_layernorm"])
            ks = layer_keys(i, f".{which}.weight")
            out.append(CkptFault(kind, f"{which} of layer {i} x1.5", sorted({unit(k) for k in ks}), tensors=ks))
        elif kind == "gate_up_swap":
            ks = layer_keys(i, "gate_proj", ".w1.", _FUSED_GATE_UP)
            if not ks:
                skipped.append({"kind": kind, "reason": f"no gate projection in layer {i}"})
                continue
            out.append(CkptFault(kind, f"gate/up of layer {i}", sorted({unit(k) for k in ks}), tensors=ks))
        elif kind == "experts_swap":
            moe = [j for j in range(n) if layer_keys(j, ".experts.0.", _FUSED_GATE_UP)]
            if not moe:
                skipped.append({"kind": kind, "reason": f"{arch.name} has no routed experts"})
                continue
            i = rng.choice(moe)
            fused = layer_keys(i, _FUSED_GATE_UP, _FUSED_DOWN)
            if fused:  # one tensor per layer: the two experts' slices trade places
                a, b = rng.sample(range(shapes[fused[0]][0]), 2)
                out.append(CkptFault(kind, f"experts {a} and {b} of layer {i}", sorted({unit(k) for k in fused}),
                                     tensors=fused, experts=[a, b]))
                continue
            count = len({k.split(".experts.")[1].split(".")[0] for k in layer_keys(i, ".experts.")})
            a, b = rng.sample(range(count), 2)
            ks = [k for k in layer_keys(i, f".experts.{a}.")]
            out.append(CkptFault(kind, f"experts {a} and {b} of layer {i}", sorted({unit(k) for k in ks}),
                                 tensors=ks + [k.replace(f".experts.{a}.", f".experts.{b}.") for k in ks]))
        elif kind == "heads_permuted":
            if text.num_attention_heads < 2:
                skipped.append({"kind": kind, "reason": "one attention head"})
                continue
            with_q = [j for j in range(n) if layer_keys(j, "self_attn.q_proj.weight")]
            if not with_q:  # MLA's q_a/q_b projections, or no softmax attention at all
                skipped.append({"kind": kind, "reason": "no self_attn.q_proj (a query projection of stacked heads)"})
                continue
            if i not in with_q:  # a layer without one (Qwen3.5's linear attention): the drawn one's neighbour
                i = with_q[i % len(with_q)]
            ks = layer_keys(i, "self_attn.q_proj.weight")
            rows = shapes[ks[0]][0] // text.num_attention_heads
            gated = rows == 2 * (getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
            out.append(CkptFault(kind, f"query heads 0 and 1 of layer {i}" + (" (with their output gates)" if gated else ""),
                                 sorted({unit(k) for k in ks}), tensors=ks, head_rows=rows))
        elif kind in CONFIG_FAULTS:
            paths, change, readers, words = CONFIG_FAULTS[kind]
            found = [(p, config_value(raw_config, p)) for p in paths if config_value(raw_config, p) is not None]
            ok = [(p, v) for p, v in found if isinstance(v, (int, float))]
            if not ok:
                name = paths[-1]
                skipped.append({"kind": kind, "reason": f"no {name} in config.json" if not found else f"{name} is not a number"})
                continue
            path, old_value = ok[0]
            new = change(old_value)
            if readers == ["router"] and not _router_reads(arch, text, path, new):
                skipped.append({"kind": kind, "reason": f"{arch.name}'s router does not read {path}"})
                continue
            out.append(CkptFault(kind, f"{path} {old_value:g} -> {new:g} ({words})" if not isinstance(new, bool)
                                 else f"{path} {old_value} -> {new}", kinds=list(readers), config={path: new}))
        elif kind == "every_layer_norm":
            ks = [k for j in range(n) for k in layer_keys(j, ".post_attention_layernorm.weight")]
            out.append(CkptFault(kind, f"post_attention_layernorm of all {n} layers x1.2", kinds=["norm"], tensors=ks))
    return [f for f in out if f.kind in kinds], [s for s in skipped if s["kind"] in kinds]


def write_copy(ref_path: str, dest: str, fault: CkptFault, head_dim: int) -> str:
    """A copy of the reference directory under `dest` with `fault` applied; returns its
    path. An OSError (a full disk: ENOSPC, EFBIG, EDQUOT) propagates with its errno; the
    caller removes `dest`."""
    import torch
    from safetensors.torch import load_file, save

    src = Path(ref_path)
    out = Path(dest) / fault.kind
    out.mkdir(parents=True)
    for f in sorted(src.rglob("*")):  # file by file: shutil.copytree would fold errors into one without errno
        target = out / f.relative_to(src)
        if f.is_dir():
            target.mkdir(exist_ok=True)
        else:
            shutil.copyfile(f, target)
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
                blocks = list(w[k].split(fault.head_rows or head_dim))
                w[k] = torch.cat([blocks[1], blocks[0], *blocks[2:]]).contiguous()
        if fault.kind == "gate_up_swap":
            for k in [k for k in fault.tensors if k in w]:
                if k.endswith(_FUSED_GATE_UP):  # [experts, hidden, gate | up]: the halves trade places
                    gate, up = w[k].chunk(2, dim=-1)
                    w[k] = torch.cat([up, gate], dim=-1).contiguous()
                    continue
                other = k.replace("gate_proj", "up_proj").replace(".w1.", ".w3.")
                w[k], w[other] = w[other], w[k]
        if fault.kind == "experts_swap" and fault.experts:
            a, b = fault.experts
            for k in [k for k in fault.tensors if k in w]:
                t = w[k].clone()
                t[[a, b]] = w[k][[b, a]]
                w[k] = t
        elif fault.kind == "experts_swap":
            half = len(fault.tensors) // 2
            for a, b in zip(fault.tensors[:half], fault.tensors[half:]):
                if a in w and b in w:
                    w[a], w[b] = w[b], w[a]
        if touched:
            data = save(w, metadata={"format": "pt"})
            with open(f, "wb") as fh:
                fh.write(data)
    if fault.config:
        cfg_path = out / "config.json"
        cfg = json.loads(cfg_path.read_text())
        for path, value in fault.config.items():
            _set_config(cfg, path, value)
        cfg_path.write_text(json.dumps(cfg, indent=2))
    return str(out)


def named(fault: CkptFault, culprits: list[str], systematic: dict | None, parent_of,
          kind_units: dict[str, list[str]] | None = None) -> str | None:
    """How the search's answer matches the damage, or None (missed): "exact" (the damaged
    units), "parent" (their one common block, not a layer), "sub-unit" (inside them), or,
    for a fault every unit of some kinds reads, "kind" (a kind-level culprit holding the
    expected kinds), "every unit" (each unit of those kinds named, and nothing else:
    what the search answers when the kind is not in every layer, as GLM-4-MoE's routers
    are not in its dense first layer) or "some units" (only units of those kinds named,
    not all: the others' share of the damage is under the threshold; the checkpoint diff
    names the field and its readers). `kind_units`: the model's units by kind."""
    if fault.kinds:
        got = (systematic or {}).get("kinds") or []
        if set(fault.kinds) <= set(got):
            return "kind"
        every = sorted(u for k in fault.kinds for u in (kind_units or {}).get(k, []))
        if len(every) >= 2 and sorted(culprits) == every:
            return "every unit"
        return "some units" if culprits and set(culprits) < set(every) else None
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

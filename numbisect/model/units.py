"""Canonical units: backend-independent names for module boundaries, and their graph.

A unit name is one of `embed`, `layers.{i}.input_norm`, `layers.{i}.attn`,
`layers.{i}.post_attn_norm`, `layers.{i}.moe` (or `.mlp` when dense) with
`layers.{i}.moe.router`, `.experts`, `.shared_expert` (`.shared_expert_gate` where the
block gates it), `layers.{i}.attn.rope` (MLA's rotary part: the rotated query and key
rope dims, packed as numbisect.backends.mla_rope lays them out), `layers.{i}.attn.indexer` (sparse
attention's token selection, GLM-5's DSA indexer: its output is the [tokens, tokens] 0/1
mask of the keys each query attends), `layers.{i}.attn.conv`, `.gates`, `.out_gate` and `.out_proj`
(linear attention's causal conv, its gates (decay g and beta), its gated RMSNorm, the
output gate, and its output projection: Gated DeltaNet layers only), `layers.{i}` (the residual
stream after the layer), `final_norm` and `lm_head`; multimodal models add `vision`
(the vision tower, whose output is the image tokens' embeddings) containing
`vision.projector` (the merger/projector into the language model's width). The unit graph (networkx) holds
containment (`model > layers.{i} > layers.{i}.moe > layers.{i}.moe.router`) and the
execution order; search strategies walk it.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import networkx as nx

if TYPE_CHECKING:  # annotations only: model.arch imports this module
    from numbisect.model.arch.base import ArchMap

KINDS = ("embed", "norm", "attn", "moe", "mlp", "router", "experts", "shared_expert", "layer", "lm_head", "vision", "projector",
         "indexer")
KINDS += ("shared_expert_gate",)  # Qwen3.5-MoE: the shared expert's sigmoid gate logit (a sub-unit of moe)
KINDS += ("rope",)  # MLA (DeepSeek-V3, GLM-5): the attention's rotary part (a sub-unit of attn)
# Gated DeltaNet (Qwen3.5, Qwen3-Next linear attention): the gated RMSNorm (norm(core) * silu(z):
# the output gate) and the projection after it, sub-units of attn; [tokens, value heads * head dim]
# and [tokens, hidden].
KINDS += ("out_gate", "out_proj")
# Gated DeltaNet's causal conv over q, k, v ([tokens, channels] in and out) and its gates
# ((a, b) -> (g, beta), [tokens, 2 * value heads], float32), sub-units of attn before out_gate.
KINDS += ("conv", "gates")
# Sub-units whose feeding would replace the rest of their parent's computation (the gated
# norm's input is the core output and gate z, everything the Gated DeltaNet computed before
# it; the conv's and the gates' are its projections'): never teacher-forced, or the joint local pass (every unit fed the reference's input)
# would hide the parent's own error. Their local error runs from the parent's fed input to
# their output. MLA's rope is fed: its input is a part of the attention's state (the rope
# dims), its local error is its own, and the attention's leaves out only what its
# projections did to those dims.
INNER_KINDS = ("conv", "gates", "out_gate", "out_proj")
# Units on the prefill path only: Gated DeltaNet's conv and gates are modules numbisect routes
# the prefill's calls through (numbisect.backends.hf.gdn, .vllm.gdn); a decode step updates the
# conv state in place and, on vLLM-CPU, fuses the gates into its recurrent kernel. In decode
# mode they are neither captured nor swapped.
PREFILL_ONLY_KINDS = ("conv", "gates")
# Kinds a user may name in `--swap`: every unit of that kind is swapped.
SWAP_KINDS = KINDS
# Kinds whose rows are image patches / image tokens, not the trace's tokens.
VISION_KINDS = ("vision", "projector")


@dataclass(frozen=True)
class Unit:
    name: str  # canonical name, e.g. "layers.2.moe.experts"
    kind: str  # one of KINDS
    layer: int | None  # decoder layer index, None for embed/final_norm/lm_head
    parent: str  # containing unit, "model" at the top
    order: int  # execution order (0 = first output produced)
    variant: str = ""  # which module the family has here when layers differ (an attn's "linear")

    @property
    def pattern(self) -> str:
        """The name with its layer index replaced by `{i}`, as used by architecture maps."""
        return re.sub(r"^layers\.\d+", "layers.{i}", self.name)


def layer_units(i: int, ffn: str, sub_units: tuple[str, ...], attn_sub_units: tuple[str, ...] = ()) -> list[tuple[str, str, str]]:
    """(name, kind, parent) of layer i's units, in execution order."""
    p = f"layers.{i}"
    out = [(f"{p}.input_norm", "norm", p)]
    out += [(f"{p}.attn.{s}", s, f"{p}.attn") for s in attn_sub_units]
    out += [
        (f"{p}.attn", "attn", p),
        (f"{p}.post_attn_norm", "norm", p),
    ]
    if ffn == "moe":
        out += [(f"{p}.moe.{s}", s, f"{p}.moe") for s in sub_units]
        out.append((f"{p}.moe", "moe", p))
    else:
        out.append((f"{p}.mlp", "mlp", p))
    out.append((p, "layer", "model"))
    return out


def build_units(num_layers: int, ffn_kinds: list[str], moe_sub_units: tuple[str, ...], vision: bool = False,
                attn_sub_units: tuple[str, ...] | list[tuple[str, ...]] = ()) -> list[Unit]:
    """Every unit of a model, in execution order. `attn_sub_units`: the same for every
    layer, or a list with each layer's (hybrid models: linear attention has its own)."""
    rows: list[tuple[str, str, str]] = [("embed", "embed", "model")]
    if vision:  # the tower runs after the token embedding, before the first layer
        rows += [("vision.projector", "projector", "vision"), ("vision", "vision", "model")]
    for i in range(num_layers):
        subs = attn_sub_units[i] if isinstance(attn_sub_units, list) else attn_sub_units
        rows += layer_units(i, ffn_kinds[i], moe_sub_units, subs)
    rows += [("final_norm", "norm", "model"), ("lm_head", "lm_head", "model")]
    units = []
    for order, (name, kind, parent) in enumerate(rows):
        m = re.match(r"^layers\.(\d+)", name)
        units.append(Unit(name, kind, int(m.group(1)) if m else None, parent, order))
    return units


def unit_graph(units: list[Unit]) -> nx.DiGraph:
    """Containment edges (`rel="contains"`) and execution-order edges (`rel="next"`)."""
    g = nx.DiGraph()
    g.add_node("model", kind="model", layer=None, order=-1)
    for u in units:
        g.add_node(u.name, kind=u.kind, layer=u.layer, order=u.order)
    for u in units:
        g.add_edge(u.parent, u.name, rel="contains")
    leaves = [u for u in units if not any(v.parent == u.name for v in units)]
    for a, b in zip(leaves, leaves[1:]):
        g.add_edge(a.name, b.name, rel="next")
    return g


def children(g: nx.DiGraph, name: str) -> list[str]:
    """Units directly contained in `name`, in execution order."""
    kids = [v for _, v, d in g.out_edges(name, data=True) if d["rel"] == "contains"]
    return sorted(kids, key=lambda v: g.nodes[v]["order"])


def nearby_names(name: str, names: list[str], n: int = 5) -> list[str]:
    """Names that look like `name`, for 'did you mean' hints."""
    return difflib.get_close_matches(name, names, n=n, cutoff=0.5)


class HasUnits(Protocol):
    """What the layers below the backends (model/, patching/) read of an engine: its family
    and its units. Every backend (`numbisect.backends.base.Backend`) is one; those layers
    name this, never the backends above them."""

    arch: ArchMap
    units: list[Unit]

    def unit(self, name: str) -> Unit: ...


def capture_names(backend: HasUnits) -> list[str]:
    return [u.name for u in backend.units]


def local_feed_names(backend: HasUnits) -> list[str]:
    """Units whose input is a hidden state (so they can be teacher-forced); not those fed
    from inside their parent (`INNER_KINDS`)."""
    return [u.name for u in backend.units if u.kind != "embed" and u.kind not in INNER_KINDS]


def parent(g: nx.DiGraph, name: str) -> str | None:
    for u, _, d in g.in_edges(name, data=True):
        if d["rel"] == "contains":
            return u
    return None

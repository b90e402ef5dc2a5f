"""The weight-sync check: is the engine computing with the reference's weights, unit by unit?

An RL trainer pushes its weights into a running engine after every optimizer step; a
sync that skips a tensor, a layer, or writes the right bytes to the wrong place leaves
the engine computing with other weights, and nothing fails. `check(...)` says, per unit:

1. Per tensor, where the engine's parameters are readable: each engine tensor is read
   back in the checkpoint's names (`engine_tensors`: fused `qkv_proj` and `gate_up_proj`
   split into q/k/v and gate/up, stacked experts `w13_weight`/`w2_weight` split per
   expert, a packed CPU GEMM weight read back as its kernel reads it, prepacked CPU MoE
   expert weights unpacked as the kernel reads them, `unpacked`, a packed Gated DeltaNet
   conv weight likewise, `conv_unpacked`; tensors vLLM holds in float32 compared in
   float32, `engine_dtypes`), the reference's
   tensors in the same names (`reference_tensors`: transformers' own
   `revert_weight_conversion`, as `save_pretrained` writes them), cast to the engine's
   dtype, and the two compared by a digest of their bytes. A tensor that differs is
   matched against the digests of the reference's weights kept at each earlier check
   (`History`): the previous check's -> `unwritten` (the sync never wrote it), an earlier
   one's -> `stale`; else `corrupted`, explained as the checkpoint diff explains a tensor
   (numbisect.model.ckptdiff: holds another tensor's weights, `swapped`; rows permuted;
   scaled; changed). A reference tensor the engine does not hold: `missing`.
2. Functionally, when a comparison was run: the unit's local error (the engine unit fed
   the reference unit's inputs, numbisect.pipeline.comparison). A unit whose readable weights are
   all right but whose local error is above `FUNCTIONAL_TOL` computes with something
   else: `buffer differs` (a runtime buffer, a packed copy the sync did not reach).
   Except a MoE block whose router, fed the reference's input, sent a few tokens to other
   experts (near-ties between the float32 reference and the bf16 engine, `routing_flips`):
   each such token's output differs whole, which lifts the block's local error above the
   tolerance with every weight right (measured: 0.073 on qwen3_moe's layer 2 after a
   correct sync, 1 of 48 tokens). Its status stays ok, the flips named in its summary.

A unit's status is the worst of its tensors' (`ORDER`). The result, `WeightCheck`, is
truthy when every unit is ok and gives the report's `weights` section (`to_dict`).

The check streams: peak memory beyond the two models is about one unit's weights on each
side. The reference is reverted to checkpoint names one layer at a time
(`ReferenceReader`: its digests first, then any tensor an explanation asks for, with its
layer alone); the engine's tensors are read back one unit at a time (`UnitReader`,
`unit_reader`: in-process as views of its parameters; from worker processes one
`apply_model` call per unit, each rank's shards put together here), each digested,
judged and explained while held, then let go. Only digests outlive a unit: a tensor
holding another reference tensor's weights is told `swapped` from `moved` by them once
every unit was read (benchmarks/live_cost.py measures the peak).
"""

from __future__ import annotations

import copy
import os
import re
import time
from dataclasses import dataclass, field

import torch

from numbisect.live.engine import ENGINE
from numbisect.model.ckptdiff import (
    TensorDict,
    apply_renames,
    explain,
    explain_tensors,
    head_counts,
    pair_label,
    rounded_through,
    short_name,
    unit_of,
    unit_prefixes,
    unit_summary,
)
from numbisect.model.ckptdiff import tensor_digest as digest  # noqa: F401  (BLAKE2b of a tensor's bytes: this module's API too)

# The engine's read-back in the checkpoint's names (numbisect.backends.vllm.readback, reached
# through the registry): used through this module by the live checks.
FUSED, UnitReader, engine_dtypes, engine_tensors, remote_tensors, unit_reader, reader_digests = (
    ENGINE.FUSED, ENGINE.UnitReader, ENGINE.engine_dtypes, ENGINE.engine_tensors, ENGINE.remote_tensors,
    ENGINE.unit_reader, ENGINE.reader_digests)

OK, UNWRITTEN, STALE, CORRUPTED, BUFFER, MISSING = "ok", "unwritten", "stale", "corrupted", "buffer differs", "missing"
ORDER = (OK, BUFFER, UNWRITTEN, STALE, CORRUPTED, MISSING)  # worst last
# Local (teacher-forced) relative L2 error above which a unit is judged to compute with
# other weights. A bf16 engine against its own weights in float32 stays under it (measured
# on the fixtures: tests/live); one optimizer step at a small learning rate may stay under
# it too, which is why the per-tensor digests decide where the weights are readable.
FUNCTIONAL_TOL = 5e-2
# At most this fraction of a MoE layer's tokens routed to other experts (fed the reference's
# input) is taken for near-ties, not for a router computing otherwise.
FLIP_FRAC = 0.1
# How many corrupted tensors a check explains, so that a check of a wholly corrupted model
# stays cheap: the first `EXPLAIN_FULL` of the check in full (ckptdiff's `explain`: rows looked
# for in the same tensor of every other layer, each layer reverted), the first
# `EXPLAIN_PER_UNIT` of each unit by their own signatures (`explain_tensors`: zeroed, scaled,
# permuted, ...), the others `changed`, not explained (reverting a MoE layer's reference to
# read a tensor back costs more than the check of a right one). Measured on
# qwen3_moe with every layer's experts left unpacked by vLLM's reload (96 tensors): 2.5-7.4 s
# a check explaining all of them in full.
EXPLAIN_FULL = 1
EXPLAIN_PER_UNIT = 1



# -- reading both sides in the checkpoint's names ---------------------------------------------
def reference_tensors(model) -> dict[str, torch.Tensor]:
    """The float tensors of a transformers model in the checkpoint's names, as
    `save_pretrained` would write them (transformers' `revert_weight_conversion`: fused
    experts split per expert, renames undone); detached views, nothing copied or changed."""
    from transformers.core_model_loading import revert_weight_conversion

    with torch.no_grad():
        sd = {k: v.detach() for k, v in model.state_dict().items()}
        out = revert_weight_conversion(model, sd)
    return {k: v for k, v in out.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}


_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")


def layer_key(name: str) -> str:
    """The layer a state-dict or checkpoint name belongs to (`...layers.N`), "" outside the
    layers: transformers' weight conversion never mixes tensors of two layers, so each
    layer's tensors can be reverted to checkpoint names on their own."""
    m = _LAYER.match(name)
    return m.group(1) if m else ""


class ReferenceReader:
    """A transformers model's float tensors in checkpoint names (`reference_tensors`), one
    layer at a time: the weight conversion's copies (per-expert tensors split off a fused
    one) exist for one layer at once, and a tensor asked for by name (`tensor`) is reverted
    with its layer alone. Read as `explain` reads a checkpoint (`in`, `shape`, `tensor`),
    in `dtype` when given."""

    def __init__(self, model, dtype: torch.dtype | None = None):
        self.model = model
        self.dtype = dtype
        self._groups: dict[str, list[str]] = {}  # layer -> its state-dict keys
        with torch.no_grad():
            for k, v in model.state_dict().items():
                self._groups.setdefault(layer_key(k), []).append(k)
        self.shapes: dict[str, tuple] = {}
        self.layer_of: dict[str, str] = {}  # checkpoint name -> its layer
        self._cached: tuple[str, dict] | None = None
        for key, tensors in self.layers():
            for n, t in tensors.items():
                self.shapes[n], self.layer_of[n] = tuple(t.shape), key

    def _revert(self, key: str, sd: dict | None = None) -> dict[str, torch.Tensor]:
        """One layer's tensors in checkpoint names; `sd`: the model's state dict, taken once
        for a pass over every layer (taken per layer, a pass cost the square of the layers)."""
        from transformers.core_model_loading import revert_weight_conversion

        with torch.no_grad():
            sd = self.model.state_dict() if sd is None else sd
            out = revert_weight_conversion(self.model, {k: sd[k].detach() for k in self._groups[key]})
        return {k: v for k, v in out.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}

    def _pass_state(self) -> dict | None:
        """What a pass over every layer hands each `_revert`: the model's state dict (views of
        its tensors), taken when the pass starts."""
        with torch.no_grad():
            return self.model.state_dict()

    def layers(self):
        """(layer, its tensors in checkpoint names), layer by layer (the first: outside any)."""
        sd = self._pass_state()
        for key in self._groups:
            yield key, self._revert(key, sd)

    def digests(self, dtype: torch.dtype, dtypes: dict | None = None) -> dict[str, str]:
        """`reference_digests` of every tensor, read layer by layer."""
        out = {}
        for _, tensors in self.layers():
            out.update(reference_digests(tensors, dtype, dtypes))
        return out

    def __contains__(self, name: str) -> bool:
        return name in self.shapes

    def shape(self, name: str) -> list[int]:
        return list(self.shapes[name])

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor, its layer reverted (the last layer asked for kept: a tensor's
        neighbours are asked for together)."""
        key = self.layer_of[name]
        if self._cached is None or self._cached[0] != key:
            self._cached = None  # the previous layer's copies released first
            self._cached = (key, self._revert(key))
        t = self._cached[1][name]
        return t if self.dtype is None else t.to(self.dtype)

    def release(self) -> None:
        self._cached = None

    def in_dtype(self, dtype: torch.dtype) -> ReferenceReader:
        """The same reader, its tensors given in `dtype` (the engine's: compared after the same rounding)."""
        out = copy.copy(self)
        out.dtype, out._cached = dtype, None
        return out


def write_checkpoint(dest: str, config, tensors: dict[str, torch.Tensor]) -> None:
    """config.json + model.safetensors in `dest` (a transformers checkpoint)."""
    from safetensors.torch import save_file

    os.makedirs(dest, exist_ok=True)
    config.to_json_file(os.path.join(dest, "config.json"))
    save_file({n: t.detach().to("cpu").contiguous().clone() for n, t in tensors.items()},
              os.path.join(dest, "model.safetensors"), metadata={"format": "pt"})


# -- what the reference held before --------------------------------------------------------------
@dataclass
class History:
    """Digests of the reference's weights (in the engine's dtype) at attach and at each
    check, oldest first: how `unwritten` and `stale` are told from `corrupted` without
    keeping a copy of any weight."""

    steps: list[tuple[str, dict[str, str]]] = field(default_factory=list)  # (label, name -> digest)
    keep: int = 8  # the most recent ones kept

    def add(self, label: str, digests: dict[str, str]) -> None:
        self.steps.append((label, digests))
        del self.steps[: -self.keep]

    def previous(self) -> tuple[str, dict[str, str]] | None:
        return self.steps[-1] if self.steps else None


def reference_digests(ref: dict[str, torch.Tensor], dtype: torch.dtype, dtypes: dict | None = None) -> dict[str, str]:
    """Each reference tensor's digest in the dtype the engine holds it in (`dtypes`, by
    name; `dtype` for the others)."""
    dtypes = dtypes or {}
    return {n: digest(t.to(dtypes.get(n, dtype))) for n, t in ref.items()}


# -- the result -----------------------------------------------------------------------------
@dataclass
class UnitWeights:
    """One unit's verdict."""

    unit: str
    status: str
    tensors: list[dict]  # per tensor that is not ok: name, status, how (and the explanation's fields)
    n_tensors: int  # tensors the unit holds (checked)
    local_rel_l2: float | None = None  # the functional check's local error, when one ran
    summary: str = ""

    def to_dict(self) -> dict:
        return {"unit": self.unit, "status": self.status, "tensors_checked": self.n_tensors, "tensors": self.tensors,
                "local_rel_l2": self.local_rel_l2, "summary": self.summary}


class ByUnit:
    """What a per-unit result offers (`WeightCheck`, numbisect.live.cold's `WarmCold`): true
    when every unit of `units` is ok, the ones that are not, one unit's status."""

    units: list

    def __bool__(self) -> bool:
        return all(u.status == OK for u in self.units)

    @property
    def ok(self) -> bool:
        return bool(self)

    def differing(self) -> list:
        return [u for u in self.units if u.status != OK]

    def status(self, unit: str) -> str:
        return next(u.status for u in self.units if u.unit == unit)


@dataclass
class WeightCheck(ByUnit):
    """Per unit, whether the engine computes with the reference's weights (module doc).
    Truthy when every unit is ok."""

    units: list[UnitWeights]
    step: str  # the check's label
    compared_with: list[str]  # the labels of the earlier reference weights it knew
    seconds: float
    functional: bool  # whether a local-error pass judged the units too
    functional_tol: float = FUNCTIONAL_TOL
    unmapped: list[str] = field(default_factory=list)  # engine tensors of no reference name (extra)
    engine_digests: dict[str, str] = field(default_factory=dict, repr=False)  # checkpoint name -> the engine tensor's digest
    peak_bytes: int | None = None  # the most bytes of engine tensors read back alive at once (UnitReader's account)
    unit_bytes: int | None = None  # the largest unit's engine tensors, in bytes
    weight_version: str | None = None  # the engine's weight version when checked (vLLM's `get_weight_version`)
    push: dict | None = None  # the last weight-transfer push seen (numbisect.live.transfer), when watched
    not_checked: dict[str, str] = field(default_factory=dict)  # unit -> what of it this check left out, and why (a sharded trainer's local check: other ranks' rows)

    def to_dict(self) -> dict:
        counts = {s: sum(u.status == s for u in self.units) for s in ORDER}
        extra = {k: v for k, v in (("weight_version", self.weight_version), ("push", self.push),
                                   ("not_checked", self.not_checked or None)) if v is not None}
        return {"ok": self.ok, "step": self.step, **extra, "compared_with": self.compared_with, "seconds": round(self.seconds, 4),
                "functional": self.functional, "functional_tol": self.functional_tol,
                "counts": {k: v for k, v in counts.items() if v}, "unmapped": self.unmapped,
                "units": [u.to_dict() for u in self.units]}

    def lines(self) -> list[str]:
        """A short summary: one line per unit that is not ok."""
        bad = self.differing()
        version = f", weight version {self.weight_version}" if self.weight_version not in (None, "default") else ""
        head = f"weights ({self.step}{version}): {'all ok' if not bad else f'{len(bad)} of {len(self.units)} units differ'} ({self.seconds:.2f} s)"
        note = [f"  {self.push['note']}"] if (self.push or {}).get("note") else []
        left: dict[str, list[str]] = {}
        for u, why in self.not_checked.items():
            left.setdefault(why, []).append(u)
        note += [f"  not checked here: {', '.join(us)}: {why}" for why, us in left.items()]
        return [head] + [f"  {u.unit:<24} {u.status:<15} {u.summary}" for u in bad] + note


def routing_flips(routing: dict | None) -> dict[str, tuple[int, int]]:
    """A comparison's routing section (numbisect.pipeline.routing) -> for each MoE block
    (the router unit's parent, "layers.2.moe"), (tokens its router routed to other experts
    in the teacher-forced pass, tokens)."""
    out = {}
    for row in (routing or {}).get("layers") or []:
        local = row.get("local")
        if isinstance(local, dict) and local.get("tokens"):
            out[row["unit"].rpartition(".")[0]] = (int(local.get("flipped") or 0), int(local["tokens"]))
    return out


def _flipped(unit: str, flips: dict[str, tuple[int, int]]) -> tuple[int, int] | None:
    """(flipped, tokens) when `unit` is a MoE block or its routed experts and a few of its
    tokens went to other experts (`FLIP_FRAC`), else None."""
    block = unit.removesuffix(".experts")
    n, tokens = flips.get(block, (0, 0))
    return (n, tokens) if 0 < n <= FLIP_FRAC * tokens else None


def _worst(statuses) -> str:
    return max(statuses, key=ORDER.index, default=OK)


def tensor_unit(arch, config):
    """name -> the unit that holds a checkpoint tensor ("(no unit)" for none), as `check` names it."""
    prefixes = unit_prefixes(arch, config)
    renames = getattr(arch, "ckpt_renames", {}) or {}
    return lambda name: unit_of(apply_renames(name, renames), prefixes) or "(no unit)"


def check(ref: ReferenceReader, eng, history: History, arch, config, *, dtype: torch.dtype,
          dtypes: dict[str, torch.dtype] | None = None, step: str, local: dict[str, float] | None = None,
          tied: bool = False, t0: float | None = None, flips: dict[str, tuple[int, int]] | None = None,
          rows=None) -> WeightCheck:
    """Judge every unit (module doc), streaming: `ref` read layer by layer (`ReferenceReader`),
    `eng` an iterable of (unit, the engine's tensors of that unit in checkpoint names)
    (`UnitReader`), each unit's tensors digested, compared and explained while they are
    read, then let go; only digests are kept (a tensor holding another reference tensor's
    weights is told `swapped` from `moved` by the digests, after every unit was read).
    `dtype`: the engine's; `dtypes`: the tensors it holds in another (`engine_dtypes`);
    `history`: the reference's earlier digests (this check's are added to it); `local`:
    unit -> local relative L2 error of a comparison, or None; `flips`: its routing flips (`routing_flips`); `tied`: the engine ties
    lm_head to the embedding (no lm_head tensor). The engine's digests, by checkpoint
    name, are the result's `engine_digests`. `rows`: (name, engine tensor) -> a verdict of
    its own for a tensor that differs, or None (numbisect.live.sharded: the rows of each
    trainer rank's shard judged apart), taken before the whole tensor's."""
    t0 = time.perf_counter() if t0 is None else t0
    dtypes = dict(dtypes or {})
    cur = ref.digests(dtype, dtypes)
    by_digest: dict[str, list[str]] = {}
    for n, d in cur.items():
        by_digest.setdefault(d, []).append(n)
    prev = history.previous()
    earlier = history.steps[:-1]
    heads = head_counts(config)
    unit = tensor_unit(arch, config)
    per_unit: dict[str, list[dict]] = {}
    eng_digest: dict[str, str] = {}
    moved: list[tuple[dict, str, str]] = []  # (row, name, the reference tensor it holds): swapped or moved, decided last
    explained: dict[str, int] = {}  # unit ("" for the check) -> its tensors explained (EXPLAIN_FULL, EXPLAIN_PER_UNIT)

    # a tied lm_head read back apart from the embedding (its GEMM kernel holds a copy that
    # differs from the embedding: numbisect.backends.vllm.readback) is judged against the embedding
    embed = next((n for n in cur if n.endswith("embed_tokens.weight")), None) if tied else None
    tied_alias = {n: embed for n in ("lm_head.weight",)} if embed else {}
    ref_view = ref.in_dtype(dtype)

    def _explain(name: str, t: torch.Tensor, tensors: dict[str, torch.Tensor], u: str) -> dict:
        """A corrupted tensor explained as far as the budget goes (EXPLAIN_FULL, EXPLAIN_PER_UNIT)."""
        full, own = explained.get("", 0), explained.get(u, 0)
        explained[u] = own + 1
        if full < EXPLAIN_FULL:  # the whole reference, a layer at a time: rows taken from another layer are found too
            explained[""] = full + 1
            return explain(name, ref_view, TensorDict(tensors), heads)
        if own < EXPLAIN_PER_UNIT:
            return explain_tensors(ref_view.tensor(name).float(), t.float(), name, heads)
        return {"how": "changed", "explained": False}

    def judge(name: str, t: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
        """One engine tensor against the reference's (a function: nothing of a unit outlives it)."""
        eng_digest[name] = digest(t)
        key = name if name in cur else tied_alias.get(name)  # the reference tensor it is judged against
        if key is None:
            return
        if t.dtype != dtypes.get(key, dtype):  # held in a dtype engine_dtypes did not name: compared in it
            dtypes[key] = t.dtype
            cur[key] = digest(ref.tensor(key).to(t.dtype))
        row = {"tensor": name}
        if tuple(t.shape) != ref.shapes[key]:
            row.update(status=MISSING, how="reshaped", engine_shape=list(t.shape), ref_shape=list(ref.shapes[key]))
        elif eng_digest[name] == cur[key]:
            return
        elif rows is not None and (own := rows(key, t)) is not None:
            row.update(own)
        elif prev is not None and prev[1].get(key) == eng_digest[name]:
            row.update(status=UNWRITTEN, how="unwritten", holds=prev[0])
        elif any(h.get(key) == eng_digest[name] for _, h in earlier):
            label = next(lb for lb, h in reversed(earlier) if h.get(key) == eng_digest[name])
            row.update(status=STALE, how="stale", holds=label)
        elif _within_reference_precision(ref.tensor(key), t):
            return  # a float16/bfloat16 reference: the engine's values round its source once, the reference's twice
        elif (via := rounded_through(ref.tensor(key), t)) is not None:
            row.update(status=CORRUPTED, how="rounded", dtype=via,
                       phrase=f"rounded through {via} (the reference's values at {via}'s precision)")
        else:
            others = [m for m in by_digest.get(eng_digest[name], []) if m not in (name, key)]
            if others:
                moved.append((row, name, others[0]))
            else:
                row.update(status=CORRUPTED, **_explain(key, t, tensors, unit(name)))
        per_unit.setdefault(unit(name), []).append(row)

    for _, tensors in eng:  # emptied by the reader before the next unit is read
        for name in sorted(tensors):
            judge(name, tensors[name], tensors)
    ref_view.release()
    for row, name, m in moved:
        back = eng_digest.get(m) == cur.get(name)
        row.update(status=CORRUPTED, how="swapped" if back else "moved", pair=pair_label(name, m), holds=m)
    counts: dict[str, int] = {}
    for name in sorted(cur):
        if tied and name.endswith("lm_head.weight") and name not in eng_digest:
            continue
        u = unit(name)
        counts[u] = counts.get(u, 0) + 1
        if name not in eng_digest:
            per_unit.setdefault(u, []).append({"tensor": name, "status": MISSING, "how": "missing"})
    for unit_rows in per_unit.values():
        unit_rows.sort(key=lambda r: r["tensor"])  # as the reference's names are sorted
    units = []
    for u in [u.name for u in arch.units(config)] + (["(no unit)"] if "(no unit)" in counts else []):
        unit_rows = per_unit.get(u, [])
        err = (local or {}).get(u)
        status = _worst(r["status"] for r in unit_rows)
        note = ""
        if status == OK and err is not None and err > FUNCTIONAL_TOL and not _explained(u, per_unit) \
                and not _router_explains(u, per_unit):
            flipped = _flipped(u, flips or {})
            if flipped is None:
                status = BUFFER
            else:
                note = (f"local error {err:.3g}: {flipped[0]} of {flipped[1]} tokens routed to other experts fed the "
                        "reference's input (near-ties)")
        if u not in counts and status == OK:
            continue  # no tensor of its own and nothing functional to say: its sub-units speak for it
        summary = _summary(unit_rows) if unit_rows else (f"weights read back are the reference's, local error {err:.3g}" if status == BUFFER else note)
        units.append(UnitWeights(u, status, unit_rows, counts.get(u, 0), err, summary))
    history.add(step, cur)
    extra = sorted(set(eng_digest) - set(cur))
    return WeightCheck(units, step, [lb for lb, _ in history.steps[:-1]], time.perf_counter() - t0, local is not None,
                       unmapped=extra, engine_digests=eng_digest, peak_bytes=getattr(eng, "peak_bytes", None),
                       unit_bytes=max(getattr(eng, "unit_bytes", {}).values(), default=None))


def _within_reference_precision(r: torch.Tensor, t: torch.Tensor) -> bool:
    """A float16 or bfloat16 reference whose engine holds another dtype: the engine rounded the
    checkpoint once, the reference twice (to its own dtype, then to the engine's), so a few
    values differ by one step of the coarser dtype (86 of 722,560 in a float16 trainer against
    its own checkpoint in bf16). Differences within that are the reference's own precision,
    not a sync bug; a float32 reference has none (its engine's values must match exactly)."""
    if r.dtype not in (torch.float16, torch.bfloat16) or r.dtype == t.dtype or r.shape != t.shape:
        return False
    a, b = r.float(), t.float()
    if not bool(torch.isfinite(b).all()):
        return False
    eps = max(torch.finfo(r.dtype).eps, torch.finfo(t.dtype).eps if t.is_floating_point() else 0.0)
    tol = eps * torch.maximum(a.abs(), b.abs()) + torch.finfo(r.dtype).tiny
    return bool(((a - b).abs() <= tol).all())


def _router_explains(unit: str, per_unit: dict) -> bool:
    """A MoE block's experts (routed or shared) whose block's router differs: their local error
    follows from the router's weights (which tokens reach them, with what weight), not from
    their own, which read back right."""
    block, _, leaf = unit.rpartition(".")
    return leaf in ("experts", "shared_expert") and bool(per_unit.get(f"{block}.router"))


def _explained(unit: str, per_unit: dict) -> bool:
    """Whether a tensor of `unit` or of a unit inside it differs already."""
    return any(k == unit or k.startswith(unit + ".") for k, rows in per_unit.items() if rows)


def _corrupt_summary(rows: list[dict]) -> str:
    """ckptdiff's phrases for corrupted tensors; more than a few merely `changed` ones as one."""
    changed = [r for r in rows if r.get("how") == "changed"]
    rounded: dict[str, int] = {}
    for r in rows:
        if r.get("how") == "rounded":
            rounded[r["dtype"]] = rounded.get(r["dtype"], 0) + 1
    rest = [r for r in rows if r.get("how") not in ("changed", "rounded")]
    parts = [unit_summary(rest)] if rest else []
    parts += [f"{n} tensor{'s' if n > 1 else ''} rounded through {dt} (the reference's values at {dt}'s precision)"
              for dt, n in rounded.items()]
    if len(changed) > 3:
        sized = [r["rel_norm"] for r in changed if "rel_norm" in r]  # the others not explained (EXPLAIN_PER_UNIT)
        worst = f"; relative difference up to {max(sized):.3g}" if sized else ""
        parts.append(f"{len(changed)} tensors changed (e.g. {short_name(changed[0]['tensor'])}{worst})")
    elif changed:
        parts.append(unit_summary(changed))
    return "; ".join(p for p in parts if p)


def _summary(rows: list[dict]) -> str:
    """One phrase per kind of difference (ckptdiff's wording), with the tensors' statuses."""
    text = _corrupt_summary(rows)
    bys = {}
    for r in rows:
        if r["status"] in (UNWRITTEN, STALE):
            bys.setdefault((r["status"], r.get("holds")), []).append(r["tensor"])
    if bys:
        parts = [f"{len(v)} tensor{'s' if len(v) > 1 else ''} {s}: still the weights of {h}" for (s, h), v in bys.items()]
        corrupt = [r for r in rows if r["status"] not in (UNWRITTEN, STALE)]
        return "; ".join(parts + ([_corrupt_summary(corrupt)] if corrupt else []))
    return text

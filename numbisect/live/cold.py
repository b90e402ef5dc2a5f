"""The warm-vs-cold oracle: the same weights loaded cold into a fresh engine, against the
live engine they were pushed into warm.

A sync can be right in every tensor numbisect reads back and still leave the engine
computing otherwise (a kernel's copy that a reload did not redo); and numbisect's read-back
knows only the layouts it was taught. The engine's own cold load is the oracle that needs
neither: `Probe.warm_vs_cold()`

1. writes the reference's weights (checkpoint names, the reference's dtype) and config to a
   temporary checkpoint directory;
2. starts numbisect's eager engine on it in a child process (the engine's side, reached
   through the registry: numbisect.backends.vllm.cold, `load_cold`; a second engine in the
   trainer's process would share vLLM's global state and its thread settings with the
   user's engine), in the live engine's dtype, max_model_len and tensor-parallel size
   (each rank's parameters compared with the same rank's); the child answers, per tensor,
   the digest of each engine tensor read back in the checkpoint's names and of each
   parameter's bytes as the engine holds them (`raw_digests`: prepacked, by the engine's
   name; no layout knowledge), and, fed the reference's unit inputs on a few samples,
   every unit's local output;
3. reads the same from the warm engine and compares, per unit (`WarmCold`): `ok`, or
   `differs from cold` with the tensors whose read-back differs, the parameters whose
   bytes differ, and the relative L2 distance of the unit's local outputs (functional,
   where the live engine can be hooked; above `COLD_TOL`, the unit differs, unless a unit
   inside it holds other weights: that one is named, as in the weight check).

The cold side can be reused for another warm state of the same reference weights
(`warm_vs_cold(cold=earlier.cold)`: refused when the reference changed since).
Measured here (2 shared cores): the child costs ~25 s on the qwen3_moe fixture, most of it
importing vLLM and starting its engine (an engine started in this process instead: 3 s).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from numbisect.live import weights as W
from numbisect.live.engine import ENGINE
from numbisect.model.ckptdiff import apply_renames, short_name, unit_of, unit_prefixes

# The engine's side (numbisect.backends.vllm.cold): digests read where its model lives, put together here.
raw_digests, rank_raw_digests, merge_raw, rank_names, param_names = (
    ENGINE.raw_digests, ENGINE.rank_raw_digests, ENGINE.merge_raw, ENGINE.rank_names, ENGINE.param_names)

OK, DIFFERS = "ok", "differs from cold"
# Relative L2 distance of a unit's local outputs, warm vs cold, above which it differs: the same
# kernels on the same weights and inputs agree (measured 0 here); scrambled experts are ~1.
COLD_TOL = 1e-3


def rel_l2(a, b) -> float:
    """||a - b|| / ||b|| over every tensor of two captures (per-sample lists, nested)."""
    def flat(x):
        if isinstance(x, torch.Tensor):
            return [x.detach().float().reshape(-1)]
        if isinstance(x, (list, tuple)):
            return [t for y in x for t in flat(y)]
        return []

    xa, xb = flat(a), flat(b)
    if len(xa) != len(xb) or any(p.shape != q.shape for p, q in zip(xa, xb)):
        return float("inf")
    num = sum(float(((p - q) ** 2).sum()) for p, q in zip(xa, xb))
    den = sum(float((q ** 2).sum()) for q in xb)
    return (num / den) ** 0.5 if den else (0.0 if num == 0 else float("inf"))


@dataclass
class ColdLoad:
    """What the cold engine answered (digests only: no weights kept), for the reference
    weights whose digests `ref` holds."""

    ref: dict[str, str]  # the reference's digests (its own dtype) the directory was written from
    digests: dict[str, str]  # checkpoint name -> digest of the cold engine's tensor, read back
    raw: dict[str, str]  # vLLM parameter -> digest of its bytes
    captures: dict | None  # unit -> per-sample local output (fed the reference's inputs), or None
    samples: list | None  # the samples (ids, prompt length) the captures ran on
    feed: dict | None  # the reference's unit inputs fed
    seconds: float  # the child process, start to answer


@dataclass
class UnitCold:
    unit: str
    status: str
    tensors: list[str]  # checkpoint names whose read-back differs
    params: list[str]  # vLLM parameters whose bytes differ
    local_rel_l2: float | None = None  # warm vs cold local outputs

    def to_dict(self) -> dict:
        return {"unit": self.unit, "status": self.status, "tensors": self.tensors, "params": self.params,
                "local_rel_l2": self.local_rel_l2}

    @property
    def summary(self) -> str:
        parts = []
        if self.tensors:
            parts.append(f"{len(self.tensors)} tensor{'s' if len(self.tensors) > 1 else ''} read back differ "
                         f"(e.g. {short_name(self.tensors[0])})")
        if self.params:
            parts.append(f"{len(self.params)} parameter{'s' if len(self.params) > 1 else ''} hold other bytes "
                         f"(e.g. {self.params[0]})")
        if self.local_rel_l2 is not None and self.local_rel_l2 > COLD_TOL:
            parts.append(f"local output differs by {self.local_rel_l2:.3g}")
        return "; ".join(parts)


@dataclass
class WarmCold(W.ByUnit):
    """Per unit, whether the live engine (weights pushed warm) holds and computes what a
    fresh engine loaded cold from the same weights does. Truthy when every unit is ok."""

    units: list[UnitCold]
    seconds: float  # the whole comparison, the child included (0 for it when reused)
    cold: ColdLoad
    functional: bool
    cold_tol: float = COLD_TOL

    def to_dict(self) -> dict:
        return {"ok": self.ok, "seconds": round(self.seconds, 4), "cold_seconds": round(self.cold.seconds, 4),
                "functional": self.functional, "cold_tol": self.cold_tol, "units": [u.to_dict() for u in self.units]}

    def lines(self) -> list[str]:
        bad = self.differing()
        head = (f"warm vs cold: {'all ok' if not bad else f'{len(bad)} of {len(self.units)} units differ'} "
                f"({self.seconds:.2f} s, the cold engine {self.cold.seconds:.2f} s)")
        return [head] + [f"  {u.unit:<24} {u.status:<18} {u.summary}" for u in bad]


def compare(warm_digests: dict[str, str], warm_raw: dict[str, str], warm_captures: dict | None, cold: ColdLoad,
            raw_names: dict[str, list[str]], arch, config, seconds: float) -> WarmCold:
    """Per unit of the reference's family: the tensors and parameters that differ, and the
    local outputs' distance (module doc). `raw_names`: vLLM parameter -> the checkpoint
    names it holds (which unit it belongs to)."""
    prefixes = unit_prefixes(arch, config)
    renames = getattr(arch, "ckpt_renames", {}) or {}

    def unit(name: str) -> str:
        return unit_of(apply_renames(name, renames), prefixes) or "(no unit)"

    tensors: dict[str, list[str]] = {}
    for n in sorted(set(warm_digests) | set(cold.digests)):
        if warm_digests.get(n) != cold.digests.get(n):
            tensors.setdefault(unit(n), []).append(n)
    params: dict[str, list[str]] = {}
    for p in sorted(set(warm_raw) | set(cold.raw)):
        if warm_raw.get(p) != cold.raw.get(p):
            for u in sorted({unit(n) for n in raw_names.get(p) or [p]}):
                params.setdefault(u, []).append(p)
    local = {}
    if warm_captures is not None and cold.captures is not None:
        local = {u: rel_l2(warm_captures[u], cold.captures[u]) for u in cold.captures if u in warm_captures}
    held = {unit(n) for n in cold.digests} | set(local)
    out = []
    for u in [u.name for u in arch.units(config)] + ["(no unit)"]:
        if u not in held and u not in tensors and u not in params:
            continue
        err = local.get(u)
        # a unit whose output differs because a unit inside it holds other weights: that one speaks for it
        inside = any((k == u or k.startswith(u + ".")) and v for k, v in [*tensors.items(), *params.items()])
        bad = bool(tensors.get(u) or params.get(u)) or (err is not None and err > COLD_TOL and not inside)
        out.append(UnitCold(u, DIFFERS if bad else OK, tensors.get(u, []), params.get(u, []), err))
    return WarmCold(out, seconds, cold, warm_captures is not None)


__all__ = ["COLD_TOL", "DIFFERS", "OK", "ColdLoad", "UnitCold", "WarmCold", "compare", "merge_raw", "param_names", "rank_names",
           "rank_raw_digests", "raw_digests", "rel_l2"]

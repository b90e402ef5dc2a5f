"""Recurrent state of linear-attention layers (Gated DeltaNet: Qwen3.5-MoE, Qwen3-Next): the
state each layer carries after a sample, and after every chunk of it, captured on both sides
and compared like any unit's output, so drift in the state shows before it reaches the output.

A linear-attention unit (`layers.{i}.attn` of variant `linear` in the family's ArchMap)
keeps one matrix per value head, [heads, k_dim, v_dim], that every token updates (the
delta rule with its decay and beta gates). Its output at a token reads that state, so an
error in the state (a damaged gate, a low-precision update, a state kept in bf16) reaches
the output only through what later tokens read; the state itself shows it first.

1. `linear_units(backend)`: the units that carry a recurrent state (from the arch map's
   attention variant, so every family with a `linear` variant is covered).
2. `StateProbe`: installed on a backend for one forward (`Backend.install_state_probe`;
   transformers: the final state its chunked delta rule returns; vLLM: the request's
   slot of the layer's mamba cache after the prefill), it records each linear unit's
   state after the forward's last token.
3. Points: the state after a sample is its prefill's final state; the state at a chunk
   boundary (every `CHUNK` = 64 tokens, transformers' and vLLM's chunk size) is the
   final state of a prefill of the sample's first L tokens: the state a chunked
   implementation holds at that boundary (the recurrence is causal, so it is the same
   state), and what an engine stores at a prefill boundary (chunked prefill, prefix
   caching). At most `MAX_BOUNDARIES` boundaries per sample, evenly spread (each is one
   more forward per side). Samples with images: the final state only.
4. `state_light(sides)`: in a comparison, point by point, the reference and the engine
   with the probe (propagated), and, with `local`, the engine's linear units fed the
   reference's inputs (the state error of each layer on its own). `StateStats` folds each
   point's states as they come (none is kept: a real model's states are megabytes per
   layer and point) into, per linear unit, the error of the final states over all samples
   (as any capture's, `capture.UnitStats`: relative L2, max abs, cosine, ulps with the
   floor per sample; rows are heads, so `worst_token` names the head), per sample, and
   per boundary (over the samples reaching it), so its growth along the sequence shows.
   In decode mode (`--engine-mode decode`) also `decode`: the engine runs each sample as a
   rollout does (prompt prefilled, then one token per step through its recurrent-step
   kernel, not the chunked rule), and its state after the prompt and after decode steps
   (`decode_points`, at most `MAX_BOUNDARIES` evenly spread, then the end) is measured
   against the reference's after the same tokens; its `boundaries` are those points.
5. `dump_states(sides)`: against a `dump:` engine, the states it wrote (`numbisect.dump`:
   `state.{i}`, and `state.{i}.{n}` at boundaries) against the reference's at the same
   points; local: the reference's linear units fed the dumped inputs. Linear units whose
   states the dump lacks are listed under `missing`.
"""

from __future__ import annotations

import math

import torch

from numbisect.model.trace import Sample
from numbisect.patching.arrangement import arranged
from numbisect.patching.probes.state import (  # noqa: F401 (read as recurrent.*)
    CHUNK,
    MAX_BOUNDARIES,
    StateProbe,
    boundaries,
    linear_units,
    points,
    prefix,
    spread,
)
from numbisect.pipeline.capture import UnitStats


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1)  # [heads, k_dim * v_dim]: a row per head


class StateStats:
    """One engine pass's state error against the reference, folded point by point (no state
    outlives its point): per unit, over every sample's final state (`capture.UnitStats`:
    the error of any capture, ULP floor per sample), per sample, and per boundary."""

    def __init__(self):
        self.final: dict = {}  # unit -> UnitStats
        self.per_sample: dict = {}  # unit -> [{sample, tokens, rel_l2, max_abs, cosine}]
        self.bounds: dict = {}  # unit -> tokens -> UnitStats
        self.reached: dict = {}  # unit -> tokens -> samples that reach it

    def add(self, i: int, L: int, final: bool, ref: dict, eng: dict) -> None:
        for u, e in eng.items():
            r = ref.get(u)
            if r is None:
                continue
            r, e = _rows(r), _rows(e)
            if final:
                self.final.setdefault(u, UnitStats(e.dtype)).update(r, e, i)
                one = UnitStats(e.dtype)
                one.update(r, e, i)
                self.per_sample.setdefault(u, []).append({"sample": i, "tokens": L, **_brief(one.result())})
            else:
                self.bounds.setdefault(u, {}).setdefault(L, UnitStats(e.dtype)).update(r, e, i)
                self.reached.setdefault(u, {})[L] = self.reached.get(u, {}).get(L, 0) + 1

    def result(self, unit: str) -> dict | None:
        if unit not in self.final:
            return None
        bounds = self.bounds.get(unit, {})
        return {"final": self.final[unit].result(), "per_sample": self.per_sample[unit],
                "boundaries": [{"tokens": L, "samples": self.reached[unit][L], **_brief(bounds[L].result())}
                               for L in sorted(bounds)]}


def _brief(err: dict) -> dict:
    return {k: err[k] for k in ("rel_l2", "max_abs", "cosine")}


def first_above(report: dict, tol: float, key: str = "propagated") -> str | None:
    """The first linear unit whose final-state relative L2 error is above `tol` (NaN counts)."""
    for row in report["layers"]:
        p = row.get(key)
        if p is None:
            continue
        v = p["final"]["rel_l2"]
        if v is None or math.isnan(float(v)) or float(v) > tol:
            return row["unit"]
    return None


# -- in a comparison (comparison.Sides) -----------------------------------------------------------
def state_light(sides, local: bool) -> dict | None:
    """The recurrent-state section of a comparison: for every point, the reference, the
    engine (with its planted faults) on its own inputs (propagated) and, with `local`, the
    engine with its linear units fed the reference's inputs, each with the probe; every
    point's states folded into `StateStats` and dropped. A `dump:` engine: the states it
    wrote (`dump_states`). A tensor-parallel engine reads each rank's heads and puts them
    together (`VLLMTPBackend.install_state_probe`). None for a model without linear
    attention or the rollout (no states to read)."""
    ref, eng = sides.ref, sides.engine
    units = linear_units(ref)
    if units and eng is not None and eng.recorded:  # a dump: the states it wrote
        return dump_states(sides, units, local)
    if not units or eng is None or eng.recorded:
        return None
    samples = sides.samples
    pts = points(samples)
    sides.say(f"recurrent state: {len(units)} linear-attention layers at {len(pts)} points per side")
    decode = getattr(sides, "mode", "prefill") == "decode"
    stats = {"propagated": StateStats(), **({"local": StateStats()} if local else {}), **({"decode": StateStats()} if decode else {})}
    shape: dict = {}
    unread: list[str] = []
    rp, ep = StateProbe(ref), StateProbe(eng)
    undo = [rp.install()]
    try:
        with arranged(eng, ref, sides.faults):
            undo.append(ep.install())
            for i, s in enumerate(samples):
                n = len(s.ids)
                inputs = {}
                for L in [n] + [L for _, L in pts if _ == i and L != n]:  # the whole sample first: its inputs
                    final = L == n
                    r = ref.forward([prefix(s, L)], capture_inputs=units if local and final else ())
                    if final:
                        inputs = {u: x[0] for u, x in r.inputs.items() if x}
                    rs = rp.take()
                    if final:
                        ref_final = rs
                    shape.update({u: list(t.shape) for u, t in rs.items()})
                    eng.forward([prefix(s, L)], mode="prefill")
                    stats["propagated"].add(i, L, final, rs, ep.take())
                    if local and inputs:
                        eng.forward([prefix(s, L)], feed={u: [x[:L]] for u, x in inputs.items()}, mode="prefill")
                        stats["local"].add(i, L, final, rs, ep.take())
                if decode:
                    unread += _decode_states(ref, eng, rp, ep, s, i, ref_final, stats["decode"])
    finally:
        for u in reversed(undo):
            u()
    extra = {"engine_mode": "decode", "decode_unread": unread} if decode else {}
    return _section(units, stats, shape, {"ref": rp.source, "engine": ep.source}, sides.settings.unit_tol, **extra)


def decode_points(P: int, T: int, cap: int = MAX_BOUNDARIES) -> list[int]:
    """Token counts at which a decode-mode engine's state is measured: after the prompt's
    prefill (P) and after decode steps (P+1 .. T-1), at most `cap` evenly spread; then the
    sample's end (T, after the last step)."""
    return spread(list(range(P, T)), cap) + [T]


def _decode_states(ref, eng, rp: StateProbe, ep: StateProbe, s: Sample, i: int, ref_final: dict, stats: StateStats) -> list[str]:
    """Decode mode: the engine runs sample `s` as a rollout does (the prompt prefilled, then
    one token per step through its recurrent-step kernel), with its state kept at
    `decode_points`; each is folded against the reference's state after the same tokens
    (a prefill of that prefix; its final state is `ref_final`). Returns `unit@tokens` for
    points the engine's probe did not read (never counted as agreement)."""
    n = len(s.ids)
    want = decode_points(len(s.prompt_ids), n)
    ep.at = set(want)
    try:
        eng.forward([s], mode="decode")
        got = ep.take_steps()
        ep.take()
    finally:
        ep.at = set()
    unread = []
    for L in want:
        if L == n:
            rs = ref_final
        else:
            ref.forward([prefix(s, L)])
            rs = rp.take()
        es = {u: got[u][L] for u in rs if L in got.get(u, {})}
        unread += [f"{u}@{L} (sample {i})" for u in rs if u not in es]
        stats.add(i, L, L == n, rs, es)
    return unread


def dump_states(sides, units: list[str], local: bool) -> dict:
    """The recurrent-state section against a `dump:` engine: the states it wrote (final, and
    the chunk boundaries it wrote, at most MAX_BOUNDARIES per sample, evenly spread) against
    the reference's at the same points (propagated); with `local`, the reference's linear
    units fed the dumped inputs (`in.{i}` of the unit), against the same dumped states (as
    a dump's local error is). Linear units without states in the dump are listed under
    `missing` (no figure, never a zero)."""
    ref, eng = sides.ref, sides.engine
    have = [u for u in units if u in eng.states]
    missing = [u for u in units if u not in eng.states]
    stats = {"propagated": StateStats(), **({"local": StateStats()} if local else {})}
    shape: dict = {}
    rp = StateProbe(ref)
    if have:
        sides.say(f"recurrent state: {len(have)} linear-attention layers from the dump"
                  + (f" ({len(missing)} not in it)" if missing else ""))
        undo = rp.install()
        try:
            for i, s in enumerate(sides.samples):
                n = len(s.ids)
                inputs = {}
                if local:
                    inputs = {u: x for u in have if u in eng.dumped for x in [eng.tensor(u, f"in.{i}")] if x is not None}
                written = sorted(set().union(*(eng.state_bounds[u].get(i, []) for u in have)))  # any unit's
                bl = spread(written) if s.images is None else []
                for L in [n] + bl:
                    final = L == n
                    ref.forward([prefix(s, L)])
                    rs = rp.take()
                    es = {u: eng.state(u, i, L) for u in have if final or L in eng.state_bounds[u].get(i, [])}
                    shape.update({u: list(t.shape) for u, t in es.items()})
                    stats["propagated"].add(i, L, final, rs, es)
                    if inputs:
                        ref.forward([prefix(s, L)], feed={u: [x[:L]] for u, x in inputs.items()})
                        stats["local"].add(i, L, final, rp.take(), {u: es[u] for u in inputs if u in es})
        finally:
            undo()
    return _section(have, stats, shape, {"ref": rp.source, "engine": f"dump {eng.path} (state.{{i}} tensors of the linear units)"},
                    sides.settings.unit_tol, missing=missing)


def _section(units: list[str], stats: dict, shape: dict, source: dict, unit_tol: float, **extra) -> dict:
    """The report's `recurrent_state` section from the folded statistics of `units`."""
    layers = []
    for u in units:
        row = {"unit": u, "layer": int(u.split(".")[1]), "state_shape": shape.get(u)}
        for name in ("propagated", "local", "decode"):
            if name in stats or name != "decode":
                row[name] = stats[name].result(u) if name in stats else None
        layers.append(row)
    report = {"chunk_size": CHUNK, "max_boundaries": MAX_BOUNDARIES, "source": source, "first_above_tol": None,
              "layers": layers, **extra}
    report["first_above_tol"] = first_above(report, unit_tol)
    if any(row.get("decode") for row in layers):
        report["first_above_tol_decode"] = first_above(report, unit_tol, "decode")
    return report

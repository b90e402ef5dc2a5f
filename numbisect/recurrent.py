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
4. `state_light(sides)`: in a comparison, the reference and the engine over every point
   with the probe (propagated), and, with `local`, the engine's linear units fed the
   reference's inputs (the state error of each layer on its own). `state_report` gives
   per linear unit the error of the final states over all samples (as any capture's:
   relative L2, max abs, cosine, ulps; rows are heads, so `worst_token` names the head),
   per sample, and per boundary (the samples reaching it), so its growth along the
   sequence is visible.
"""

from __future__ import annotations

import math

import torch

from numbisect.trace import Sample

CHUNK = 64  # chunk size of transformers' torch_chunk_gated_delta_rule and of vLLM's chunked delta rule
MAX_BOUNDARIES = 8  # chunk boundaries measured per sample (one more forward per side each)


def linear_units(backend) -> list[str]:
    """The units that carry a recurrent state: attention of the arch map's `linear` variant."""
    return [u.name for u in backend.units if u.kind == "attn" and getattr(u, "variant", "") == "linear"]


def boundaries(n: int, chunk: int = CHUNK, cap: int = MAX_BOUNDARIES) -> list[int]:
    """Token counts at which the state is measured before the sample's end: multiples of
    `chunk` below `n`, at most `cap` of them evenly spread (the last one kept)."""
    b = list(range(chunk, n, chunk))
    if len(b) > cap:
        b = sorted({b[round(i * (len(b) - 1) / (cap - 1))] for i in range(cap)}) if cap > 1 else b[-1:]
    return b


def points(samples: list[Sample], chunk: int = CHUNK, cap: int = MAX_BOUNDARIES) -> list[tuple[int, int]]:
    """(sample, tokens) for every state measured: each chunk boundary, then the sample's end."""
    out = []
    for i, s in enumerate(samples):
        n = len(s.ids)
        out += [(i, L) for L in (boundaries(n, chunk, cap) if s.images is None else [])]
        out.append((i, n))
    return out


def prefix(s: Sample, L: int) -> Sample:
    """The sample's first L tokens, as a prompt of its own (the sample itself when L is its length)."""
    if L >= len(s.ids):
        return s
    return Sample(prompt_ids=list(s.ids[:L]), completion_ids=[], line=s.line)


class StateProbe:
    """Records, per linear unit, its recurrent state after the last token of each forward."""

    def __init__(self, backend):
        self.backend = backend
        self.units = linear_units(backend)
        self.last: dict[str, torch.Tensor] = {}
        self.source = ""  # where the backend reads the state (set by its install)

    def record(self, unit: str, state: torch.Tensor) -> None:
        """One call of `unit`'s recurrence: `state` [heads, k_dim, v_dim] (or [1, ...]) after
        the call's last token. A later call of the same forward (a prefill in steps) replaces it."""
        if state.dim() == 4:
            if state.shape[0] != 1:
                from numbisect.errors import BackendError

                raise BackendError(f"state probe on {unit}: {state.shape[0]} sequences in one call (expected one sample)")
            state = state[0]
        self.last[unit] = state.detach().to("cpu", copy=True)

    def take(self) -> dict[str, torch.Tensor]:
        """The states of the forward that just ran; the probe is then empty."""
        out, self.last = self.last, {}
        return out

    def install(self):
        """Install the probe on its backend; returns the callable that takes it out."""
        from numbisect.backends.ledger import installed

        return installed(lambda ledger: self.backend.install_state_probe(self, ledger))


def run_points(backend, samples: list[Sample], pts: list[tuple[int, int]], feed_inputs: dict | None = None) -> tuple[dict, str]:
    """((sample, tokens) -> unit -> state, where the backend's states were read), one forward
    of one (prefix) sample per point. `feed_inputs`: unit -> per-sample reference inputs;
    each point's first rows are fed."""
    probe = StateProbe(backend)
    out = {}
    undo = probe.install()
    try:
        for i, L in pts:
            feed = None
            if feed_inputs:
                feed = {u: [xs[i][:L]] for u, xs in feed_inputs.items() if xs and xs[i] is not None}
            backend.forward([prefix(samples[i], L)], capture=(), feed=feed, mode="prefill")
            out[(i, L)] = probe.take()
    finally:
        undo()
    return out, probe.source


# -- the report ---------------------------------------------------------------------------------
def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1)  # [heads, k_dim * v_dim]: a row per head


def _brief(err: dict) -> dict:
    return {k: err[k] for k in ("rel_l2", "max_abs", "cosine")}


def state_pass(samples, pts, units, ref: dict, eng: dict) -> dict:
    """One engine pass against the reference, per unit: final states' error over all samples,
    per sample, and per chunk boundary."""
    from numbisect.compare import _unit_error

    out = {}
    for u in units:
        have = [p for p in pts if u in ref.get(p, {}) and u in eng.get(p, {})]
        finals = [p for p in have if p[1] == len(samples[p[0]].ids)]
        if not finals:
            out[u] = None
            continue
        r = [_rows(ref[p][u]) for p in finals]
        e = [_rows(eng[p][u]) for p in finals]
        entry = {"final": _unit_error(r, e, e[0].dtype),
                 "per_sample": [{"sample": p[0], "tokens": p[1], **_brief(_unit_error([a], [b], b.dtype))}
                                for p, a, b in zip(finals, r, e)]}
        bounds = []
        for L in sorted({p[1] for p in have if p not in finals}):
            at = [p for p in have if p[1] == L and p not in finals]
            err = _unit_error([_rows(ref[p][u]) for p in at], [_rows(eng[p][u]) for p in at], e[0].dtype)
            bounds.append({"tokens": L, "samples": len(at), **_brief(err)})
        entry["boundaries"] = bounds
        out[u] = entry
    return out


def state_report(samples, pts, units, ref: dict, passes: dict, shape: dict, sources: dict) -> dict:
    """The report's `recurrent_state`: per linear unit and engine pass (`passes`: name -> states)."""
    per_pass = {name: state_pass(samples, pts, units, ref, states) for name, states in passes.items()}
    layers = []
    for u in units:
        row = {"unit": u, "layer": int(u.split(".")[1]), "state_shape": shape.get(u)}
        for name in ("propagated", "local"):
            row[name] = per_pass[name].get(u) if name in per_pass else None
        layers.append(row)
    return {"chunk_size": CHUNK, "max_boundaries": MAX_BOUNDARIES, "source": sources,
            "first_above_tol": None, "layers": layers}


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


# -- in a comparison (pipeline.Sides) -------------------------------------------------------------
def state_light(sides, local: bool) -> dict | None:
    """The recurrent-state section of a comparison: both sides with the probe over every
    point (the engine with its planted faults), and with `local` the engine's linear
    units fed the reference's inputs. None for a model without linear attention, the
    rollout, a dump, or an engine under tensor parallelism (their states are out of reach)."""
    from numbisect.engine_state import arranged

    ref, eng = sides.ref, sides.engine
    units = linear_units(ref)
    if not units or eng is None or eng.recorded or getattr(eng, "remote", False):
        return None
    samples = sides.samples
    pts = points(samples)
    sides.say(f"recurrent state: {len(units)} linear-attention layers at {len(pts)} points per side")
    ref_states, ref_source = run_points(ref, samples, pts)
    feed_inputs = None
    if local:
        r = ref.forward(samples, capture_inputs=units)
        feed_inputs = {u: r.inputs.get(u) for u in units if r.inputs.get(u)}
    passes = {}
    with arranged(eng, ref, sides.faults):
        passes["propagated"], eng_source = run_points(eng, samples, pts)
        if feed_inputs:
            passes["local"], _ = run_points(eng, samples, pts, feed_inputs)
    last = pts[-1]
    shape = {u: list(ref_states[last][u].shape) for u in units if u in ref_states.get(last, {})}
    sources = {"ref": ref_source, "engine": eng_source}
    report = state_report(samples, pts, units, ref_states, passes, shape, sources)
    report["first_above_tol"] = first_above(report, sides.settings.unit_tol)
    return report

"""Decode mode (`--engine-mode decode`): the engine runs the trace the way a rollout does.

The prompt is prefilled, then the completion is decoded one token at a time with each
token forced to the trace's (backends/vllm/force.py, backends/steps.py). What this
module adds on top of the comparison pipeline:

1. Which engines can decode, checked before any model loads (`check_mode`).
2. Which units can be swapped in decode mode. A swap puts the reference's module in the
   engine and runs it on what the engine hands it; in decode mode that is one token per
   step. Units that only look at their own token (norms, MLP / MoE blocks and their
   router, experts and shared expert, embedding, lm_head) swap as in prefill. Attention,
   and whole layers that contain it, would need the engine's KV cache: not swappable.
3. The decode-vs-prefill comparison inside the engine (`engine_modes`): the same engine
   in prefill mode is measured against the reference and against its own decode run,
   per token group and per unit, so a user can tell whether a trainer mismatch comes
   from the prefill or from the decode kernels.
4. The report's summary lines are in `numbisect.report.sections.decode` (torch-free, for `bisect report`).
"""

from __future__ import annotations

import torch

from numbisect.backends import BACKENDS
from numbisect.backends.base import ENGINE_MODES, check_engine_mode
from numbisect.common.errors import InputError
from numbisect.model.units import PREFILL_ONLY_KINDS
from numbisect.pipeline import measure as C

# Kinds whose swap needs the engine's KV cache (the reference module would see one token
# and no past), or that run on the prefill path only (a Gated DeltaNet's conv and gates,
# whose state is the engine's conv cache): not swappable in decode mode.
NEEDS_KV_CACHE = ("attn", "layer") + PREFILL_ONLY_KINDS


def check_mode(engine_kind: str, mode: str) -> None:
    """Refuse a mode the engine cannot run, before anything is loaded."""
    if mode not in ENGINE_MODES:
        raise InputError(f"unknown --engine-mode {mode!r}; choose one of {', '.join(ENGINE_MODES)}")
    if mode == "prefill":
        return
    entry = BACKENDS.get(engine_kind)
    if entry is not None and entry.source == "trace":
        runners = " or ".join(e.form(k) for k, e in BACKENDS.items() if "decode" in e.modes)
        raise InputError(
            f"--engine-mode decode needs an engine that runs ({runners}); --engine {engine_kind} only has the trace's recorded log-probs"
        )
    check_engine_mode(engine_kind, mode, entry.modes if entry is not None else ("prefill",))


def check_tp(mode: str, engine_opts: dict) -> None:
    """Decode mode under tensor parallelism is refused before any worker starts: the
    workers' engine runs prefill forwards only (`VLLMTPBackend.forward`), and a decode run
    read as prefill would report decode and prefill identical."""
    tp = int((engine_opts or {}).get("tensor_parallel_size", 1) or 1)
    if mode == "decode" and tp > 1:
        raise InputError(f"--engine-mode decode does not run under tensor parallelism yet (tensor_parallel_size={tp}): "
                         "run it on tensor_parallel_size=1, or use --engine-mode prefill")


def check_trace(trace, mode: str) -> None:
    """Decode mode replays token ids only: a trace with images is refused (prefill takes them)."""
    if mode == "decode" and any(getattr(s, "images", None) is not None for s in trace.samples):
        raise InputError("--engine-mode decode takes text-only traces: this one has images (run it with --engine-mode prefill)")


def not_swappable(units, mode: str) -> list[str]:
    """Names of the units that cannot be swapped in `mode`."""
    if mode != "decode":
        return []
    return [u.name for u in units if u.kind in NEEDS_KV_CACHE]


def check_swappable(engine, names, mode: str) -> None:
    """InputError when a unit to swap (or one inside it) cannot be swapped in `mode`."""
    bad = set(not_swappable(engine.units, mode))
    hit = [n for n in names if n in bad]
    if hit:
        kinds = sorted({engine.unit(n).kind for n in hit})
        raise InputError(
            f"{', '.join(kinds)} units cannot be swapped in decode mode (the swap would need the engine's KV or conv-state cache): "
            f"{', '.join(hit[:4])}{' ...' if len(hit) > 4 else ''}; use --engine-mode prefill to swap them"
        )


def check_faults(engine, faults, mode: str) -> None:
    """InputError for an output noise at a unit on the prefill path only (a Gated DeltaNet's
    conv or gates) in decode mode: it would fire on the prompt's forward alone, a decode step
    making no such call, and the report would read the gap as decode differing from prefill.
    A weight noise there reaches every step (the conv weight, A_log and dt_bias are the
    attention's own, which the decode kernels read too)."""
    if mode != "decode":
        return
    hit = [f.spec for f in faults if f.kind == "output_noise" and engine.unit(f.unit).kind in PREFILL_ONLY_KINDS]
    if hit:
        raise InputError(f"--engine-fault {hit[0]}: an output noise on a conv or gates unit fires in the prompt's prefill only "
                         "(a decode step makes no such call); plant it with --engine-mode prefill, or on the attention")


def decode_candidates(cands: list[str], engine, mode: str) -> list[str]:
    bad = set(not_swappable(engine.units, mode))
    return [c for c in cands if c not in bad]


# -- decode against prefill inside the engine ------------------------------------------------
def engine_modes(samples, settings, groups, engine_dtype, ref, decode, prefill, units) -> dict:
    """The `engine_modes` section of a decode-mode report: the engine's `decode` and
    `prefill` runs (ForwardResults with every unit captured) against the reference `ref`
    and each other."""
    s = settings
    section = mode_pair(samples, s, groups, ref, decode, prefill)
    rows = C.unit_report(units, prefill, decode, None, engine_dtype, s)
    section["decode_vs_prefill"].update({
        "first_unit": C.first_divergence(rows, s),
        "units_differing": [
            {"name": r["name"], "rel_l2": r["propagated"]["rel_l2"], "max_abs": r["propagated"]["max_abs"]}
            for r in rows
            if r["propagated"] and not r["propagated"]["ulps"]["bitwise_equal"]
        ],
    })
    return {
        **section,
        "not_swappable": {
            "units": not_swappable(units, "decode"),
            "kinds": list(NEEDS_KV_CACHE),
            "reason": "attention (and whole layers) would need the engine's KV cache, a linear attention's conv and gates "
                      "its conv-state cache (they run on the prefill path only); swap them with --engine-mode prefill",
        },
    }


def mode_pair(samples, settings, groups, ref, decode, prefill) -> dict:
    """Token metrics of one engine's `decode` and `prefill` runs (ForwardResults): prefill
    against the reference `ref`, decode against prefill, and their log-prob differences.
    The token part of `engine_modes`; alone, the user's engine's (`userengine`, a child
    process: no unit captured)."""
    return {
        "mode": "decode",
        "prefill_vs_reference": _groups(C.token_report(samples, ref, prefill, settings, groups)),
        "decode_vs_reference": None,  # filled by the caller from the baseline
        "decode_vs_prefill": {**_groups(C.token_report(samples, prefill, decode, settings, groups)),
                              "logprob_diff": _logprob_diff(samples, prefill, decode)},
    }


def _groups(tokens: dict) -> dict:
    return {
        "value": tokens["value"],
        "groups": {
            g: {"tokens": v["tokens"], "k3_mean": v["k3"]["mean"], "k3_p99": v["k3"]["p99"], "k3_max": v["k3"]["max"],
                "kl_mean": (v["kl"] or {}).get("mean"), "top1_agree": v.get("top1_agree")}
            for g, v in tokens["groups"].items()
        },
    }


def _logprob_diff(samples, a, b) -> dict:
    """Completion-token log-probs of two runs: largest difference and fraction identical."""
    diffs = []
    for smp, x, y in zip(samples, a.token_logprobs, b.token_logprobs):
        m = smp.position_mask("completion")
        diffs.append((x[m].double() - y[m].double()).abs())
    d = torch.cat(diffs) if diffs else torch.zeros(0)
    n = int(d.numel())
    return {
        "tokens": n,
        "max_abs": float(d.max()) if n else 0.0,
        "mean_abs": float(d.mean()) if n else 0.0,
        "frac_equal": float((d == 0).double().mean()) if n else 1.0,
    }


def with_baseline(section: dict, baseline: dict) -> dict:
    section["decode_vs_reference"] = _groups(baseline)
    return section

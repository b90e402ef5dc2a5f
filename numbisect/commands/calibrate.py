"""Noise-floor calibration: the reference against harmless variants of itself.

1. Run the reference (its dtype, its options, batch size 1) over the trace once.
2. Run each variant over the same trace: another batch composition (`batch_size`, right
   padding), the other attention implementation (eager / sdpa), every other experts
   implementation of an MoE model (transformers 5.x: eager, batched_mm, grouped_mm), and
   another dtype when asked. None of them changes the model: whatever they move the
   log-probs by is noise an engine may have too.
3. Per variant and per token group: mean and p99 k3, mean full-vocabulary KL, and the
   largest absolute log-prob difference. The floor is the largest over the variants.
4. `--threshold floor` (or `floorxN`) turns the floor of the judged metric and group into
   the threshold: from `--floor FILE`, or calibrated on the fly on the run's own reference
   and trace when no file is given. The report records where the threshold came from.
"""

from __future__ import annotations

import gc
import math
import time

import torch

from numbisect.backends import open_backend, require_reference
from numbisect.backends.base import load_config, parse_dtype
from numbisect.common.errors import InputError
from numbisect.common.formatting import fmt
from numbisect.common.safeio import read_input
from numbisect.common.textsafe import path_text
from numbisect.common.threshold import parse_threshold  # noqa: F401  (resolve_threshold; tests)
from numbisect.model.rlformats import load_any
from numbisect.model.trace import check_vocab
from numbisect.pipeline import measure as C

FLOOR_VERSION = 1
METRICS = ("k3-mean", "k3-p99", "kl-mean", "max-abs-logprob-diff")
VARIANT_KINDS = ("batch", "attn", "experts", "dtype")
ATTN = ("eager", "sdpa")
EXPERTS = ("eager", "batched_mm", "grouped_mm")


def parse_variants(names: list[str] | tuple[str, ...]) -> list[str]:
    out = []
    for part in names:
        for v in part.split(","):
            v = v.strip()
            if not v:
                continue
            if v not in VARIANT_KINDS:
                raise InputError(f"unknown variant {v!r}; choose from {', '.join(VARIANT_KINDS)}")
            out.append(v)
    return out


def plan(base, kinds: list[str], dtype_variant: str | None, batch_size: int) -> list[tuple[str, str, dict]]:
    """(label, dtype, hf options) of each variant; `base` is the reference backend."""
    opts = {k: v for k, v in base.options.items() if v is not None}
    cfg = base.model.config
    explicit = bool(kinds)
    kinds = kinds or ["batch", "attn", "experts"] + (["dtype"] if dtype_variant else [])
    if "dtype" in kinds and not dtype_variant:
        raise InputError("variant dtype needs --dtype-variant DTYPE (e.g. float32)")
    out = []
    if "batch" in kinds:
        if batch_size < 2:
            raise InputError("--batch-size must be at least 2 (the reference runs one sample at a time)")
        out.append((f"batch_size={batch_size}", base.dtype_name, {**opts, "batch_size": batch_size}))
    if "attn" in kinds:
        mine = getattr(cfg, "_attn_implementation", None) or "sdpa"
        for a in ATTN:
            if a != mine:
                out.append((f"attn_implementation={a}", base.dtype_name, {**opts, "attn_implementation": a}))
    if "experts" in kinds:
        moe = any(u.kind == "experts" for u in base.units)
        mine = (getattr(cfg, "_experts_implementation", None) or "grouped_mm") if moe else None
        if mine is None:
            if explicit:
                raise InputError(f"{base.arch.name} has no experts implementation to vary (not an MoE model)")
        else:
            for e in EXPERTS:
                if e != mine:
                    out.append((f"experts_implementation={e}", base.dtype_name, {**opts, "experts_implementation": e}))
    if dtype_variant:
        parse_dtype(dtype_variant)
        if dtype_variant == base.dtype_name:
            raise InputError(f"--dtype-variant {dtype_variant} is the reference's own dtype; give another")
        out.append((f"dtype={dtype_variant}", dtype_variant, opts))
    return out


def _metrics(samples, base, var, group: str) -> dict:
    settings = C.Settings(group=group)
    tokens = C.token_report(samples, base, var, settings, [group], detail=False)
    g = tokens["groups"][group]
    diffs = [(a - b).abs()[s.position_mask(group)] for s, a, b in zip(samples, base.token_logprobs, var.token_logprobs)]
    d = torch.cat(diffs) if diffs else torch.zeros(0)
    return {
        "tokens": g["tokens"],
        "k3-mean": g["k3"]["mean"],
        "k3-p99": g["k3"]["p99"],
        "kl-mean": (g["kl"] or {}).get("mean"),
        "max-abs-logprob-diff": float(d.max()) if d.numel() else 0.0,
    }


def _load(path, fmt=None, fields=None):
    """The trace as `run` reads it: numbisect JSONL or a rollout dump (numbisect.model.rlformats)."""
    return load_any(path, fmt, fields)


def calibrate(ref: str, trace_path: str, *, dtype: str = "bfloat16", ref_opts: dict | None = None,
              variants: list[str] | tuple[str, ...] = (), dtype_variant: str | None = None, batch_size: int = 4,
              progress=lambda m: None, trace_format: str | None = None, trace_fields: str | None = None) -> dict:
    """The floor document (see `render`); every variant runs over the whole trace."""
    kind, path = C.parse_spec(ref, "--ref")
    require_reference(kind, ref)
    kinds = parse_variants(variants)
    trace = _load(trace_path, trace_format, trace_fields)
    cfg = load_config(path)
    check_vocab(trace, cfg.get_text_config().vocab_size)
    C.check_positions(trace, cfg, "the reference")
    ref_opts = dict(ref_opts or {})
    if "batch_size" in ref_opts:
        raise InputError("calibrate runs the reference with batch_size 1; vary it with --batch-size")
    C.check_opts(kind, ref_opts, "--ref-opt")
    if "layer_stream" in ref_opts:
        raise InputError("calibrate runs the reference whole: --ref-opt layer_stream is not available here")
    progress(f"loading reference {kind}:{path} ({dtype})")
    base_b = open_backend(kind, path, dtype, ref_opts, "--ref-opt")
    todo = plan(base_b, kinds, dtype_variant, batch_size)
    groups = C.group_names(trace) + ["all"]
    t0 = time.perf_counter()
    progress("running the reference")
    base = base_b.forward(trace.samples, full_logits=True)
    out_variants = []
    for label, vdtype, opts in todo:
        progress(f"running variant {label}")
        vb = open_backend(kind, path, vdtype, opts, "--ref-opt")
        res = vb.forward(trace.samples, full_logits=True)
        del vb
        gc.collect()
        out_variants.append({
            "name": label,
            "dtype": vdtype,
            "options": opts,
            "groups": {g: _metrics(trace.samples, base, res, g) for g in groups},
        })
    floor = {}
    for g in groups:
        floor[g] = {m: max((v["groups"][g][m] for v in out_variants if v["groups"][g][m] is not None), default=0.0) for m in METRICS}
    return C.sanitize({
        "numbisect_floor": FLOOR_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "ref": {"path": path, "dtype": dtype, "options": base_b.options, "arch": base_b.arch.name,
                "sha256": C.checkpoint_digest(path)},
        "trace": {"path": trace.path, "sha256": trace.sha256, "samples": len(trace.samples)},
        "variants": out_variants,
        "floor": floor,
        "seconds": round(time.perf_counter() - t0, 2),
    })


def render(doc: dict) -> str:
    r, t = doc["ref"], doc["trace"]
    lines = [
        f"numbisect calibrate | {r['arch']} | ref hf:{path_text(r['path'])} ({r['dtype']}) | trace {path_text(t['path'])}: {t['samples']} samples",
        "noise floor: the reference against harmless variants of itself",
    ]
    head = f"{'':<34}{'k3-mean':>10}{'k3-p99':>10}{'kl-mean':>10}{'max|dlogp|':>12}"

    def row(label, m):
        return f"{label:<34}{fmt(m['k3-mean']):>10}{fmt(m['k3-p99']):>10}{fmt(m['kl-mean']):>10}{fmt(m['max-abs-logprob-diff']):>12}"

    n = doc["variants"][0]["groups"]["completion"]["tokens"] if doc["variants"] else 0
    lines += ["", f"completion tokens ({n}), per variant:", head]
    lines += [row(v["name"], v["groups"]["completion"]) for v in doc["variants"]]
    lines += ["", "floor (the largest over the variants), per token group:", head]
    lines += [row(g, fl) for g, fl in doc["floor"].items()]
    return "\n".join(lines) + "\n"


# -- `--threshold floor` --------------------------------------------------------------------------
def load_floor(path: str, spec, group: str) -> dict:
    """A floor file made on this reference checkpoint, dtype and trace; InputError otherwise."""
    doc = read_input(path, "floor file", limit=64 * 2**20)  # NaN / Infinity literals are no floor
    if not isinstance(doc, dict) or doc.get("numbisect_floor") != FLOOR_VERSION or not isinstance(doc.get("floor"), dict):
        raise InputError(f"{path}: not a numbisect floor file (made by `bisect calibrate --out`)")
    _, ref_path = C.parse_spec(spec.ref, "--ref")
    trace = _load(spec.trace, getattr(spec, "trace_format", None), getattr(spec, "trace_fields", None))
    if doc.get("ref", {}).get("sha256") != C.checkpoint_digest(ref_path):
        raise InputError(f"{path}: floor was calibrated on another model ({doc.get('ref', {}).get('path')}), not {ref_path}")
    if doc.get("trace", {}).get("sha256") != trace.sha256:
        raise InputError(f"{path}: floor was calibrated on another trace ({doc.get('trace', {}).get('path')}), not {spec.trace}")
    if doc["ref"].get("dtype") != spec.ref_dtype:
        raise InputError(f"{path}: floor was calibrated in {doc['ref'].get('dtype')}, the reference runs in {spec.ref_dtype}")
    if group not in doc["floor"]:
        raise InputError(f"{path}: no floor for group {group!r} (has: {', '.join(doc['floor'])})")
    return doc


def resolve_threshold(text: str, floor_file: str | None, spec, metric: str, group: str, progress=lambda m: None) -> tuple[float, dict | None]:
    """The threshold as a number, and its origin when it comes from a floor."""
    value, factor = parse_threshold(text)
    if value is not None:
        if floor_file:
            raise InputError("--floor needs --threshold floor or floorxN")
        return value, None
    if floor_file:
        doc = load_floor(floor_file, spec, group)
        source = "file"
    else:
        progress("calibrating the noise floor (no --floor file given)")
        opts = {k: v for k, v in spec.ref_opts.items() if k != "batch_size"}
        doc = calibrate(spec.ref, spec.trace, dtype=spec.ref_dtype, ref_opts=opts, progress=progress,
                        trace_format=getattr(spec, "trace_format", None), trace_fields=getattr(spec, "trace_fields", None))
        source = "calibrated"
    if group not in doc["floor"]:
        raise InputError(f"no floor for group {group!r}")
    floor = doc["floor"][group][metric]
    floor = float(floor) if not isinstance(floor, str) else math.inf
    origin = {
        "source": source,
        "file": floor_file,
        "factor": factor,
        "floor": floor,
        "variants": [v["name"] for v in doc["variants"]],
    }
    return floor * factor, origin

"""A replay bundle: what the training loop saw when the trigger fired, written so that
`bisect replay BUNDLE` reproduces the finding offline, on another machine.

1. `write(probe, out_dir, samples)` runs the weight check on the batch (functional where
   the engine's forwards can be hooked: the same comparison `probe.compare` makes, run
   once) and writes the directory below; `bundle_action(probe, out_dir)` is a trigger's
   `on_fire` doing it on each fire (numbisect.live.trigger).
2. `load(path)` reads a bundle back and checks it (every problem one `InputError` line);
   `replay_inputs(bundle)` gives what `bisect compare` needs to run it: the reference's
   weights, vLLM on the engine's weights as they were read back from the live engine, the
   engine's settings, the batch.

Layout (`manifest.json` names every part; paths are relative to the bundle):

    manifest.json           format, version, what fired, the finding, each part below
    trace.jsonl             the batch, in numbisect's trace format (numbisect.model.trace)
    engine.json             the engine's settings, as `--engine-config` reads them
    reference-digests.json  a digest of every reference tensor, in its dtype and the engine's
    reference/              config.json + model.safetensors: the trainer's weights (weights=True)
    engine/                 config.json + model.safetensors: the engine's weights read back
                            from the engine in checkpoint names (weights=True)
    routing.json            MoE: the reference's chosen experts per router and sample, and
                            the engines' agreement per layer (MoE models only)
    weights.json            the weight check's report (`bisect weights`'s)
    compare.json            the comparison's report (`bisect compare`'s), where one could run

The engine's weights are the ones it computed with, not the trainer's: a sync bug is
frozen into `engine/`, so replaying needs neither the trainer nor the live engine.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
import os
import re
from dataclasses import dataclass

import torch

from numbisect import __version__
from numbisect.backends.base import DTYPES
from numbisect.common.errors import InputError
from numbisect.common.safeio import MB, check_input, file_sha256, read_input
from numbisect.common.textsafe import clip, path_text, printable
from numbisect.live.engine import KIND, REFERENCE_KIND
from numbisect.live.probe import LiveReport, random_samples, samples_trace
from numbisect.live.weights import digest, write_checkpoint
from numbisect.model import engine_config as E
from numbisect.model.trace import BUILTIN_GROUPS
from numbisect.patching.faults import parse_fault
from numbisect.pipeline import comparison as P
from numbisect.pipeline.provenance import new_report
from numbisect.report.document import write_json_atomic

FORMAT = "numbisect-replay-bundle"
VERSION = 2  # 2: the manifest's own checksum (manifest_sha256), every field typed when read
MANIFEST_LIMIT = 64 * MB  # a real manifest is a few kB (a weight summary line per unit)
# The parts a bundle may name, and whether each is a file or a checkpoint directory.
PARTS = {"trace": "file", "engine_settings": "file", "reference_digests": "file", "reference": "dir", "engine": "dir",
         "weights_report": "file", "compare_report": "file", "routing": "file"}
CHECKPOINT_FILES = ("config.json", "model.safetensors")
# The live engine's settings that are LLM() arguments `--engine-config` takes (its dtype is
# numbisect's to set: recorded in the manifest, given as --engine-dtype).
SETTINGS_KEYS = ("enforce_eager", "enable_prefix_caching", "logprobs_mode", "max_model_len", "tensor_parallel_size")


@dataclass
class Bundle:
    """A bundle read back by `load`: its directory and manifest."""

    path: str
    manifest: dict

    def part(self, key: str) -> str | None:
        rel = self.manifest["parts"].get(key)
        return None if rel is None else os.path.join(self.path, rel)

    @property
    def finding(self) -> dict:
        return self.manifest.get("finding") or {}


# -- writing ----------------------------------------------------------------------------------------
def _json(path: str, obj) -> None:
    write_json_atomic(path, obj)


def write_trace(trace, path: str) -> None:
    """A Trace as numbisect JSONL (prompt_ids, completion_ids, rollout_logprobs, groups)."""
    with open(path, "w") as f:
        for s in trace.samples:
            row = {"prompt_ids": list(s.prompt_ids), "completion_ids": list(s.completion_ids)}
            if s.rollout_logprobs is not None:
                row["rollout_logprobs"] = [float(x) for x in s.rollout_logprobs]
            groups = {k: list(v) for k, v in s.groups.items() if k not in BUILTIN_GROUPS and any(v)}
            if groups:
                row["groups"] = groups
            f.write(json.dumps(row) + "\n")


def engine_settings(live: dict) -> dict:
    """The live engine's settings (numbisect.live.engine.settings) in `--engine-config`'s form."""
    out = {k: live[k] for k in SETTINGS_KEYS if k in live}
    E.check_settings(out, "the engine's settings")
    return out


def _ids(x):
    """Expert ids (tensors, nested) as lists."""
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if isinstance(x, dict):
        return {str(k): _ids(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_ids(v) for v in x]
    return x


def write(probe, out_dir: str | os.PathLike, samples=None, *, weights: bool = True, fire=None, check=None) -> Bundle:
    """Check the engine's weights on `samples` (the batch) and write a bundle into `out_dir`
    (module doc); `weights`: also both sides' weights (else the digests only); `fire`: the
    trigger's Fire that led here, recorded; `check`: a functional `check_weights` already run
    on these samples (else one is run). Returns the bundle, read back."""
    out = os.fspath(out_dir)
    os.makedirs(out, exist_ok=True)
    if samples is None:
        samples = random_samples(probe.ref.vocab_size)
    if check is None:
        check = probe.check_weights(samples=samples, step=f"fire (batch {fire.step})" if fire is not None else None)
    parts: dict[str, str | None] = {}
    comparison = probe.last_comparison  # (Comparison, Trace, Settings) of the check's functional pass
    trace = comparison[1] if comparison else samples_trace(samples)
    write_trace(trace, os.path.join(out, "trace.jsonl"))
    parts["trace"] = "trace.jsonl"
    _json(os.path.join(out, "engine.json"), engine_settings(probe.engine_settings))
    parts["engine_settings"] = "engine.json"

    ref = probe._ref_tensors()
    eng_dtype = probe.engine.dtype
    ref_dtype = next(iter(ref.values())).dtype
    write_reference_digests(out, ref, eng_dtype)
    parts["reference_digests"] = "reference-digests.json"
    parts["reference"] = parts["engine"] = None
    if weights:
        config = probe.ref.config
        write_checkpoint(os.path.join(out, "reference"), config, ref)
        eng = probe._engine_tensors({n: tuple(t.shape) for n, t in ref.items()})
        write_checkpoint(os.path.join(out, "engine"), config, eng)
        parts["reference"], parts["engine"] = "reference", "engine"
    del ref

    weights_path = os.path.join(out, "weights.json")
    if comparison is not None:
        probe.weights_report(check, ["numbisect.live.bundle.write"]).save(weights_path)
    else:
        _json(weights_path, {"weights": check.to_dict()})
    parts["weights_report"] = "weights.json"
    finding: dict = {"weights_ok": check.ok, "weights_differ": {u.unit: u.status for u in check.differing()},
                     "weights_summary": check.lines(), "weight_version": check.weight_version}
    parts["compare_report"] = parts["routing"] = None
    if comparison is not None:
        c, ctrace, settings = comparison
        report = LiveReport(new_report("compare", ["numbisect.live.bundle.write"], probe.inputs(ctrace), settings.to_dict(),
                                       P.report_body(c)))
        report.save(os.path.join(out, "compare.json"))
        parts["compare_report"] = "compare.json"
        finding.update(verdict=report.verdict, first_divergence=report.report["first_divergence"],
                       k3_mean=report.metrics["groups"]["completion"]["k3"]["mean"], threshold=settings.threshold)
        if c.ref_routing or c.routing:
            _json(os.path.join(out, "routing.json"), {"reference_experts": _ids(c.ref_routing or {}), "agreement": c.routing})
            parts["routing"] = "routing.json"
    else:
        finding["compare_refused"] = probe.problem

    return write_manifest(out, arch=probe.ref.arch.name, model_type=getattr(probe.ref.config, "model_type", None),
                          ref_dtype=ref_dtype, eng_dtype=eng_dtype, live_settings=dict(probe.engine_settings),
                          faults=probe.engine_faults(), trace=trace, fire=fire, finding=finding, parts=parts)


def write_reference_digests(out: str, ref: dict[str, torch.Tensor], eng_dtype: torch.dtype) -> None:
    """reference-digests.json: every reference tensor's digest, in its dtype and the engine's."""
    ref_dtype = next(iter(ref.values())).dtype
    _json(os.path.join(out, "reference-digests.json"), {
        "algorithm": "blake2b, 16 bytes, of the tensor's bytes (numbisect.live.weights.digest)",
        "dtype": str(ref_dtype).removeprefix("torch."), "tensors": {n: digest(t) for n, t in sorted(ref.items())},
        "engine_dtype": str(eng_dtype).removeprefix("torch."),
        "in_engine_dtype": {n: digest(t.to(eng_dtype)) for n, t in sorted(ref.items())},
    })


def write_manifest(out: str, *, arch: str, model_type, ref_dtype, eng_dtype, live_settings: dict, faults: list,
                   trace, fire, finding: dict, parts: dict) -> Bundle:
    """manifest.json over the parts written in `out` (checksummed), last; the bundle read back."""
    manifest = {
        "format": FORMAT, "version": VERSION, "tool_version": __version__,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "model": {"arch": arch, "model_type": model_type},
        "reference": {"dtype": str(ref_dtype).removeprefix("torch.")},
        "engine": {"dtype": str(eng_dtype).removeprefix("torch."), "live_settings": live_settings, "faults": faults},
        "trace": {"samples": len(trace.samples), "completion_tokens": sum(len(s.completion_ids) for s in trace.samples)},
        "fire": fire.to_dict() if fire is not None else None,
        "finding": finding,
        "parts": parts,
        "sha256": {rel: file_sha256(os.path.join(out, rel)) for rel in _files(out, parts)},
        "replay": f"bisect replay {out}",
    }
    manifest["manifest_sha256"] = manifest_digest(manifest)
    _json(os.path.join(out, "manifest.json"), manifest)
    return load(out)


def manifest_digest(m: dict) -> str:
    """SHA-256 of the manifest without its own `manifest_sha256` field, as canonical JSON
    (sorted keys, no spaces): an edit to any field that stays valid JSON changes it."""
    body = {k: v for k, v in m.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()).hexdigest()


def _files(root: str, parts: dict) -> list[str]:
    """Every file of the parts, relative to the bundle (a checkpoint's two files)."""
    out = []
    for rel in parts.values():
        if rel is None:
            continue
        p = os.path.join(root, rel)
        if os.path.isdir(p):
            out += [os.path.join(rel, f) for f in ("config.json", "model.safetensors")]
        else:
            out.append(rel)
    return sorted(out)


def bundle_action(probe, out_dir: str | os.PathLike, weights: bool = True):
    """A trigger's `on_fire`: on each fire, `write` a bundle of the fired batch under
    `out_dir/fire-N` (the batch's token ids must be fed with it: `feed(..., samples=)`);
    `fire.results` gets the bundle's path and its finding."""
    base = os.fspath(out_dir)
    os.makedirs(base, exist_ok=True)

    def act(fire) -> None:
        n = len([d for d in os.listdir(base) if d.startswith("fire-")]) + 1
        b = write(probe, os.path.join(base, f"fire-{n}"), fire.samples, weights=weights, fire=fire)
        fire.results["bundle"] = b.path
        fire.results.update({k: v for k, v in b.finding.items() if k != "weights_summary"})

    return act


# -- reading ----------------------------------------------------------------------------------------
_HEX64 = re.compile(r"[0-9a-f]{64}")


class _Check:
    """Type checks of a manifest's fields, each failure one InputError naming the bundle and
    the field (`finding.threshold`), the value shown escaped and clipped."""

    def __init__(self, where: str):
        self.where = where

    def fail(self, field: str, why: str):
        raise InputError(f"{self.where}: manifest.json: {field} {why}")

    def obj(self, v, field: str, optional: bool = False) -> dict:
        if v is None and optional:
            return {}
        if not isinstance(v, dict):
            self.fail(field, f"must be an object, not {_shown(v)}")
        return v

    def string(self, v, field: str, optional: bool = False) -> str | None:
        if v is None and optional:
            return None
        if not isinstance(v, str):
            self.fail(field, f"must be a string, not {_shown(v)}")
        if "\x00" in v:
            self.fail(field, "holds a NUL character")
        return v

    def number(self, v, field: str, optional: bool = False, positive: bool = False) -> float | None:
        """A finite number (a boolean is not one); `positive`: above 0."""
        if v is None and optional:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not _finite(v):
            self.fail(field, f"must be a finite number, not {_shown(v)}")
        if positive and not v > 0:
            self.fail(field, f"must be above 0, not {_shown(v)}")
        return float(v)

    def integer(self, v, field: str) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            self.fail(field, f"must be a whole number >= 0, not {_shown(v)}")
        return v

    def boolean(self, v, field: str) -> bool:
        if not isinstance(v, bool):
            self.fail(field, f"must be true or false, not {_shown(v)}")
        return v

    def dtype(self, v, field: str) -> str:
        if not isinstance(v, str) or v not in DTYPES:
            self.fail(field, f"must be one of {', '.join(DTYPES)}, not {_shown(v)}")
        return v

    def relpath(self, root: str, v, field: str) -> str:
        """A path inside the bundle: relative, no '..', no NUL, and (links followed) inside it."""
        rel = self.string(v, field)
        if not rel or os.path.isabs(rel) or ".." in re.split(r"[\\/]", rel):
            self.fail(field, f"names a file outside the bundle ({_shown(rel)})")
        top = os.path.realpath(root)
        real = os.path.realpath(os.path.join(root, rel))
        if os.path.commonpath([top, real]) != top or real == top:
            self.fail(field, f"names a file outside the bundle ({_shown(rel)}, a link to {path_text(real)})")
        return rel


def _finite(v: int | float) -> bool:
    """A number a float holds, finite (an integer of 400 digits is not one)."""
    try:
        return math.isfinite(float(v))
    except OverflowError:
        return False


def _shown(v) -> str:
    return printable(clip(json.dumps(v) if isinstance(v, (dict, list, str, bool, type(None))) else repr(v), 80))


def _check_manifest(path: str, m: dict, where: str) -> None:
    """Every field `replay_inputs`, `reproduced` and the report read, typed (see `load`)."""
    c = _Check(where)
    for key in ("tool_version", "created", "replay"):
        c.string(m.get(key), key, optional=True)
    model = c.obj(m.get("model"), "model", optional=True)
    c.string(model.get("arch"), "model.arch", optional=True)
    c.string(model.get("model_type"), "model.model_type", optional=True)
    c.dtype(c.obj(m.get("reference"), "reference").get("dtype"), "reference.dtype")
    engine = c.obj(m.get("engine"), "engine")
    c.dtype(engine.get("dtype"), "engine.dtype")
    c.obj(engine.get("live_settings"), "engine.live_settings", optional=True)
    faults = engine.get("faults") or []
    if not isinstance(faults, list):
        c.fail("engine.faults", f"must be a list of fault specs, not {_shown(faults)}")
    for i, spec in enumerate(faults):  # planted again in the replay's engines: each a fault numbisect knows
        c.string(spec, f"engine.faults[{i}]")
        try:
            parse_fault(spec)
        except InputError as e:
            c.fail(f"engine.faults[{i}]", e.message)
    trace = c.obj(m.get("trace"), "trace", optional=True)
    for key in ("samples", "completion_tokens"):
        if key in trace:
            c.integer(trace[key], f"trace.{key}")
    if m.get("fire") is not None:
        fire = c.obj(m["fire"], "fire")
        c.number(fire.get("value"), "fire.value")
        c.number(fire.get("threshold"), "fire.threshold", positive=True)
    f = c.obj(m.get("finding"), "finding")
    if "weights_ok" in f:
        c.boolean(f["weights_ok"], "finding.weights_ok")
    for unit, status in c.obj(f.get("weights_differ"), "finding.weights_differ", optional=True).items():
        c.string(status, f"finding.weights_differ[{_shown(unit)}]")
    summary = f.get("weights_summary", [])
    if not isinstance(summary, list):
        c.fail("finding.weights_summary", f"must be a list of strings, not {_shown(summary)}")
    for i, line in enumerate(summary):
        c.string(line, f"finding.weights_summary[{i}]")
    c.string(f.get("compare_refused"), "finding.compare_refused", optional=True)
    c.number(f.get("threshold"), "finding.threshold", optional=True, positive=True)
    c.number(f.get("k3_mean"), "finding.k3_mean", optional=True)
    if "first_divergence" in f or "verdict" in f:
        if f.get("verdict") not in ("aligned", "diverged"):
            c.fail("finding.verdict", f"must be \"aligned\" or \"diverged\", not {_shown(f.get('verdict'))}")
        fd = c.obj(f.get("first_divergence"), "finding.first_divergence")
        for key, v in fd.items():
            c.string(v, f"finding.first_divergence.{printable(clip(key, 40))}", optional=True)
    parts = c.obj(m.get("parts"), "parts")
    for key, rel in parts.items():
        if key not in PARTS:
            c.fail(f"parts.{printable(clip(key, 40))}", "is no part a bundle has")
        if rel is not None:
            c.relpath(path, rel, f"parts.{key}")
    sha = c.obj(m.get("sha256"), "sha256")
    for rel, hexdigest in sha.items():
        c.relpath(path, rel, f"sha256[{_shown(rel)}]")
        if not isinstance(hexdigest, str) or not _HEX64.fullmatch(hexdigest):
            c.fail(f"sha256[{_shown(rel)}]", f"must be 64 hexadecimal digits, not {_shown(hexdigest)}")
    for key, rel in parts.items():  # every file a part holds is checksummed
        if rel is None:
            continue
        files = [os.path.join(rel, n) for n in CHECKPOINT_FILES] if PARTS[key] == "dir" else [rel]
        for name in files:
            if os.path.normpath(name) not in {os.path.normpath(r) for r in sha}:
                c.fail(f"parts.{key}", f"names {_shown(name)}, which the sha256 table does not cover")


def load(path: str | os.PathLike) -> Bundle:
    """A bundle read back and checked, every problem one InputError line, before anything
    loads: its manifest read as every structured input is (`safeio.read_input`: a regular
    file, at most 64 MB, nesting bounded, no NaN), its own checksum (`manifest_sha256`) the
    manifest's, every field typed (`_check_manifest`: dtypes numbisect knows, thresholds
    finite and above 0, booleans and numbers apart, paths inside the bundle without NUL,
    the finding's fields), each part it names present as a regular file (a FIFO or a device
    refused) and each file's SHA-256 the manifest's (a truncated copy is refused)."""
    path = os.fspath(path)
    where = f"bundle {path_text(path)}"
    if "\x00" in path:
        raise InputError(f"{where}: the path holds a NUL character")
    if not os.path.isdir(path):
        raise InputError(f"{where}: not a directory (a replay bundle is the directory a trigger wrote)")
    mpath = os.path.join(path, "manifest.json")
    if not os.path.lexists(mpath):
        raise InputError(f"{where}: no manifest.json (not a replay bundle)")
    top, real = os.path.realpath(path), os.path.realpath(mpath)
    if os.path.dirname(real) != top:
        raise InputError(f"{where}: manifest.json is a link out of the bundle (to {path_text(real)})")
    try:
        m = read_input(mpath, "bundle manifest", limit=MANIFEST_LIMIT)
    except InputError as e:
        raise InputError(f"{where}: manifest.json refused ({e.message})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise InputError(f"{where}: manifest.json is not a replay bundle's (format {FORMAT!r})")
    if m.get("version") != VERSION:
        older = " (an older numbisect's: write the bundle again)" if m.get("version") == 1 else ""
        raise InputError(f"{where}: bundle version {_shown(m.get('version'))}{older}; this numbisect reads version {VERSION}")
    if not isinstance(m.get("parts"), dict) or not isinstance(m.get("sha256"), dict):
        raise InputError(f"{where}: manifest.json has no parts or sha256 table")
    for rel in [*m["sha256"], *(v for v in m["parts"].values() if v is not None)]:
        if not isinstance(rel, str) or os.path.isabs(rel) or ".." in re.split(r"[\\/]", rel):
            raise InputError(f"{where}: manifest names a file outside the bundle ({_shown(rel)})")
    if m.get("manifest_sha256") != manifest_digest(m):
        raise InputError(f"{where}: manifest.json was changed after the bundle was written (its manifest_sha256 differs)")
    _check_manifest(path, m, where)
    for rel, want in m["sha256"].items():
        p = os.path.join(path, rel)
        if not os.path.lexists(p):
            raise InputError(f"{where}: {path_text(rel)} is missing")
        check_input(p, f"{where}: part")  # a FIFO would hang the checksum, /dev/zero never end it
        if file_sha256(p) != want:
            raise InputError(f"{where}: {path_text(rel)} is not the file the bundle was written with (SHA-256 differs)")
    _check_settings_part(Bundle(path, m), where)
    return Bundle(path, m)


def _check_settings_part(b: Bundle, where: str) -> None:
    """engine.json holds every engine setting the replay needs (an engine measured in
    settings the bundle does not say is not replayed in vLLM's defaults)."""
    p = b.part("engine_settings")
    if p is None:
        return
    settings = read_input(p, f"{where}: engine.json")
    if not isinstance(settings, dict):
        raise InputError(f"{where}: engine.json must be an object")
    missing = [k for k in SETTINGS_KEYS if k not in settings]
    if missing:
        raise InputError(f"{where}: engine.json does not record {', '.join(missing)} (the engine's settings are needed to replay it)")
    E.check_settings(settings, f"{where}: engine.json")


def replay_inputs(b: Bundle) -> dict:
    """What `bisect compare` runs a replay with: ref, engine (specs), trace, ref_dtype,
    engine_dtype, engine_config (path), threshold. Refuses a bundle written without weights."""
    ref, eng = b.part("reference"), b.part("engine")
    if ref is None or eng is None:
        raise InputError(f"bundle {path_text(b.path)}: it holds the weights' digests only (written with weights=False); "
                         "replay needs reference/ and engine/")
    if b.part("trace") is None or b.part("engine_settings") is None:
        raise InputError(f"bundle {path_text(b.path)}: the manifest names no trace or engine settings")
    return {"ref": f"{REFERENCE_KIND}:{ref}", "engine": f"{KIND}:{eng}", "trace": b.part("trace"),
            "ref_dtype": b.manifest["reference"]["dtype"], "engine_dtype": b.manifest["engine"]["dtype"],
            "engine_config": b.part("engine_settings"),
            # the live comparison's threshold; without one (a compiled engine), the trigger's: the fired batch was judged at it
            "threshold": b.finding.get("threshold", (b.manifest.get("fire") or {}).get("threshold")),
            "engine_faults": list(b.manifest["engine"].get("faults") or [])}  # checked by _check_manifest


def reproduced(b: Bundle, report: dict) -> tuple[bool, str]:
    """Whether a replay's report names what the bundle's finding named (verdict and first
    divergent unit), with one line saying so."""
    want = b.finding
    if "first_divergence" not in want:  # the live engine could not be hooked: match the trigger's figure
        fire, k3 = b.manifest.get("fire"), report["baseline"]["groups"]["completion"]["k3"]["mean"]
        fd = report["first_divergence"].get("above_tol")
        if not fire:
            return True, f"replay: first divergence above tolerance {fd}; the bundle recorded no comparison to match"
        same = (report["verdict"] == "diverged") == (fire["value"] > fire["threshold"])
        return same, (f"replay: k3 {k3:.3g}, first divergence above tolerance {fd} (the fired batch: k3 {fire['value']:.3g} "
                      f"over threshold {fire['threshold']:.3g}; no live comparison): {'reproduced' if same else 'NOT reproduced'}")
    got_fd, want_fd = report["first_divergence"], want["first_divergence"]
    same = report["verdict"] == want["verdict"] and got_fd == want_fd
    line = (f"replay: verdict {report['verdict']}, first divergence above tolerance {got_fd.get('above_tol')} "
            f"(bundle: {want['verdict']}, {want_fd.get('above_tol')}): {'reproduced' if same else 'NOT reproduced'}")
    return same, line


__all__ = ["Bundle", "write", "write_manifest", "write_reference_digests", "bundle_action", "load", "replay_inputs", "reproduced", "write_trace", "engine_settings"]

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
import json
import os
from dataclasses import dataclass

import torch

from numbisect import __version__
from numbisect.common.errors import InputError
from numbisect.common.safeio import file_sha256
from numbisect.live.probe import LiveReport, random_samples, samples_trace
from numbisect.live.weights import digest, write_checkpoint
from numbisect.model import engine_config as E
from numbisect.model.trace import BUILTIN_GROUPS
from numbisect.pipeline import comparison as P
from numbisect.pipeline.provenance import new_report
from numbisect.report.document import write_json_atomic

FORMAT = "numbisect-replay-bundle"
VERSION = 1
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
    _json(os.path.join(out, "reference-digests.json"), {
        "algorithm": "blake2b, 16 bytes, of the tensor's bytes (numbisect.live.weights.digest)",
        "dtype": str(ref_dtype).removeprefix("torch."), "tensors": {n: digest(t) for n, t in sorted(ref.items())},
        "engine_dtype": str(eng_dtype).removeprefix("torch."),
        "in_engine_dtype": {n: digest(t.to(eng_dtype)) for n, t in sorted(ref.items())},
    })
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


    manifest = {
        "format": FORMAT, "version": VERSION, "tool_version": __version__,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "model": {"arch": probe.ref.arch.name, "model_type": getattr(probe.ref.config, "model_type", None)},
        "reference": {"dtype": str(ref_dtype).removeprefix("torch.")},
        "engine": {"dtype": str(eng_dtype).removeprefix("torch."), "live_settings": dict(probe.engine_settings)},
        "trace": {"samples": len(trace.samples), "completion_tokens": sum(len(s.completion_ids) for s in trace.samples)},
        "fire": fire.to_dict() if fire is not None else None,
        "finding": finding,
        "parts": parts,
        "sha256": {rel: file_sha256(os.path.join(out, rel)) for rel in _files(out, parts)},
        "replay": f"bisect replay {out}",
    }
    _json(os.path.join(out, "manifest.json"), manifest)
    return load(out)


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
def load(path: str | os.PathLike) -> Bundle:
    """A bundle read back and checked: its manifest, each part it names present, and each
    file's SHA-256 the manifest's (a truncated copy is refused). One InputError line each."""
    path = os.fspath(path)
    where = f"bundle {path}"
    if not os.path.isdir(path):
        raise InputError(f"{where}: not a directory (a replay bundle is the directory a trigger wrote)")
    mpath = os.path.join(path, "manifest.json")
    try:
        with open(mpath, encoding="utf-8") as f:
            m = json.load(f)
    except FileNotFoundError:
        raise InputError(f"{where}: no manifest.json (not a replay bundle)") from None
    except (OSError, ValueError) as e:
        raise InputError(f"{where}: manifest.json is not readable JSON ({str(e).splitlines()[0]})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise InputError(f"{where}: manifest.json is not a replay bundle's (format {FORMAT!r})")
    if m.get("version") != VERSION:
        raise InputError(f"{where}: bundle version {m.get('version')!r}; this numbisect reads version {VERSION}")
    parts = m.get("parts")
    if not isinstance(parts, dict) or not isinstance(m.get("sha256"), dict):
        raise InputError(f"{where}: manifest.json has no parts or sha256 table")
    for rel in [*m["sha256"], *(v for v in parts.values() if v is not None)]:
        if not isinstance(rel, str) or os.path.isabs(rel) or ".." in rel.split(os.sep):
            raise InputError(f"{where}: manifest names a file outside the bundle ({rel!r})")
    for rel, want in m["sha256"].items():
        p = os.path.join(path, rel)
        if not os.path.isfile(p):
            raise InputError(f"{where}: {rel} is missing")
        if file_sha256(p) != want:
            raise InputError(f"{where}: {rel} is not the file the bundle was written with (SHA-256 differs)")
    return Bundle(path, m)


def replay_inputs(b: Bundle) -> dict:
    """What `bisect compare` runs a replay with: ref, engine (specs), trace, ref_dtype,
    engine_dtype, engine_config (path), threshold. Refuses a bundle written without weights."""
    ref, eng = b.part("reference"), b.part("engine")
    if ref is None or eng is None:
        raise InputError(f"bundle {b.path}: it holds the weights' digests only (written with weights=False); "
                         "replay needs reference/ and engine/")
    if b.part("trace") is None or b.part("engine_settings") is None:
        raise InputError(f"bundle {b.path}: the manifest names no trace or engine settings")
    return {"ref": f"hf:{ref}", "engine": f"vllm:{eng}", "trace": b.part("trace"),
            "ref_dtype": b.manifest["reference"]["dtype"], "engine_dtype": b.manifest["engine"]["dtype"],
            "engine_config": b.part("engine_settings"), "threshold": b.finding.get("threshold")}


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


__all__ = ["Bundle", "write", "bundle_action", "load", "replay_inputs", "reproduced", "write_trace", "engine_settings"]

"""`bisect run`: swap trials and the culprit search on a session.

1. Compare the unswapped engine with the reference (baseline, per-unit propagated and
   local error; the local ranking orders the search's guesses).
2. Self-check: with every unit swapped the engine must reproduce the reference
   (mean k3 <= 1e-7 when the dtypes match); otherwise no swap can localise anything.
3. Either `--swap KIND[,KIND]` (baseline trial, then one trial with those kinds swapped)
   or the search (`numbisect.search`), each trial appended to a JSONL log as it ends.
4. The report body gains `self_check`, `trials`, `culprits`, `search` (and `swap`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from numbisect import decode as D
from numbisect import search as S
from numbisect.errors import BackendError, ExitCode, InputError
from numbisect.render import fmt
from numbisect.swap import units_of_kinds
from numbisect.units import unit_graph

LOG_VERSION = 1


class SelfCheckFailed(BackendError):
    """Swapping every unit did not reproduce the reference."""


def check_swaps(session, progress=lambda m: None) -> dict:
    progress("self-check: every unit swapped must reproduce the reference")
    sc = session.self_check()
    if not sc["passed"]:
        bad = [c for c in sc["checks"] if not c["passed"]][0]
        raise SelfCheckFailed(
            f"swap self-check failed: with every unit swapped as {bad['swapped']} ({', '.join(bad['kinds'])}) mean k3 "
            f"against the reference is {fmt(bad['k3_mean'])} (must be <= {fmt(sc['tolerance'])}); a swap that does "
            "not reproduce the reference cannot localise anything"
        )
    return sc


# -- trial log ---------------------------------------------------------------------------
def log_header(session) -> dict:
    return {
        "numbisect_trial_log": LOG_VERSION,
        "digests": session.digests,
        "dtypes": [session.spec.ref_dtype, session.spec.engine_dtype],
        "engine": session.spec.engine.partition(":")[0],
        "faults": list(session.spec.faults),
        "settings": session.settings.to_dict(),
        "engine_mode": session.mode,
    }


def read_log(path: str, session) -> list[S.Trial]:
    """The trials of an earlier run on the same inputs; InputError if it is not one."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise InputError(f"cannot read resume log {path}: {e.strerror or e}") from None
    try:
        header = json.loads(lines[0]) if lines else None
    except ValueError:
        header = None
    if not isinstance(header, dict) or header.get("numbisect_trial_log") != LOG_VERSION:
        raise InputError(f"{path}: not a numbisect trial log")
    want = log_header(session)
    for key in ("digests", "dtypes", "engine", "faults", "settings", "engine_mode"):
        if header.get(key, "prefill" if key == "engine_mode" else None) != want[key]:
            raise InputError(f"{path}: resume log was made on other inputs ({key} differ); start a new run instead")
    trials = []
    for i, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        try:
            trials.append(S.Trial.from_dict(json.loads(line)))
        except (ValueError, KeyError, TypeError):
            if i == len(lines):  # a last line cut short by the interruption
                break
            raise InputError(f"{path}:{i}: corrupt trial record") from None
    return trials


class TrialLog:
    """Append-only JSONL: a header, then one line per finished trial, flushed each time."""

    def __init__(self, path: str | None, session, append: bool):
        self.path = path
        self._fh = None
        if path:
            exists = append and os.path.exists(path)
            self._fh = open(path, "a" if exists else "w")
            if not exists:
                self._write(log_header(session))

    def _write(self, obj) -> None:
        self._fh.write(json.dumps(obj) + "\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def __call__(self, trial: S.Trial) -> None:
        if self._fh is not None:
            self._write(trial.to_dict())

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


# -- the run -------------------------------------------------------------------------------
def run(session, *, swap: list[str] | None, strategy: str, max_trials: int | None, log: str | None,
        resume: str | None, progress=lambda m: None, on_trial=None, whatif: bool = True) -> tuple[dict, int]:
    """Everything `bisect run` does; returns the report body and the exit code."""
    if session.engine is None:
        raise InputError("bisect run needs an engine that runs (hf: or vllm:), not rollout")
    kinds = None
    if swap:
        kinds = [k for part in swap for k in part.split(",") if k]
        D.check_swappable(session.engine, units_of_kinds(session.engine, kinds), session.mode)  # before any work
    if strategy not in S.STRATEGIES:
        raise InputError(f"unknown strategy {strategy!r}; choose one of {', '.join(S.STRATEGIES)}")
    resumed = read_log(resume, session) if resume else []
    body = session.compare(local=True)
    body["self_check"] = check_swaps(session, progress)
    logger = TrialLog(log or resume, session, append=bool(resume))

    def record(trial):
        logger(trial)
        progress(f"trial {trial.index}: {len(trial.swapped)} swapped, {session.settings.metric} {fmt(trial.value)}")
        if on_trial is not None:
            on_trial(trial)

    runner = S.TrialRunner(session.trial, max_trials=max_trials, on_trial=record, resumed=resumed)
    try:
        if kinds:
            code = _swap_run(session, kinds, runner, body)
        else:
            code = _search_run(session, strategy, runner, body)
    finally:
        logger.close()
    body["trials"] = [t.to_dict() for t in runner.trials]
    body["search"]["prefix_reuse"] = prefix_summary(session, runner.trials)
    if whatif and body.get("culprits") and not getattr(session.engine, "remote", False):  # not under TP yet
        from numbisect.whatif import run_whatifs

        run_whatifs(session, body["culprits"], body["search"].get("baseline"), progress)
    return body, code


def prefix_summary(session, trials) -> dict:
    """`search.prefix_reuse` in the report: whether trials replayed leading layers recorded
    by the baseline or an earlier trial (`numbisect.prefix`), and how many."""
    new = [t for t in trials if not t.resumed]
    replayed = [t.metrics.get("prefix_layers") or 0 for t in new]
    cache = session.prefix
    out = {
        "enabled": bool(session.prefix_reuse),
        "trials_replayed": sum(1 for r in replayed if r),
        "layers_replayed": sum(replayed),
        "layers": sum(1 for u in session.engine.units if u.kind == "layer"),
    }
    # under tensor parallelism the recordings live in the workers, bounded by count only
    if session.prefix_reuse and cache.max_bytes is not None and not getattr(session.engine, "remote", False):
        out.update(budget_mb=round(cache.max_bytes / 2**20, 3), peak_mb=round(cache.peak_bytes / 2**20, 3),
                   dropped=cache.dropped)
        if cache.disabled:
            out["disabled"] = cache.disabled
    return out


def _swap_run(session, kinds: list[str], runner: S.TrialRunner, body: dict) -> int:
    names = units_of_kinds(session.engine, kinds)
    base = runner.run((), "baseline")
    after = runner.run(names, "swap")
    th, metric = session.settings.threshold, session.settings.metric
    fixed = after.value <= th
    where = ", ".join(kinds)
    lines = [
        f"swapping {len(names)} {where} units: {metric} {fmt(base.value)} -> {fmt(after.value)}: "
        + (
            "already aligned before the swap"
            if base.value <= th
            else (f"the divergence is inside {where}" if fixed else f"the divergence is not (only) inside {where}")
        )
    ]
    for g, v in after.metrics["groups"].items():
        b = base.metrics["groups"][g]["k3_mean"]
        lines.append(f"  group {g:<12} k3 mean {fmt(b)} -> {fmt(v['k3_mean'])}")
    body["swap"] = {"kinds": kinds, "units": names, "before": base.value, "after": after.value, "fixed": fixed, "lines": lines}
    verdict = "aligned" if base.value <= th else ("culprits" if fixed else "unreachable")
    body["search"] = {
        "verdict": verdict,
        "strategy": "swap",
        "trials_used": runner.used,
        "stop_reason": lines[0],
        "baseline": base.value,
        "all_swapped": after.value,
        "threshold": th,
        "contributions": {},
    }
    body["culprits"] = []
    if base.value <= th:
        return ExitCode.ALIGNED
    return ExitCode.DIVERGED if fixed else ExitCode.NO_CULPRIT


def _search_run(session, strategy: str, runner: S.TrialRunner, body: dict) -> int:
    g = unit_graph(session.engine.units)
    cands = D.decode_candidates(S.default_candidates(g), session.engine, session.mode)
    result = S.search(
        g, cands, runner, session.settings.threshold, strategy,
        local_rank=body.get("local_ranking"), metric=session.settings.metric,
    )
    body["search"] = result.to_dict()
    body["search"].pop("culprits", None)
    left = D.not_swappable(session.engine.units, session.mode)
    if left and result.verdict == "unreachable":
        body["search"]["stop_reason"] += f" (decode mode: {len(left)} attention/layer units are not swappable and stay the engine's)"
    body["culprits"] = [c.to_dict() for c in result.culprits]
    if result.verdict == "aligned":
        return ExitCode.ALIGNED
    if result.verdict == "culprits":
        return ExitCode.DIVERGED
    return ExitCode.NO_CULPRIT

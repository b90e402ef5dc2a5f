"""`bisect run`: swap trials and the culprit search on a session.

1. Compare the unswapped engine with the reference (baseline, per-unit propagated and
   local error; the local ranking orders the search's guesses).
2. Self-check: with every unit swapped the engine must reproduce the reference
   (mean k3 <= 1e-7 when the dtypes match); otherwise no swap can localise anything,
   and the report is written all the same: `search.not_run` says why and names the config
   fields read outside every unit that differ (exit 3). A self-check or search step that
   raises is recorded as `run_error`, with the trials that ended: nothing finished is lost.
3. Either `--swap KIND[,KIND]` (baseline trial, then one trial with those kinds swapped)
   or the search (`numbisect.search.search`), each trial appended to a JSONL log as it ends.
4. The report body gains `self_check`, `trials`, `culprits`, `search` (and `swap`):
   `RunResult` holds them, `run_body` assembles the body from it.

`run` does this on a session (numbisect.live.run hands it one over live objects);
`run_report` is `bisect run` whole: the session `Session.open` makes from the
directories, `run`, the indexer replay what-if if asked, the report.
"""

from __future__ import annotations

import fcntl
import json
import os
import stat
import traceback
from dataclasses import dataclass, field

from numbisect.commands.compare import indexer_replay
from numbisect.common.errors import BackendError, ExitCode, InputError, NumbisectError
from numbisect.common.formatting import fmt
from numbisect.common.safeio import check_input, loads_json, read_bytes, same_file
from numbisect.common.textsafe import printable
from numbisect.model.units import unit_graph
from numbisect.patching.swap import units_of_kinds
from numbisect.pipeline import decode as D
from numbisect.pipeline import whatif as W
from numbisect.pipeline.measure import Settings
from numbisect.pipeline.provenance import new_report
from numbisect.report import findings as F
from numbisect.search import search as S
from numbisect.search.kinds import KIND_WIDE
from numbisect.session.environment import conditions, differences
from numbisect.session.session import Session, Spec


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
# Version 2 adds `conditions` (threads, options, versions): a log made under other
# conditions is refused on resume, since its trial values would not be this run's.
LOG_VERSION = 2


def log_header(session) -> dict:
    return {
        "numbisect_trial_log": LOG_VERSION,
        "digests": session.digests,
        "dtypes": [session.spec.ref_dtype, session.spec.engine_dtype],
        "engine": session.spec.engine.partition(":")[0],
        "faults": list(session.spec.faults),
        "settings": session.settings.to_dict(),
        "engine_mode": session.mode,
        "conditions": conditions(session),
    }


def _check_header(path: str, header, session) -> None:
    if not isinstance(header, dict) or "numbisect_trial_log" not in header:
        raise InputError(f"{path}: not a numbisect trial log")
    if header["numbisect_trial_log"] != LOG_VERSION:
        raise InputError(f"{path}: trial log version {header['numbisect_trial_log']!r} cannot be resumed by this numbisect "
                         f"(it writes version {LOG_VERSION}, which records the run's conditions); start a new run instead")
    want = log_header(session)
    for key in ("digests", "dtypes", "engine", "faults", "settings", "engine_mode"):
        if header.get(key, "prefill" if key == "engine_mode" else None) != want[key]:
            then = header.get(key)
            if key == "digests" and isinstance(then, dict) and {k: v for k, v in then.items() if k != "samples"} == {
                    k: v for k, v in want[key].items() if k != "samples"}:
                if "samples" not in then:
                    raise InputError(f"{path}: resume log does not record which samples of the trace it was made on "
                                     "(an older numbisect); start a new run instead")
                raise InputError(f"{path}: resume log was made on other samples of the same trace (--trace-fields or "
                                 "--trace-format select others); start a new run instead")
            raise InputError(f"{path}: resume log was made on other inputs ({key} differ); start a new run instead")
    then = header.get("conditions")
    diff = differences(then if isinstance(then, dict) else {}, want["conditions"])
    if diff:
        more = f" (+{len(diff) - 1} more)" if len(diff) > 1 else ""
        logged = then.get("threads") if isinstance(then, dict) else None
        hint = f" (rerun with --threads {logged})" if diff[0].startswith("threads:") and isinstance(logged, int) else ""
        raise InputError(f"{path}: resume log was made under other conditions, so its trial values would not be this "
                         f"run's: {diff[0]}{more}{hint}; start a new run instead")


def _salvage(line: str) -> dict | None:
    """A trial record in `line`, also when an older numbisect appended it onto the
    fragment of a record cut by a crash (the longest parseable `{...}` suffix)."""
    dec = json.JSONDecoder()
    for i, ch in enumerate(line):
        if ch != "{":
            continue
        try:
            obj, end = dec.raw_decode(line, i)
        except ValueError:
            continue
        if end == len(line.rstrip()) and isinstance(obj, dict) and "swapped" in obj and "value" in obj:
            return obj
    return None


def _parse(path: str, data: bytes, session) -> tuple[list[S.Trial], int, bool]:
    """(trials, bytes of the log to keep, whether a newline must be added after them).

    A last line cut short by an interruption is dropped (the log is cut back to the end
    of the line before it); a complete last record without its newline is kept; a line
    damaged elsewhere (an older numbisect appended a record onto a cut one) keeps the
    record it still holds."""
    raw = data.split(b"\n")  # offsets in bytes: the file is cut back by them
    lines = [b.decode("utf-8", errors="replace") for b in raw]
    if not lines[0].strip():
        raise InputError(f"{path}: not a numbisect trial log (it is empty)")
    try:
        header = loads_json(lines[0], f"{path}:1")
    except InputError:
        header = None
    _check_header(path, header, session)
    if len(lines) == 1:  # a header cut before its newline
        return [], len(data), True
    trials, keep, newline = [], len(raw[0]) + 1, False
    for i, line in enumerate(lines[1:], start=2):
        last = i == len(lines)  # the text after the last newline: "" for a complete log
        size = len(raw[i - 1]) + (0 if last else 1)
        rec = None
        if line.strip():
            try:
                rec = loads_json(line, f"{path}:{i}")
            except InputError:
                pass
            if not (isinstance(rec, dict) and "swapped" in rec and "value" in rec):
                rec = None if last else _salvage(line)
            if rec is None and last:
                break  # cut short by the interruption
            if rec is None:
                raise InputError(f"{path}:{i}: corrupt trial record (not written by numbisect)")
            try:
                trials.append(S.Trial.from_dict(rec))
            except (ValueError, KeyError, TypeError):
                raise InputError(f"{path}:{i}: corrupt trial record") from None
            newline = last
        keep += size
    return trials, keep, newline


def read_log(path: str, session) -> list[S.Trial]:
    """The trials of an earlier run on the same inputs and conditions; InputError if it is not one."""
    trials, _, _ = _parse(path, read_bytes(path, "resume log"), session)
    return trials


def holds_trials(data: bytes) -> bool:
    """Whether a trial log's bytes hold anything after its header line."""
    return bool(data.partition(b"\n")[2].strip())


def not_a_log(data: bytes) -> bool:
    """Whether a file's bytes are neither empty nor a numbisect trial log (a first line
    that is a trial log header): such a file is never truncated by --log."""
    if not data.strip():
        return False
    try:
        header = json.loads(data.partition(b"\n")[0])
    except (ValueError, RecursionError):
        return True
    return not (isinstance(header, dict) and "numbisect_trial_log" in header)


def not_a_log_error(path: str) -> InputError:
    return InputError(f"--log {printable(path)} exists and is not a numbisect trial log; it is never overwritten "
                      "(choose another path)")


def log_in_use(path: str, resume: str | None) -> InputError:
    """The refusal of a --log that already holds trials: it is never overwritten."""
    hint = f"continue it with --resume {path}" if not resume else "give a new --log, or the --resume log itself"
    return InputError(f"--log {path} already holds trials; {hint} (a trial log is never overwritten)")


class TrialLog:
    """Append-only JSONL: one header, then one line per finished trial, flushed and synced.

    - `--log L` alone: L must be new (or empty, or a header alone); an existing log is
      never truncated, and a file that is not a trial log is never touched.
    - `--resume L` (and `--log L`): L is locked, a record cut by a crash is cut off, and
      new trials are appended after the resumed ones.
    - `--resume A --log B`: B (new or empty) gets the header, A's trials, then the new
      ones: B alone resumes the run later; A is left as it was.
    The file is locked (flock) while the run holds it: a second run on it is refused.
    """

    def __init__(self, path: str | None, session, resume: str | None = None):
        self.path = path or resume
        self.resumed: list[S.Trial] = []
        self._fd = None
        if not self.path:
            return
        if resume:
            check_input(resume, "resume log")
        same = bool(resume) and (path is None or (os.path.exists(path) and same_file(path, resume)))
        if resume and not same:  # read A, then write B
            self.resumed = read_log(resume, session)
        fd = self._open_locked(self.path, create=not same)
        try:
            if same:
                size = os.fstat(fd).st_size
                data = os.pread(fd, size, 0)
                self.resumed, keep, newline = _parse(self.path, data, session)
                if keep < size:  # a record cut by a crash: the next one must not land on its fragment
                    os.ftruncate(fd, keep)
                os.lseek(fd, 0, os.SEEK_END)
                self._fd = fd
                if newline:
                    self._write_raw(b"\n")
            else:
                size = os.fstat(fd).st_size
                data = os.pread(fd, size, 0) if size else b""
                if not_a_log(data):  # checked again here, under the lock: only a log is ever rewritten
                    raise not_a_log_error(self.path)
                if holds_trials(data):
                    raise log_in_use(self.path, resume)
                os.ftruncate(fd, 0)  # empty, or a header alone (a run that ended before its first trial)
                self._fd = fd
                self._write(log_header(session))
                for t in self.resumed:
                    self._write(t.to_dict())
        except BaseException:
            os.close(fd)
            self._fd = None
            raise
        self._fd = fd

    @staticmethod
    def _open_locked(path: str, create: bool) -> int:
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        try:
            fd = os.open(path, flags, 0o666)
        except OSError as e:
            raise InputError(f"cannot open trial log {path}: {e.strerror or e}") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise InputError(f"trial log {path} is not a regular file")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise InputError(f"trial log {path} is in use by another bisect run; wait for it, or choose another --log") from None
        return fd

    def _write(self, obj) -> None:
        self._write_raw((json.dumps(obj) + "\n").encode())

    def _write_raw(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
        os.fsync(self._fd)

    def __call__(self, trial: S.Trial) -> None:
        if self._fd is not None:
            self._write(trial.to_dict())

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the lock
            self._fd = None


# -- the run -------------------------------------------------------------------------------
@dataclass
class RunResult:
    """What `bisect run` found, one field per section it adds to the comparison's body
    (`run_body` assembles the report's body from it)."""

    compared: dict  # the comparison's report body (`Session.compare`)
    self_check: dict  # every unit swapped must reproduce the reference
    search: dict = field(default_factory=dict)  # verdict, strategy, trials used, stop reason, prefix reuse
    culprits: list[dict] = field(default_factory=list)  # each with its what-ifs (`precision`) once they ran
    trials: list[dict] = field(default_factory=list)  # every trial, resumed ones included
    swap: dict | None = None  # --swap KIND: the one swap trial's summary
    post_search_errors: list[dict] = field(default_factory=list)  # steps after the search that failed
    run_error: dict | None = None  # the step (self-check, search) that failed; what finished before it is kept


def run_body(r: RunResult) -> dict:
    """The report's body of a run: the comparison's, then the run's sections."""
    body = dict(r.compared)
    if r.self_check is not None:  # None: the self-check itself failed (run_error)
        body["self_check"] = r.self_check
    if r.swap is not None:
        body["swap"] = r.swap
    body["search"] = r.search
    body["culprits"] = r.culprits
    body["trials"] = r.trials
    if r.post_search_errors:
        body["post_search_errors"] = r.post_search_errors
    if r.run_error is not None:
        body["run_error"] = r.run_error
    return body


def run_report(spec: Spec, settings: Settings, *, swap: list[str], strategy: str, max_trials: int | None, log: str | None,
               resume: str | None, whatif: bool, replay_indexer: bool = False, prefix_reuse: bool = True,
               prefix_cache_mb: float | None = None, argv: list[str], progress=lambda m: None) -> tuple[dict, int]:
    """`bisect run` on the directories `spec` names: `run` on the session `Session.open`
    makes, then (`replay_indexer`) the indexer replay what-if (numbisect.commands.compare,
    recorded in `post_search_errors` if it fails: the search's result stands); the report
    (kind "run", `argv` the command line it records) and the exit code. The backends the
    session opened are closed before it returns."""
    session = Session.open(spec, settings, progress=progress, prefix_reuse=prefix_reuse, prefix_cache_mb=prefix_cache_mb)
    try:
        body, code = run(session, swap=swap, strategy=strategy, max_trials=max_trials, log=log, resume=resume,
                         progress=progress, whatif=whatif)
        if replay_indexer:  # after the search: a failure is recorded, the search's result stands
            failed: list[dict] = []
            after_search(failed, "indexer_replay", None, progress, lambda: indexer_replay(session, body))
            if failed:
                body.setdefault("post_search_errors", []).extend(failed)
        return new_report("run", argv, session.inputs(), settings.to_dict(), body), code
    finally:
        session.close()


def run(session, *, swap: list[str] | None, strategy: str, max_trials: int | None, log: str | None,
        resume: str | None, progress=lambda m: None, on_trial=None, whatif: bool = True,
        on_baseline=None) -> tuple[dict, int]:
    """Everything `bisect run` does; returns the report body and the exit code.

    `on_baseline(body)`: called with the comparison's body as soon as it exists, before
    the self-check and the trials (the TUI shows it while the search runs)."""
    if session.engine is None:
        raise InputError("bisect run needs an engine that runs (hf: or vllm:), not rollout")
    kinds = None
    if swap:
        kinds = [k.strip() for part in swap for k in part.split(",") if k.strip()]
        if not kinds:
            raise InputError("--swap needs at least one unit kind (e.g. --swap moe or --swap attn,norm)")
        D.check_swappable(session.engine, units_of_kinds(session.engine, kinds), session.mode)  # before any work
    if strategy not in S.STRATEGIES:
        raise InputError(f"unknown strategy {strategy!r}; choose one of {', '.join(S.STRATEGIES)}")
    logger = TrialLog(log, session, resume)  # refused here, before any forward, if it cannot be resumed or written
    try:
        compared = session.compare(local=True)
        if on_baseline is not None:
            on_baseline(compared)
    except BaseException:
        logger.close()
        raise
    # From here on nothing finished is lost: a failed self-check, or a step that raises,
    # still gives the report (compare, checkpoint diff, first divergence, what ran).
    result = RunResult(compared, None)
    step = "self_check"
    runner = None
    try:
        progress("self-check: every unit swapped must reproduce the reference")
        result.self_check = session.self_check()
        if not result.self_check["passed"]:
            result.search = F.search_not_run(result.self_check, session.checkpoint_diff,
                                             compared["baseline"]["value"], session.settings.threshold, "swap" if kinds else strategy)
            progress(result.search["stop_reason"])
            return run_body(result), ExitCode.BACKEND
        step = "search"
        code, runner = _trials(session, kinds, strategy, max_trials, logger, progress, on_trial, result)
    except Exception as e:
        if os.environ.get("NUMBISECT_DEBUG"):
            traceback.print_exc()
        result.run_error = F.run_error(step, e)
        if runner is not None:
            result.trials = [t.to_dict() for t in runner.trials]
        if not result.search:
            result.search = {"verdict": "unreachable", "strategy": "swap" if kinds else strategy,
                             "trials_used": len(result.trials), "baseline": compared["baseline"]["value"],
                             "threshold": session.settings.threshold,
                             "stop_reason": (f"{e.message} (the run stopped in its {step.replace('_', '-')})"
                                             if isinstance(e, NumbisectError)  # the tool's own one-line error, as it was
                                             else f"the run stopped: its {step.replace('_', '-')} failed ({result.run_error['error']})")}
        progress(result.search["stop_reason"])
        return run_body(result), result.run_error["exit_code"]
    finally:
        logger.close()
    return _after_search(session, result, runner, code, whatif, progress)


def _trials(session, kinds, strategy, max_trials, logger, progress, on_trial, result):
    """The trials: `--swap KIND` or the search; (exit code, the TrialRunner)."""
    resumed = logger.resumed

    def record(trial):
        logger(trial)
        progress(f"trial {trial.index}: {len(trial.swapped)} swapped, {session.settings.metric} {fmt(trial.value)}")
        if on_trial is not None:
            on_trial(trial)

    runner = S.TrialRunner(session.trial, max_trials=max_trials, on_trial=record, resumed=resumed)
    try:
        if kinds:
            code = _swap_run(session, kinds, runner, result)
        else:
            code = _search_run(session, strategy, runner, result)
    except Exception:
        result.trials = [t.to_dict() for t in runner.trials]  # the trials that finished are kept
        raise
    return code, runner


def _after_search(session, result: RunResult, runner, code: int, whatif: bool, progress) -> tuple[dict, int]:
    """The exit code's last word, then the steps after the search (none may lose its result)."""
    compared = result.compared
    result.trials = [t.to_dict() for t in runner.trials]
    ue = session.user_engine
    if ue is not None and ue.child and compared.get("verdict") == "diverged" and code == ExitCode.ALIGNED:
        # the module search ran in the hookable configuration, which is aligned: the settings are the cause
        result.search["stop_reason"] += ("; your engine configuration diverges but the hookable one the search ran in does not: "
                                         "the divergence comes from its settings (bisect conditions --engine-config names them)")
        code = ExitCode.NO_CULPRIT
    code = F.with_checkpoint(code, session.checkpoint_diff)  # aligned tokens, differing checkpoints: 5
    # The search is done: nothing after it may lose its result (see `after_search`).
    failed = result.post_search_errors
    after_search(failed, "prefix_reuse", None, progress,
                 lambda: result.search.__setitem__("prefix_reuse", prefix_summary(session, runner.trials)))
    if whatif and result.culprits:
        names = [c["unit"] for c in result.culprits]
        for c in result.culprits:
            after_search(failed, "whatif", c["unit"], progress,
                         lambda c=c: W.run_whatifs(session.sides(), session.reference_tokens(), [c],
                                                   result.search.get("baseline"), progress, names=names))
    if whatif and isinstance(result.search.get("systematic"), dict):
        after_search(failed, "whatif", "systematic", progress,
                     lambda: W.run_kind_whatifs(session.sides(), session.reference_tokens(), result.search["systematic"],
                                                result.search.get("baseline"), progress))
    return run_body(result), code


def after_search(failed: list[dict], step: str, unit: str | None, progress, fn) -> None:
    """Run `fn`, a step after the search; an Exception it raises is recorded in `failed` as
    {step, unit, error} (one line) instead of ending the run: the search's result, its report
    and its exit code stand. NUMBISECT_DEBUG=1 prints the traceback on stderr too."""
    try:
        fn()
    except Exception as e:
        if os.environ.get("NUMBISECT_DEBUG"):
            traceback.print_exc()
        lines = str(e).strip().splitlines()
        error = f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
        failed.append({"step": step, "unit": unit, "error": error})
        progress(f"{step}{' for ' + unit if unit else ''} failed ({error}); the search's result stands")


def prefix_summary(session, trials) -> dict:
    """`search.prefix_reuse` in the report: whether trials replayed leading layers recorded
    by the baseline or an earlier trial (`numbisect.patching.prefix`), and how many."""
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


def _swap_run(session, kinds: list[str], runner: S.TrialRunner, result: RunResult) -> int:
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
    result.swap = {"kinds": kinds, "units": names, "before": base.value, "after": after.value, "fixed": fixed, "lines": lines}
    verdict = "aligned" if base.value <= th else ("culprits" if fixed else "unreachable")
    result.search = {
        "verdict": verdict,
        "strategy": "swap",
        "trials_used": runner.used,
        "stop_reason": lines[0],
        "baseline": base.value,
        "all_swapped": after.value,
        "threshold": th,
        "contributions": {},
    }
    result.culprits = []
    if base.value <= th:
        return ExitCode.ALIGNED
    return ExitCode.DIVERGED if fixed else ExitCode.NO_CULPRIT


def _search_run(session, strategy: str, runner: S.TrialRunner, result: RunResult) -> int:
    g = unit_graph(session.engine.units)
    cands = D.decode_candidates(S.default_candidates(g), session.engine, session.mode)
    diff = session.checkpoint_diff or {}
    found = S.search(
        g, cands, runner, session.settings.threshold, strategy,
        local_rank=result.compared.get("local_ranking"), metric=session.settings.metric,
        suspects=list(diff.get("units") or {}),
        suspect_kinds=[k for c in diff.get("config") or [] for k in c.get("read_by") or []],
        moved=F.moved_units(diff),
    )
    result.search = found.to_dict()
    result.search.pop("culprits", None)
    if found.verdict == "culprits":  # the narrative agrees with the checkpoint diff
        said = F.search_explained(diff, [c.to_dict() for c in found.culprits], found.systematic)
        if said:
            reason = result.search["stop_reason"]
            if said.startswith(F.EXCHANGED) and KIND_WIDE in reason:
                reason = reason.replace(f" ({KIND_WIDE})", "")
            result.search["stop_reason"] = f"{reason}; {said}"
            result.search["explained_by_diff"] = said
    left = D.not_swappable(session.engine.units, session.mode)
    if left and found.verdict == "unreachable":
        result.search["stop_reason"] += f" (decode mode: {len(left)} attention/layer units are not swappable and stay the engine's)"
    result.culprits = [c.to_dict() for c in found.culprits]
    if found.verdict == "aligned":
        return ExitCode.ALIGNED
    if found.verdict == "culprits":
        return ExitCode.DIVERGED
    return ExitCode.NO_CULPRIT

"""Verdicts that never hide a finding: the one rule every command judges tokens by, and what
a checkpoint difference adds to it.

1. `tokens_verdict(value, threshold)`: "aligned" when the judged metric is at or under the
   threshold, else "diverged" (the report's `verdict`, a closed set).
2. `checkpoint_differs(diff)`: the checkpoint diff (`numbisect.model.ckptdiff`, the report's
   `inputs.checkpoint_diff`) names weight or config differences. A difference is a finding at
   any threshold: a small model, a bf16 noise floor or a lenient threshold can keep its effect
   on the tokens under the threshold, and the diff is then the only signal.
3. `summary(diff)`: the report's `checkpoint_differs` section (units, tensors without a
   unit, config fields, one line); `mark(aligned, differs)` the verdict's words;
   `exit_code(verdict, diff)`: 0 only when the tokens are aligned AND nothing differs,
   `ExitCode.CHECKPOINT_DIFFERS` (5) when the tokens are aligned but the checkpoints differ.

Torch-free: renderers and `bisect report` read it.
"""

from __future__ import annotations

import shlex

from numbisect.common.errors import ExitCode
from numbisect.common.formatting import fmt


def tokens_verdict(value: float, threshold: float) -> str:
    """The token verdict: "aligned" when `value` <= `threshold`, else "diverged"."""
    return "aligned" if value <= threshold else "diverged"


def _units(diff: dict) -> dict:
    u = diff.get("units") if isinstance(diff, dict) else None
    return u if isinstance(u, dict) else {}


def _list(diff: dict, key: str) -> list:
    x = diff.get(key) if isinstance(diff, dict) else None
    return [e for e in x if isinstance(e, dict)] if isinstance(x, list) else []


def checkpoint_differs(diff: dict | None) -> bool:
    """Whether the checkpoint diff names any weight, tensor or config difference."""
    if not isinstance(diff, dict) or diff.get("same_path"):
        return False
    return bool(_units(diff) or _list(diff, "unmapped") or _list(diff, "config"))


def summary(diff: dict | None) -> dict | None:
    """The report's `checkpoint_differs` section, None when nothing differs: the units whose
    tensors differ, the number of differing tensors without a unit, the config fields that
    differ, and one line saying so."""
    if not checkpoint_differs(diff):
        return None
    units = list(_units(diff))
    unmapped = len(_list(diff, "unmapped"))
    fields = [str(c.get("field")) for c in _list(diff, "config")]
    parts = []
    if units:
        parts.append(f"weights in {len(units)} unit(s) ({', '.join(units[:6])}{', ...' if len(units) > 6 else ''})")
    if unmapped:
        parts.append(f"{unmapped} tensor(s) outside every unit")
    if fields:
        parts.append(f"{len(fields)} config field(s) ({', '.join(fields[:6])}{', ...' if len(fields) > 6 else ''})")
    return {"units": units, "unmapped": unmapped, "config": fields,
            "line": "the engine's checkpoint differs from the reference's: " + "; ".join(parts)}


def mark(aligned: bool, differs: bool) -> str:
    """The verdict's words: never a bare OK ALIGNED when the checkpoints differ."""
    if not aligned:
        return "!! DIVERGED"
    return "~~ TOKENS ALIGNED, CHECKPOINTS DIFFER" if differs else "OK ALIGNED"


def exit_code(verdict: str, diff: dict | None) -> ExitCode:
    """compare's exit code: 1 diverged; 5 tokens aligned but the checkpoints differ; 0 aligned."""
    if verdict != "aligned":
        return ExitCode.DIVERGED
    return ExitCode.CHECKPOINT_DIFFERS if checkpoint_differs(diff) else ExitCode.ALIGNED


def with_checkpoint(code: int, diff: dict | None) -> int:
    """A run's exit code: ALIGNED becomes CHECKPOINT_DIFFERS when the checkpoints differ."""
    return ExitCode.CHECKPOINT_DIFFERS if code == ExitCode.ALIGNED and checkpoint_differs(diff) else code


# -- a run whose search could not run, or stopped: the report is written all the same ------
OUTSIDE = "model"  # the reader of a config field read outside every unit (ckptdiff's read_by)


def outside_unit_fields(diff: dict | None) -> list[str]:
    """Config fields that differ and that the model reads outside every unit (a mask, a
    model-level rotary embedding): no swap carries them."""
    return [str(c.get("field")) for c in _list(diff or {}, "config") if OUTSIDE in (c.get("read_by") or [])]


def search_not_run(self_check: dict, diff: dict | None, baseline: float | None, threshold: float, strategy: str) -> dict:
    """The report's `search` when the swap self-check failed: no trial of the search ran.
    Its verdict is `unreachable` (every unit swapped does not reproduce the reference, so no
    set of units can), `not_run` says why, and the stop reason names the config fields read
    outside units that differ (or, failing those, every config field that differs)."""
    checks = [c for c in self_check.get("checks") or [] if isinstance(c, dict)]
    bad = next((c for c in checks if not c.get("passed")), {})
    reason = (f"the search could not run: the swap self-check failed (with every unit swapped as {bad.get('swapped')} "
              f"mean k3 against the reference is {fmt(bad.get('k3_mean'))}, must be <= {fmt(self_check.get('tolerance'))}): "
              "what differs is not (only) inside the units a swap replaces")
    outside = outside_unit_fields(diff)
    fields = [str(c.get("field")) for c in _list(diff or {}, "config")]
    if outside:
        reason += f"; config fields read outside every unit differ: {', '.join(outside)}"
    elif fields:
        reason += f"; config fields that differ: {', '.join(fields)}"
    return {"verdict": "unreachable", "strategy": strategy, "trials_used": 0, "stop_reason": reason,
            "baseline": baseline, "all_swapped": bad.get("k3_mean"), "threshold": threshold, "contributions": {},
            "not_run": {"why": "self_check_failed", "config_outside_units": outside, "config_differs": fields}}


def run_error(step: str, e: BaseException) -> dict:
    """The report's `run_error`: the step of a run that failed after the inputs were read,
    and its error in one line; what finished before it is kept in the report."""
    lines = str(getattr(e, "message", None) or e).strip().splitlines()
    error = f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
    return {"step": step, "error": error, "exit_code": int(getattr(e, "code", ExitCode.BACKEND))}


def localise_command(ref_path, eng_path, trace_path) -> str:
    """The command that localises a checkpoint difference the tokens do not show (under the
    threshold, or under a bf16 engine's noise floor): both checkpoints in transformers fp32,
    where the floor is 0, so the search can judge against a tiny threshold."""
    return (f"bisect run --ref hf:{shlex.quote(str(ref_path))} --engine hf:{shlex.quote(str(eng_path))} "
            f"--trace {shlex.quote(str(trace_path))} --ref-dtype float32 --engine-dtype float32 --threshold 1e-10")

"""Verdicts that never hide a finding: the one rule every command judges tokens by, and what
a checkpoint difference adds to it.

1. `tokens_verdict(value, threshold)`: "aligned" when the judged metric is at or under the
   threshold, else "diverged" (the report's `verdict`, a closed set).
2. `checkpoint_differs(diff)`: the checkpoint diff (`numbisect.ckptdiff`, the report's
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

from numbisect.errors import ExitCode


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

"""Verdicts that never hide a finding: the one rule every command judges tokens by, and what
a checkpoint difference adds to it.

1. `tokens_verdict(value, threshold)`: "aligned" when the judged metric is at or under the
   threshold, else "diverged" (the report's `verdict`, a closed set).
2. `checkpoint_differs(diff)`: the checkpoint diff (`numbisect.model.ckptdiff`, the report's
   `inputs.checkpoint_diff`) names weight or config differences. A difference is a finding at
   any threshold: a small model, a bf16 noise floor or a lenient threshold can keep its effect
   on the tokens under the threshold, and the diff is then the only signal.
3. `moved_units(diff)` and `search_explained(diff, culprits, systematic)`: the units whose
   weights came from another layer, and the sentence that ties a search's result to what the
   diff found, so the narrative agrees with the diff (two layers' blocks exchanged is that
   exchange, not "a kernel or a config value").
4. `summary(diff)`: the report's `checkpoint_differs` section (units, tensors without a
   unit, config fields, one line); `mark(aligned, differs)` the verdict's words;
   `exit_code(verdict, diff)`: 0 only when the tokens are aligned AND nothing differs,
   `ExitCode.CHECKPOINT_DIFFERS` (5) when the tokens are aligned but the checkpoints differ.

Torch-free: renderers and `bisect report` read it.
"""

from __future__ import annotations

import re
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


def mark(aligned: bool, differs: bool, weights: bool = False) -> str:
    """The verdict's words: never a bare OK ALIGNED when the checkpoints differ, or when a
    weight check found engine weights that are not the reference's (`weights`)."""
    if not aligned:
        return "!! DIVERGED"
    if weights:
        return "~~ TOKENS ALIGNED, ENGINE WEIGHTS DIFFER"
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


# -- the search's narrative agrees with the checkpoint diff ---------------------------------
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _layer_of(name) -> int | None:
    m = _LAYER.search(str(name))
    return int(m.group(1)) if m else None


def _from_other_layers(t: dict) -> str | None:
    """What a differing tensor of the diff holds from another layer, in the diff's words
    (`layers.1 <-> layers.2 swapped`, `... rows hold layer 2's (a layer index shifted)`), or None."""
    how = t.get("how")
    if how in ("swapped", "moved"):
        here, there = _layer_of(t.get("tensor")), _layer_of(t.get("holds"))
        if here is not None and there is not None and here != there:
            return f"{t.get('pair')} {how}"
    if how == "rows from other layers":
        return str(t.get("phrase") or how)
    return None


def moved_units(diff: dict | None) -> list[str]:
    """Units whose weights the checkpoint diff found in another layer: a tensor swapped with
    or moved from the same tensor of another layer, or rows taken from other layers."""
    return [u for u, e in _units(diff or {}).items()
            if isinstance(e, dict) and any(_from_other_layers(t) for t in e.get("tensors") or [] if isinstance(t, dict))]


def _covers(a: str, b: str) -> bool:
    """Unit `a` is `b`, inside it, or holds it."""
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


EXCHANGED = "the checkpoint diff explains it"  # how the weights-from-another-layer clause starts
DISAGREES = "the checkpoint diff disagrees"  # how the clause starts when no culprit holds a difference the diff found


def search_explained(diff: dict | None, culprits: list[dict], systematic: dict | None = None) -> str | None:
    """What the checkpoint diff says about the search's result, in one clause (None when it
    says nothing about it):

    - every culprit holds weights from another layer: that is the finding (`layers.1 <->
      layers.2 swapped in layers.1.moe, layers.2.moe: two layers' weights exchanged in the
      conversion`), whether the search named the units or, misled, a kind-wide culprit;
    - every culprit's weights differ: the diff names them (shown under each culprit);
    - a config field that differs is read by every culprit's kind (or the systematic kinds):
      `the engine's config differs in sliding_window (16 -> 8), read by attn`;
    - else, when the diff found weights that differ and none is in a culprit: it says so and
      names them (`DISAGREES`), rather than leaving the two findings side by side unremarked."""
    if not checkpoint_differs(diff):
        return None
    units = _units(diff)
    names = [str(c.get("unit")) for c in culprits if isinstance(c, dict) and c.get("unit")]
    kinds = {str(c.get("kind")) for c in culprits if isinstance(c, dict) and c.get("kind")}
    if isinstance(systematic, dict):
        kinds |= {str(k) for k in systematic.get("kinds") or []}
    moved = {u: sorted({w for t in e.get("tensors") or [] if isinstance(t, dict) and (w := _from_other_layers(t))})
             for u, e in units.items() if isinstance(e, dict)}
    moved = {u: ws for u, ws in moved.items() if ws}
    if moved and (names and all(any(_covers(u, c) for u in moved) for c in names)
                  or not names and isinstance(systematic, dict) and kinds):
        held = [u for u in moved if not names or any(_covers(u, c) for c in names)]
        what = sorted({w for u in held for w in moved[u]})
        exchanged = any(w.endswith(" swapped") for w in what)
        return (f"{EXCHANGED}: {'; '.join(what)} in {', '.join(names or held)}: "
                + ("two layers' weights exchanged in the conversion" if exchanged else "weights taken from another layer in the conversion")
                + ", not a kernel or a config value")
    if names and all(any(_covers(u, c) for u in units) for c in names):
        return "the checkpoint diff names " + ("its" if len(names) == 1 else "their") + " weights as different (below)"
    fields = [c for c in _list(diff or {}, "config") if kinds and kinds <= set(c.get("read_by") or [])]
    if fields:
        parts = [f"{c.get('field')} ({fmt(c.get('ref'))} -> {fmt(c.get('engine'))})" for c in fields[:4]]
        return (f"the engine's config differs in {', '.join(parts)}, read by {', '.join(sorted(kinds))}: "
                "the checkpoint diff names the value")
    if names and units and not any(_covers(u, c) for u in units for c in names):
        # measured: a qwen3_moe copy whose layer-1 query rows were re-laid out, k3 3.6x the
        # vLLM bf16 floor and 1.03x the threshold: the search named final_norm, the diff layers.1.attn
        shown = sorted(units)[:4]
        return (f"{DISAGREES}: the weights that differ are in {', '.join(shown)}{' ...' if len(units) > 4 else ''}, "
                f"not in {', '.join(names)}; near the engine's noise floor a search can follow the noise: "
                "the diff's units are the finding")
    return None

"""Text lines for a report's `weights` section (`bisect weights`, numbisect.live's
`check_weights` and the trigger's reports: per unit, whether the engine computes with the
reference's weights), from the report alone. Torch-free, for `bisect report show`, `md`
and the TUI's Overview. A report that is valid JSON but strange here (a count that is not a
number, a unit that is not an object) gives fewer lines, never an exception."""

from __future__ import annotations

from numbisect.common.formatting import fmt
from numbisect.report.view import ReportView, view

OK = "ok"


def _section(r: dict | ReportView) -> dict | None:
    w = view(r).r.get("weights")
    return w if isinstance(w, dict) and isinstance(w.get("units"), list) else None


def weights_differ(r: dict | ReportView) -> bool:
    """Whether the report holds a weight check that found a unit not ok."""
    w = _section(r)
    return w is not None and (w.get("ok") is False or bool(_differing(w)))


def _differing(w: dict) -> list[dict]:
    return [u for u in w["units"] if isinstance(u, dict) and u.get("status") != OK]


def _verdict(w: dict) -> str:
    """'1 of 14 units differ, checked by digest and by local error (0.31 s)'."""
    units = [u for u in w["units"] if isinstance(u, dict)]
    bad = _differing(w)
    verdict = "all ok" if not bad and w.get("ok") is not False else f"{len(bad)} of {len(units)} units differ"
    how = "by digest and by local error" if w.get("functional") is True else "by digest"
    secs = w.get("seconds")
    took = f" ({secs:.2f} s)" if isinstance(secs, (int, float)) and not isinstance(secs, bool) else ""
    return f"{verdict}, checked {how}{took}"


def _step(w: dict) -> str:
    return f" ({w['step']})" if isinstance(w.get("step"), str) and w["step"] else ""


def head_line(w: dict) -> str:
    """'weights (check 2): 1 of 14 units differ, checked by digest and by local error (0.31 s)'."""
    return f"weights{_step(w)}: {_verdict(w)}"


def render_lines(r: dict | ReportView) -> list[str]:
    """The weight check's lines (nothing for a report without one): its verdict, then one
    line per unit that is not ok (status, what its tensors hold), the engine tensors no
    reference tensor names."""
    w = _section(r)
    if w is None:
        return []
    out = [head_line(w)]
    for u in _differing(w):
        out.append(f"  {str(u.get('unit')):<24} {str(u.get('status')):<15} {u.get('summary') or ''}".rstrip())
        err = u.get("local_rel_l2")
        if isinstance(err, (int, float)) and not isinstance(err, bool) and u.get("status") != "buffer differs":
            out[-1] += f" (local error {fmt(err)})"
    unmapped = [str(n) for n in w.get("unmapped") or [] if isinstance(n, str)]
    if unmapped:
        out.append(f"  engine tensors no reference tensor names: {', '.join(unmapped[:4])}{' ...' if len(unmapped) > 4 else ''}")
    return out


def markdown_lines(r: dict | ReportView, code=lambda s: f"`{s}`", text=str) -> list[str]:
    """The same as Markdown (for `bisect report md`): a paragraph and a table of the units
    that are not ok. `code`/`text`: the caller's escaping of report strings."""
    w = _section(r)
    if w is None:
        return []
    out = ["", f"**Engine weights**{text(_step(w))}: {text(_verdict(w))}."]
    bad = _differing(w)
    if bad:
        out += ["", "| unit | status | what its tensors hold |", "|---|---|---|"]
        out += [f"| {code(u.get('unit'))} | {text(u.get('status'))} | {text(u.get('summary') or '')} |" for u in bad]
    return out

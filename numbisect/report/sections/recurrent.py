"""Text lines for a report's `recurrent_state` section (linear attention's recurrent state,
numbisect.pipeline.recurrent), from the report alone through `numbisect.report.view`. Torch-free.

1. Readers of the section (`layers`, `final`, `points`, `worst`, `trend`, `first_lines`,
   `unread`, `missing`): each reads one thing with the range checks of `formatting.num`
   (an entry that is not an object is left out, a value that is not a number is None), so
   `bisect report show` (`state_lines`), `report md` (`markdown_lines`) and the TUI's unit
   detail (`tui/widgets/unit_detail.py`) show the same figures and survive the same reports.
2. `state_lines`: the summary's table, per layer and per pass.
3. `markdown_lines`: a short Markdown section for `bisect report md`.
"""

from __future__ import annotations

import math

from numbisect.common.formatting import fmt, num
from numbisect.common.textsafe import md_code, md_text
from numbisect.report.view import ReportView, view


def _dict(x) -> dict:
    return x if isinstance(x, dict) else {}


def _list(x) -> list[dict]:
    return [e for e in x if isinstance(e, dict)] if isinstance(x, list) else []


def _strings(x) -> list[str]:
    return [str(u) for u in x] if isinstance(x, list) else []


def _spread(xs: list, cap: int) -> list:
    """At most `cap` of `xs`, evenly spread (first and last kept)."""
    if len(xs) <= cap or cap < 2:
        return xs[:max(cap, 0)]
    return [xs[round(i * (len(xs) - 1) / (cap - 1))] for i in range(cap)]


def layers(rs: dict) -> list[dict]:
    """The section's rows, one per linear-attention layer (entries that are objects)."""
    return _list(_dict(rs).get("layers"))


def final(row: dict, key: str) -> float | None:
    """A layer's state rel-L2 after the sample on pass `key` (propagated, local, decode)."""
    return num(_dict(_dict(row.get(key)).get("final")).get("rel_l2"))


def points(row: dict, key: str) -> list[dict]:
    """A pass's boundaries: the state every chunk of tokens (prefill) or after the prompt
    and decode steps (decode), each with its token count."""
    return _list(_dict(row.get(key)).get("boundaries"))


def worst(pts: list[dict]) -> dict | None:
    """The point with the largest rel-L2 (NaN counts as the largest, as recurrent.first_above
    counts it above the tolerance); None when no point has a number."""
    def key(p):
        x = num(p.get("rel_l2"))
        return math.inf if x is not None and math.isnan(x) else x

    scored = [p for p in pts if key(p) is not None]
    return max(scored, key=key, default=None)


def trend(pts: list[dict], cap: int = 8) -> str:
    """Points as "tokens: rel-L2", at most `cap` of them evenly spread ("-" when none)."""
    return ", ".join(f"{b.get('tokens')}: {fmt(num(b.get('rel_l2')))}" for b in _spread(pts, cap)) or "-"


def first_lines(rs: dict, tol) -> list[str]:
    """The first layer whose state is above the unit tolerance, after the sample and (decode
    mode) after decode steps."""
    out = [f"first state above rel-L2 {fmt(tol)}: {rs.get('first_above_tol') or 'none'}"]
    if "first_above_tol_decode" in rs:
        out.append(f"first state above rel-L2 {fmt(tol)} after decode steps: {rs.get('first_above_tol_decode') or 'none'}")
    return out


def unread(rs: dict) -> list[str]:
    """Decode mode: the unit@tokens points the engine's probe did not read (not measured)."""
    return _strings(_dict(rs).get("decode_unread"))


def missing(rs: dict) -> list[str]:
    """A dump: the linear units whose states it does not hold (not measured)."""
    return _strings(_dict(rs).get("missing"))


def few(names: list[str], n: int = 6) -> str:
    """The first `n` names, then how many more."""
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def state_lines(r: dict | ReportView, max_boundaries: int = 8) -> list[str]:
    v = view(r)
    rs = v.recurrent_state
    if not rs:
        return []
    outputs = {u.get("name"): _dict(u.get("propagated")).get("rel_l2") for u in v.units if isinstance(u, dict)}
    out = [
        f"Recurrent state (linear attention): rel-L2 of each layer's state after every sample (final) and every "
        f"{rs.get('chunk_size')} tokens; propagated, local (engine fed the reference's input), and the layer's output",
        f"{'unit':<20}{'state prop':>11}{'state local':>12}{'output prop':>12}{'worst sample':>20}  state by tokens (prop)",
    ]
    for row in layers(rs):
        per = _list(_dict(row.get("propagated")).get("per_sample"))
        worst_sample = max(per, key=lambda e: num(e.get("rel_l2")) or 0.0, default=None)
        w = (f"{worst_sample.get('sample')} ({fmt(num(worst_sample.get('rel_l2')))})"
             if worst_sample and num(worst_sample.get("rel_l2")) != 0 else "-")
        along = trend(points(row, "propagated")[:max_boundaries], max_boundaries)
        out.append(f"{str(row.get('unit')):<20}{fmt(final(row, 'propagated')):>11}"
                   f"{fmt(final(row, 'local')):>12}{fmt(num(outputs.get(row.get('unit')))):>12}"
                   f"{w:>20}  {along}")
    rows = [row for row in layers(rs) if isinstance(row.get("decode"), dict)]
    if rows:
        out.append("Decode mode: the engine's state after the prompt and after decode steps (its recurrent-step kernel), "
                   "against the reference's after the same tokens")
        for row in rows:
            out.append(f"{str(row.get('unit')):<20}{fmt(final(row, 'decode')):>11}"
                       f"{'':>12}{'':>12}{'':>20}  {trend(points(row, 'decode'), max_boundaries)}")
    not_read, gone = unread(rs), missing(rs)
    if not_read:
        out.append(f"decode states not read (not measured): {few(not_read)}")
    if gone:
        out.append(f"no state in the dump (not measured): {', '.join(gone)}")
    return out + first_lines(rs, v.unit_tol)


def _at(p: dict | None) -> str:
    """A point as "rel-L2 at N tokens" ("-" when none)."""
    return f"{fmt(num(p.get('rel_l2')))} at {md_text(p.get('tokens'))} tokens" if p else "-"


def _named(x) -> str:
    return md_code(x) if x else "none"


def markdown_lines(r: dict | ReportView) -> list[str]:
    """The section for `bisect report md`: per linear-attention layer its state's rel-L2
    after the sample (prefill, propagated and local) and its largest at a chunk boundary;
    in decode mode also after the decode steps and the largest after a step; then the first
    layer above the unit tolerance and the points not measured."""
    v = view(r)
    rs = v.recurrent_state
    if not rs:
        return []
    rows = layers(rs)
    decode = any(isinstance(row.get("decode"), dict) for row in rows)
    out = ["", "**Recurrent state (linear attention):** relative L2 error of each layer's state against the reference's "
               "after the same tokens (propagated: each side on its own inputs; local: the engine's layer fed the "
               "reference's input" + ("; decode: the engine run as a rollout, the prompt prefilled, then one token per step"
                                      if decode else "") + ")."]
    if rows:
        head = "| linear layer | after the sample (propagated) | local | largest at a chunk boundary (propagated) |"
        rule = "|---|---:|---:|---:|"
        if decode:
            head, rule = head + " after decode steps | largest after a decode step |", rule + "---:|---:|"
        out += ["", head, rule]
        for row in rows:
            cells = [md_code(row.get("unit"), table=True), fmt(final(row, "propagated")), fmt(final(row, "local")),
                     _at(worst(points(row, "propagated")))]
            if decode:
                cells += [fmt(final(row, "decode")), _at(worst(points(row, "decode")))]
            out.append("| " + " | ".join(cells) + " |")
    first = f"First layer whose state is above rel-L2 {fmt(num(v.unit_tol))}: {_named(rs.get('first_above_tol'))}"
    if "first_above_tol_decode" in rs:
        first += f"; after decode steps: {_named(rs.get('first_above_tol_decode'))}"
    out += ["", first + ".  "]
    not_read, gone = [md_code(u) for u in unread(rs)], [md_code(u) for u in missing(rs)]
    if not_read:
        out.append(f"Decode states not read (not measured): {few(not_read)}.  ")
    if gone:
        out.append(f"No state in the dump (not measured): {', '.join(gone)}.  ")
    return out

"""Text lines for a report's `recurrent_state` section (linear attention's recurrent state,
numbisect.recurrent), from the report alone through `numbisect.reportview`. Torch-free."""

from __future__ import annotations

from numbisect.formatting import fmt, num
from numbisect.reportview import ReportView, view


def _dict(x) -> dict:
    return x if isinstance(x, dict) else {}


def _list(x) -> list[dict]:
    return [e for e in x if isinstance(e, dict)] if isinstance(x, list) else []


def _spread(xs: list, cap: int) -> list:
    """At most `cap` of `xs`, evenly spread (first and last kept)."""
    if len(xs) <= cap or cap < 2:
        return xs[:max(cap, 0)]
    return [xs[round(i * (len(xs) - 1) / (cap - 1))] for i in range(cap)]


def state_lines(r: dict | ReportView, max_boundaries: int = 8) -> list[str]:
    v = view(r)
    rs = v.r.get("recurrent_state")
    if not isinstance(rs, dict) or not rs:
        return []
    outputs = {u.get("name"): _dict(u.get("propagated")).get("rel_l2") for u in v.units if isinstance(u, dict)}
    out = [
        f"Recurrent state (linear attention): rel-L2 of each layer's state after every sample (final) and every "
        f"{rs.get('chunk_size')} tokens; propagated, local (engine fed the reference's input), and the layer's output",
        f"{'unit':<20}{'state prop':>11}{'state local':>12}{'output prop':>12}{'worst sample':>20}  state by tokens (prop)",
    ]
    for row in _list(rs.get("layers")):
        p, lo = _dict(row.get("propagated")), _dict(row.get("local"))
        per = _list(p.get("per_sample"))
        worst = max(per, key=lambda e: num(e.get("rel_l2")) or 0.0, default=None)
        w = f"{worst.get('sample')} ({fmt(num(worst.get('rel_l2')))})" if worst and num(worst.get("rel_l2")) != 0 else "-"
        bounds = _list(p.get("boundaries"))[:max_boundaries]
        trend = ", ".join(f"{b.get('tokens')}: {fmt(num(b.get('rel_l2')))}" for b in bounds) or "-"
        out.append(f"{str(row.get('unit')):<20}{fmt(num(_dict(p.get('final')).get('rel_l2'))):>11}"
                   f"{fmt(num(_dict(lo.get('final')).get('rel_l2'))):>12}{fmt(num(outputs.get(row.get('unit')))):>12}"
                   f"{w:>20}  {trend}")
    rows = [row for row in _list(rs.get("layers")) if isinstance(row.get("decode"), dict)]
    if rows:
        out.append("Decode mode: the engine's state after the prompt and after decode steps (its recurrent-step kernel), "
                   "against the reference's after the same tokens")
        for row in rows:
            d = _dict(row.get("decode"))
            trend = ", ".join(f"{b.get('tokens')}: {fmt(num(b.get('rel_l2')))}" for b in _spread(_list(d.get("boundaries")), max_boundaries))
            out.append(f"{str(row.get('unit')):<20}{fmt(num(_dict(d.get('final')).get('rel_l2'))):>11}"
                       f"{'':>12}{'':>12}{'':>20}  {trend or '-'}")
    unread = [str(u) for u in rs.get("decode_unread") or []] if isinstance(rs.get("decode_unread"), list) else []
    if unread:
        out.append(f"decode states not read (not measured): {', '.join(unread[:6])}" + (f" and {len(unread) - 6} more" if len(unread) > 6 else ""))
    missing = [str(u) for u in rs.get("missing") or []]
    if missing:
        out.append(f"no state in the dump (not measured): {', '.join(missing)}")
    out.append(f"first state above rel-L2 {fmt(v.unit_tol)}: {rs.get('first_above_tol') or 'none'}")
    if "first_above_tol_decode" in rs:
        out.append(f"first state above rel-L2 {fmt(v.unit_tol)} after decode steps: {rs.get('first_above_tol_decode') or 'none'}")
    return out

"""Text lines for a report's `indexer_selection` and `indexer_replay` sections (sparse
attention's key selection and the replay what-if, numbisect.pipeline.selection), from the report
alone through `numbisect.report.view`. Torch-free."""

from __future__ import annotations

from numbisect.common.formatting import fmt, num, pct
from numbisect.report.view import ReportView, view


def _keys(k) -> str:
    return "{" + ",".join(str(x) for x in k) + "}" if isinstance(k, list) else "?"


def flip_line(f: dict) -> str:
    where = "completion" if f.get("completion") else "prompt"
    return (f"sample {f.get('sample')} pos {f.get('position')} ({where}): ref only {_keys(f.get('keys_ref_only'))}, "
            f"engine only {_keys(f.get('keys_engine_only'))}, margin ref {fmt(num(f.get('ref_margin')))} "
            f"engine {fmt(num(f.get('engine_margin')))}")


def _dict(x) -> dict:
    return x if isinstance(x, dict) else {}


def _list(x) -> list[dict]:
    return [e for e in x if isinstance(e, dict)] if isinstance(x, list) else []


def replay_lines(r: dict | ReportView) -> list[str]:
    """The indexer replay what-if (`--replay-indexer`): the judged metric with the reference's
    picks handed to the engine's attention, at every indexer, then at each that flipped alone."""
    rr = view(r).r.get("indexer_replay")
    if not isinstance(rr, dict) or not rr:
        return []
    metric = rr.get("metric") or "k3"
    base = fmt(num(rr.get("baseline")))
    out = [f"indexer replay (ref): the engine with the reference's picks at every indexer: {metric} {base} -> "
           f"{fmt(num(rr.get('replayed')))}; from selection flips {fmt(num(rr.get('from_flips')))}, "
           f"numeric drift {fmt(num(rr.get('from_drift')))}"]
    for row in _list(rr.get("layers")):
        if num(row.get("value_replayed_alone")) is not None:
            out.append(f"  {row.get('unit')} alone: {row.get('flips_before')} flipped queries, {metric} {base} -> "
                       f"{fmt(num(row.get('value_replayed_alone')))} (from its flips {fmt(num(row.get('from_flips')))})")
    return out


def selection_lines(r: dict | ReportView, flips_per_layer: int = 3) -> list[str]:
    """The selection agreement table, its first flips per layer, and the replay what-if."""
    se = view(r).indexer_selection
    if not isinstance(se, dict) or not se:
        return replay_lines(r)
    out = [
        f"Sparse attention (indexer top-{se.get('index_topk')}): queries picking the same keys per layer, among those that"
        " choose; propagated and local (engine fed the reference's input); exact ties at the k-th key",
        f"{'indexer':<24}{'agree':>8}{'flips':>7}{'local':>8}{'ties ref':>10}{'at ties':>9}{'margin p50':>12}{'at flips':>10}",
    ]
    layers = _list(se.get("layers"))
    for row in layers:
        p, lo = _dict(row.get("propagated")), _dict(row.get("local"))
        out.append(
            f"{str(row.get('unit')):<24}{pct(num(p.get('agree_frac'))):>8}{str(p.get('flipped', '-')):>7}"
            f"{pct(num(lo.get('agree_frac'))):>8}{str(p.get('ties_ref', '-')):>10}{str(p.get('flips_at_ties', '-')):>9}"
            f"{fmt(num(p.get('margin_p50_all'))):>12}{fmt(num(p.get('margin_p50_flipped'))):>10}")
    for row in layers:
        flips = _list(_dict(row.get("propagated")).get("flips"))
        for f in flips[:flips_per_layer]:
            out.append(f"  {row.get('unit')}: {flip_line(f)}")
    return out + replay_lines(r)

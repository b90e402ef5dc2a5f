"""Text lines for a report's `indexer_selection` section (sparse attention's key selection,
numbisect.selection), from the report alone through `numbisect.reportview`. Torch-free."""

from __future__ import annotations

from numbisect.formatting import fmt, num, pct
from numbisect.reportview import ReportView, view


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


def selection_lines(r: dict | ReportView, flips_per_layer: int = 3) -> list[str]:
    se = view(r).indexer_selection
    if not isinstance(se, dict) or not se:
        return []
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
    return out

"""Text lines for a report's `routing` and `routing_replay` sections (from the report alone)."""

from __future__ import annotations

from numbisect.formatting import fmt, pct


def number(x):
    """A report number (non-finite floats are stored as strings); None when absent."""
    try:
        return None if x is None or isinstance(x, bool) else float(x)
    except (TypeError, ValueError, OverflowError):
        return None


def _experts(e: list[int]) -> str:
    return "{" + ",".join(str(x) for x in e) + "}"


def flip_line(f: dict) -> str:
    where = "completion" if f.get("completion") else "prompt"
    out = f"sample {f['sample']} pos {f['position']} ({where}): ref {_experts(f['ref_experts'])} -> engine {_experts(f['engine_experts'])}"
    if f.get("ref_margin") is not None:
        out += (f", margin ref {fmt(number(f['ref_margin']))} engine {fmt(number(f.get('engine_margin')))},"
                f" logit err {fmt(number(f.get('logit_max_abs')))}")
    return out


def routing_lines(r: dict, flips_per_layer: int = 3) -> list[str]:
    ro = r.get("routing")
    if not ro:
        return []
    sp = ro.get("spec") or {}
    out = [
        f"MoE routing (top-{sp.get('top_k')} of {sp.get('num_experts')}, {sp.get('scoring')}): expert-set agreement per layer,"
        " propagated (each side on its own inputs) and local (engine router fed the reference's input)",
        f"{'router':<22}{'agree':>8}{'flips':>7}{'local':>8}{'logit rel-L2':>14}{'margin p50':>12}{'at flips':>10}",
    ]
    for row in ro.get("layers") or []:
        p, lo = row.get("propagated") or {}, row.get("local") or {}
        out.append(
            f"{row['unit']:<22}{pct(number(p.get('agree_frac'))):>8}{str(p.get('flipped', '-')):>7}{pct(number(lo.get('agree_frac'))):>8}"
            f"{fmt(number((p.get('logit_error') or {}).get('rel_l2'))):>14}{fmt(number(p.get('margin_p50_all'))):>12}"
            f"{fmt(number(p.get('margin_p50_flipped'))):>10}"
        )
        for f in (p.get("flips") or [])[:flips_per_layer]:
            out.append("    flip " + flip_line(f))
    rr = r.get("routing_replay")
    if rr:
        who = "the engine with the reference's" if rr["direction"] == "ref" else "the reference with the engine's"
        out.append(
            f"routing replay ({rr['direction']}): {who} expert ids at every MoE layer: {rr.get('metric', 'k3')} {fmt(number(rr['baseline']))} -> "
            f"{fmt(number(rr['replayed']))}; from routing flips {fmt(number(rr['from_flips']))}, numeric drift {fmt(number(rr['from_drift']))}"
        )
        for row in rr.get("layers") or []:
            if number(row.get("value_replayed_alone")) is not None:
                out.append(
                    f"  {row['unit']} alone: {row['flips_before']} flips -> {row.get('flips_after_alone')}, "
                    f"{rr.get('metric', 'k3')} {fmt(number(rr['baseline']))} -> {fmt(number(row['value_replayed_alone']))}"
                    f" (from its flips {fmt(number(row.get('from_flips')))})"
                )
    return out

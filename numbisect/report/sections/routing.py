"""Text lines for a report's `routing` and `routing_replay` sections (from the report
alone, through `numbisect.report.view`). Torch-free."""

from __future__ import annotations

from numbisect.common.formatting import fmt, num, pct
from numbisect.report.view import ReportView, view


def _experts(e: list[int]) -> str:
    return "{" + ",".join(str(x) for x in e) + "}"


def flip_line(f: dict) -> str:
    where = "completion" if f.get("completion") else "prompt"
    out = f"sample {f['sample']} pos {f['position']} ({where}): ref {_experts(f['ref_experts'])} -> engine {_experts(f['engine_experts'])}"
    if f.get("ref_margin") is not None:
        out += (f", margin ref {fmt(num(f['ref_margin']))} engine {fmt(num(f.get('engine_margin')))},"
                f" logit err {fmt(num(f.get('logit_max_abs')))}")
    return out


def routing_lines(r: dict | ReportView, flips_per_layer: int = 3) -> list[str]:
    v = view(r)
    ro = v.routing
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
            f"{row['unit']:<22}{pct(num(p.get('agree_frac'))):>8}{str(p.get('flipped', '-')):>7}{pct(num(lo.get('agree_frac'))):>8}"
            f"{fmt(num((p.get('logit_error') or {}).get('rel_l2'))):>14}{fmt(num(p.get('margin_p50_all'))):>12}"
            f"{fmt(num(p.get('margin_p50_flipped'))):>10}"
        )
        for f in (p.get("flips") or [])[:flips_per_layer]:
            out.append("    flip " + flip_line(f))
    rr = v.routing_replay
    if rr:
        who = "the engine with the reference's" if rr["direction"] == "ref" else "the reference with the engine's"
        out.append(
            f"routing replay ({rr['direction']}): {who} expert ids at every MoE layer: {rr.get('metric', 'k3')} {fmt(num(rr['baseline']))} -> "
            f"{fmt(num(rr['replayed']))}; from routing flips {fmt(num(rr['from_flips']))}, numeric drift {fmt(num(rr['from_drift']))}"
            + ("; in the hookable configuration (its metric, not your settings')" if rr.get("configuration") == "hookable" else "")
        )
        for row in rr.get("layers") or []:
            if num(row.get("value_replayed_alone")) is not None:
                out.append(
                    f"  {row['unit']} alone: {row['flips_before']} flips -> {row.get('flips_after_alone')}, "
                    f"{rr.get('metric', 'k3')} {fmt(num(rr['baseline']))} -> {fmt(num(row['value_replayed_alone']))}"
                    f" (from its flips {fmt(num(row.get('from_flips')))})"
                )
    return out

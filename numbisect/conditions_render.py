"""The text of a report's `conditions` section (`bisect conditions`): torch-free, read by
`numbisect.render` for the summary and `bisect report show`."""

from __future__ import annotations

from numbisect.formatting import fmt


def _pct(x) -> str:
    return f"{100 * x:.1f}%" if isinstance(x, (int, float)) and not isinstance(x, bool) else fmt(x)


def conditions_lines(cond) -> list[str]:
    """One line per finding: the search, both configurations against the reference (RL cost),
    each atom (culprit, changes log-probs, or bitwise invariant here), the localisation."""
    if not isinstance(cond, dict):
        return []
    out = ["engine conditions: your settings against the known-good configuration"]
    s = cond.get("search") or {}
    out.append(f"  search: {s.get('verdict')} after {s.get('trials_used')} trials: {s.get('stop_reason')}")
    vr = cond.get("vs_reference") or {}
    for side in ("user", "good"):
        r = vr.get(side) or {}
        rl = r.get("rl_cost") or {}
        k3 = ((r.get("groups") or {}).get("completion") or {}).get("k3_mean")
        out.append(f"  {side:<4} vs reference: completion k3 mean {fmt(k3)}, sequences rejected {_pct(rl.get('seq_frac_rejected'))}"
                   f" (TIS {_pct(rl.get('seq_frac_tis'))}, IcePop {_pct(rl.get('seq_frac_icepop'))}, geo-mean {_pct(rl.get('seq_frac_geo'))},"
                   f" seq k3 {_pct(rl.get('seq_frac_k3'))})")
    for a in cond.get("atoms") or []:
        if not isinstance(a, dict):
            continue
        tag = ("CULPRIT" if a.get("culprit") else "bitwise invariant here" if a.get("bitwise_invariant")
               else "not measured" if a.get("alone") is None else "changes log-probs")
        ref = (a.get("vs_reference") or {}).get("rl_cost") or {}
        out.append(f"  {str(a.get('atom')):<28} alone: k3 {fmt(a.get('alone'))}, {tag}; {a.get('description')}"
                   + (f"; vs reference: sequences rejected {_pct(ref.get('seq_frac_rejected'))}" if ref else ""))
    loc = cond.get("localisation")
    if isinstance(loc, dict):
        if loc.get("done"):
            what = "whose code compiled alone differs" if loc.get("compiled_units") is not None else "whose local output differs"
            out.append(f"  under {loc.get('atom')}: units {what}: {', '.join(map(str, loc.get('named') or [])) or 'none'}")
        else:
            out.append(f"  under {loc.get('atom')}: not localised ({loc.get('why')})")
    return out


def engine_config_lines(ec) -> list[str]:
    """One line for a report's `engine_config` section (`compare` / `run --engine-config`):
    which parts ran in the user's configuration and which in the hookable one."""
    if not isinstance(ec, dict):
        return []
    src = f" ({ec.get('file')})" if ec.get("file") else ""
    if not ec.get("child"):
        return [f"engine config: your settings{src} run with hooks as they are: every part ran in them"]
    changed = ", ".join(map(str, ec.get("changed") if isinstance(ec.get("changed"), list) else [])) or "nothing"
    vs = ec.get("hookable_vs_user") if isinstance(ec.get("hookable_vs_user"), dict) else {}
    same = ("bitwise equal to yours" if vs.get("bitwise") else f"k3 {fmt(vs.get('k3_mean'))} from yours (max |diff| {fmt(vs.get('max_abs_diff'))})"
            if vs else "not compared")
    hb = ec.get("hookable_baseline") if isinstance(ec.get("hookable_baseline"), dict) else {}
    return [f"engine config: token metrics in your settings{src} (child process); captures and search in the hookable one "
            f"(changed: {changed}), whose log-probs are {same}, {hb.get('verdict', '?')} against the reference "
            f"(value {fmt(hb.get('value'))})"]

"""Plain-text summaries of a report, for stdout and `bisect report show`.

Everything here reads the report alone, through `numbisect.report.view` (each function
takes a report dict or its view), so a summary can be regenerated on a machine without
the models. Verdicts carry words and symbols, not only colour. The view's strings are
printable (escape sequences and line breaks shown escaped), so a hostile report cannot
drive the terminal or forge a line.
"""

from __future__ import annotations

import json

from numbisect.common.formatting import fmt, pct
from numbisect.common.textsafe import printable_text
from numbisect.report.findings import checkpoint_differs, localise_command, mark
from numbisect.report.sections.conditions import (
    conditions_lines,
    engine_config_lines,
)
from numbisect.report.sections.decode import render_lines as decode_lines
from numbisect.report.sections.recurrent import state_lines
from numbisect.report.sections.routing import routing_lines
from numbisect.report.sections.selection import selection_lines
from numbisect.report.sections.weights import render_lines as weights_lines
from numbisect.report.sections.weights import weights_differ
from numbisect.report.view import ReportView, view


def header(r: dict | ReportView) -> list[str]:
    v = view(r)
    eng, ref, tr = v.engine, v.ref, v.trace
    eng_s = f"{eng['backend']} log-probs" if v.engine_recorded else f"{eng['backend']}:{eng['path']} ({eng['dtype']})"
    lines = [
        f"numbisect {v.kind} | {ref.get('arch', '?')} | ref hf:{ref['path']} ({ref['dtype']}) vs engine {eng_s}",
        f"trace {tr['path']}: {tr['samples']} samples, {tr['completion_tokens']} completion tokens",
    ]
    if v.faults:
        lines.append("planted faults: " + ", ".join(f["spec"] for f in v.faults))
    lines += checkpoint_lines(v)
    differs = checkpoint_differs(v.checkpoint_diff)
    cmp_ = "<=" if v.aligned else ">"
    held = weights_differ(v)
    lines.append(f"verdict: {mark(v.aligned, differs, held)}  {v.metric} {fmt(v.value)} {cmp_} threshold {fmt(v.threshold)} "
                 f"(group {v.group})")
    if v.aligned and held:  # a weight check's finding, whatever the tokens show
        lines.append("   the tokens are within the threshold, but the engine computes with other weights than the "
                     "reference's in some units (below)")
    elif v.aligned and differs:  # a checkpoint difference is a finding at any threshold
        lines.append("   the tokens are within the threshold, but the engine's checkpoint differs from the reference's "
                     "(above): not the same model")
        lines.append("   to localise it below the noise floor (both checkpoints in transformers fp32, floor 0): "
                     + localise_command(ref.get("path"), eng.get("path"), tr.get("path")))
    o = v.threshold_origin
    if o is not None:  # --threshold floor[xN]
        where = f"from {o.get('file')}" if o.get("file") else "calibrated now"
        lines.append(f"threshold: {fmt(o.get('factor'))} x noise floor {fmt(o.get('floor'))} ({where}; variants {', '.join(o.get('variants') or [])})")
    return lines + contract_lines(v)


def contract_lines(r: dict | ReportView) -> list[str]:
    """The log-prob contract of a rollout (numbisect.pipeline.contract): the first finding when its
    log-probs are not the model's raw ones; one line saying so when they are."""
    c = view(r).logprob_contract
    verdict = c.get("verdict")
    if not verdict:
        return []
    fit = c.get("fitted") if isinstance(c.get("fitted"), dict) else {}
    if verdict == "processed":
        return [f"!! log-prob contract: {c.get('advice')}",
                f"   fitted on {c.get('positions')} completion tokens: mean |log-prob error| {fmt(c.get('raw_error'))} as raw, "
                f"{fmt(c.get('fit_error'))} as processed (temperature {fmt(fit.get('temperature'))}, top-p {fmt(fit.get('top_p'))}, "
                f"top-k {fit.get('top_k') or 'off'}; kept mass {pct(fit.get('kept_mass'))})"]
    if verdict == "raw":
        return [f"log-prob contract: raw (mean |log-prob error| {fmt(c.get('raw_error'))} over {c.get('positions')} "
                "completion tokens; no temperature, top-p or top-k fits better)"]
    return [f"log-prob contract: {verdict} ({c.get('advice')})"]


def checkpoint_lines(r: dict | ReportView) -> list[str]:
    """What differs between the engine's checkpoint and the reference's (weights per unit,
    numeric config fields); nothing when they were not compared (one checkpoint for both)."""
    d = view(r).checkpoint_diff
    if not d or d.get("same_path"):
        return []
    n = d.get("config_fields")
    compared = f"config ({n} fields compared)" if isinstance(n, int) else "numeric config"  # older reports compared a list
    meta = [f"config metadata (not a finding): {c.get('field')} is {_json(c.get('engine'))} in the engine, {_json(c.get('ref'))} in the reference"
            for c in (d.get("config_metadata") if isinstance(d.get("config_metadata"), list) else []) if isinstance(c, dict)]
    if d.get("identical"):
        return [f"checkpoints: the engine's {d.get('tensors')} tensors and {compared} equal the reference's"] + meta
    lines = []
    units = d.get("units") if isinstance(d.get("units"), dict) else {}
    if units:
        lines.append(f"checkpoints: the engine's weights differ from the reference's in {len(units)} unit(s):")
        lines += [f"  {u}: {e.get('summary') if isinstance(e, dict) else e}" for u, e in units.items()]
    for t in d.get("unmapped") or []:
        if isinstance(t, dict):
            lines.append(f"  {t.get('tensor')} (no unit): {t.get('how')}")
    for c in d.get("config") or []:
        if isinstance(c, dict):
            readers = [("the model outside every unit" if k == "model" else str(k)) for k in c.get("read_by") or []]
            lines.append(f"config: {c.get('field')} is {_json(c.get('engine'))} in the engine, {_json(c.get('ref'))} "
                         f"in the reference (read by {', '.join(readers) or 'unknown'})")
    return lines + meta


def _json(x) -> str:
    try:
        return json.dumps(x)
    except (TypeError, ValueError):
        return str(x)


def token_table(r: dict | ReportView) -> list[str]:
    out = [f"{'tokens':<12}{'count':>7}{'k3 mean':>10}{'k3 p99':>10}{'k3 max':>10}{'KL mean':>10}{'top-1':>8}"]
    for g, v in view(r).groups.items():
        kl = v["kl"]["mean"] if v.get("kl") else None
        out.append(
            f"{g:<12}{v['tokens']:>7}{fmt(v['k3']['mean']):>10}{fmt(v['k3']['p99']):>10}{fmt(v['k3']['max']):>10}"
            f"{fmt(kl):>10}{pct(v.get('top1_agree')):>8}"
        )
    return out


def rl_lines(r: dict | ReportView) -> list[str]:
    c = view(r).rl_cost
    t = c["thresholds"]
    return [
        f"RL cost: sequences rejected {pct(c['seq_frac_rejected'])} of {c['sequences']}"
        f" (TIS>{t['tis_cap']}: {pct(c['seq_frac_tis'])}, IcePop [{t['icepop_low']}, {t['icepop_high']}]: {pct(c['seq_frac_icepop'])},"
        f" geo-mean [{t['geo_low']}, {t['geo_high']}]: {pct(c['seq_frac_geo'])}, seq k3>{t['seq_k3_max']}: {pct(c['seq_frac_k3'])});"
        f" tokens over TIS cap {pct(c['token_frac_tis'])}, outside IcePop {pct(c['token_frac_icepop'])}"
    ]


def unit_table(r: dict | ReportView) -> list[str]:
    v = view(r)
    rows = v.units
    if not rows:
        return []
    culprits = {c["unit"] for c in v.culprits}
    out = [f"{'unit':<28}{'prop rel-L2':>12}{'local rel-L2':>13}{'bitwise':>9}{'max ulps':>9}{'rank':>6}"]
    rank = v.local_ranking
    for u in rows:
        p, loc = u.get("propagated"), u.get("local")
        ul = (loc or p or {}).get("ulps") or {}
        eq = "-" if not ul else ("=" if ul.get("bitwise_equal") else "!=")
        mark = "  << culprit" if u["name"] in culprits else ""
        indent = "  " * (u["name"].count(".") - (1 if u["name"].startswith("layers.") else 0))
        out.append(
            f"{indent + u['name']:<28}{fmt((p or {}).get('rel_l2')):>12}{fmt((loc or {}).get('rel_l2')):>13}"
            f"{eq:>9}{fmt(ul.get('max_ulps'), 0) if ul.get('max_ulps') is not None else '-':>9}{rank.get(u['name'], '-'):>6}{mark}"
        )
    fd = v.first_divergence
    out.append(
        f"first divergence: {fd.get('bitwise') or 'none'} (first unit not bitwise equal); "
        f"{fd.get('above_tol') or 'none'} (first above rel-L2 {fmt(v.unit_tol)})"
    )
    return out


def worst_lines(r: dict | ReportView, n: int = 5) -> list[str]:
    w = view(r).worst_tokens
    if not w:
        return []
    return ["worst tokens: " + "; ".join(f"sample {t['sample']} pos {t['position']} id {t['token_id']} k3 {fmt(t['value'])}" for t in w[:n])]


def search_lines(r: dict | ReportView) -> list[str]:
    v = view(r)
    s = v.search
    if not s:
        return []
    out = []
    if v.swap:
        return [fmt(line) for line in v.swap_lines]
    out.append(f"search ({s['strategy']}): {s['trials_used']} trials; {s['stop_reason']}")
    out += systematic_lines(v)
    for c in v.culprits:
        rank = f", local-error rank {c['local_rank']}" if c.get("local_rank") else ""
        out.append(
            f"culprit {c['unit']} ({c['kind']}): swapping it alone takes {v.metric} "
            f"from {fmt(s['baseline'])} to {fmt(c['alone'])}; with every other unit swapped it is {fmt(c['complement'])}{rank}"
        )
        per_group = _group_evidence(v, c["unit"])
        if per_group:
            out.append(per_group)
        out += _weight_evidence(v, c["unit"])
    out += whatif_lines(v)
    if s.get("verdict") == "diffuse":
        out.append("diffuse: no set smaller than every layer reaches the threshold; per-layer contributions:")
        for name, c in v.contributions.items():
            out.append(f"  {name:<12} alone {fmt(c.get('alone'))}  all others swapped {fmt(c.get('complement'))}")
        out += diffuse_kind_lines(v)
    return out


def diffuse_kind_lines(r: dict | ReportView) -> list[str]:
    """A diffuse search where only every kind together fixes it: each kind's contribution."""
    v = view(r)
    dk = v.diffuse_kinds
    per_kind = dk.get("per_kind") if isinstance(dk.get("per_kind"), dict) else {}
    if not per_kind:
        return []
    out = [f"only every kind together fixes it ({', '.join(map(str, dk.get('kinds') or []))}: {dk.get('units')} units, "
           f"needed in {dk.get('layers')} layers); per-kind contributions:"]
    for k, c in per_kind.items():
        c = c if isinstance(c, dict) else {}
        out.append(f"  {str(k):<12} alone {fmt(c.get('alone'))}  all other kinds swapped {fmt(c.get('complement'))}")
    return out


def systematic_lines(r: dict | ReportView) -> list[str]:
    """A kind-level culprit and its evidence: every unit of the kinds swapped, each kind
    alone, and per layer the value with that layer's units of the kind left in the engine
    (its share; older reports: per unit)."""
    v = view(r)
    sy = v.systematic
    if not sy:
        return []
    kinds = ", ".join(map(str, sy.get("kinds") or []))
    out = [f"systematic culprit: {kinds}, in every layer: with all {sy.get('units')} {kinds} units swapped "
           f"{v.metric} goes from {fmt((v.search or {}).get('baseline'))} to {fmt(sy.get('value'))}"]
    per_kind = sy.get("per_kind") if isinstance(sy.get("per_kind"), dict) else {}
    if per_kind:
        out.append("  each kind alone swapped: " + ", ".join(f"{k} {fmt(x)}" for k, x in per_kind.items()))
    per_unit = sy.get("per_unit") if isinstance(sy.get("per_unit"), dict) else {}
    for k, layers in per_unit.items():
        if isinstance(layers, dict) and layers:
            out.append(f"  each unit's share of {k} ({v.metric} with every other {kinds} unit swapped): "
                       + ", ".join(f"{name} {fmt(x)}" for name, x in layers.items()))
    per_layer = sy.get("per_layer") if isinstance(sy.get("per_layer"), dict) else {}
    for k, layers in per_layer.items():
        if isinstance(layers, dict) and layers:
            out.append(f"  each layer's share of {k} ({v.metric} with that layer's {k} units left, every other {kinds} unit swapped): "
                       + ", ".join(f"{name} {fmt(x)}" for name, x in layers.items()))
    precision = sy.get("precision") if isinstance(sy.get("precision"), dict) else {}
    if precision:
        out.append(f"precision what-if for every {kinds} unit: suggested fix: {precision.get('suggested', '')}")
        for t in precision.get("whatifs") or []:
            if isinstance(t, dict):
                out.append(f"  {t.get('line', '')}")
    return out


def _weight_evidence(v: ReportView, unit: str) -> list[str]:
    """The checkpoint differences inside a culprit (its own unit and its sub-units)."""
    units = v.checkpoint_diff.get("units")
    if not isinstance(units, dict):
        return []
    return [f"  its weights differ from the reference's: {name}: {e.get('summary') if isinstance(e, dict) else e}"
            for name, e in units.items() if name == unit or str(name).startswith(unit + ".")]


def _group_evidence(v: ReportView, unit: str) -> str | None:
    """k3 mean per token group, baseline -> the trial that swapped only `unit`."""
    base = next((t for t in v.trials if not t.get("swapped")), None)
    alone = next((t for t in v.trials if t.get("swapped") == [unit]), None)
    if base is None or alone is None:
        return None
    bg, ag = v.trial_groups(base), v.trial_groups(alone)
    cells = [f"{g} {fmt(bg[g].get('k3_mean'))} -> {fmt(ag[g].get('k3_mean'))}" for g in bg if g in ag and bg[g].get("k3_mean") is not None]
    return f"  k3 mean per group, baseline -> {unit} swapped: " + ", ".join(cells) if cells else None


def render(r: dict | ReportView) -> str:
    """The plain-text summary of report `r`; every character printable (newlines aside)."""
    v = view(r)
    parts = header(v) + engine_config_lines(v)
    wl = weights_lines(v)  # a weight check's report: the finding, before the tokens it was run on
    if wl:
        parts += [""] + wl
    parts += [""] + token_table(v) + rl_lines(v)
    for section in (unit_table(v), state_lines(v), routing_lines(v), selection_lines(v)):
        if section:
            parts += [""] + section
    parts += worst_lines(v)
    dl = decode_lines(v)
    if dl:
        parts += [""] + dl
    sl = search_lines(v) + post_search_lines(v)
    if sl:
        parts += [""] + sl
    cl = conditions_lines(v.r.get("conditions"))
    if cl:
        parts += [""] + cl
    return printable_text("\n".join(str(p) for p in parts) + "\n")


def post_search_lines(r: dict | ReportView) -> list[str]:
    """One line per step after the search that failed (`post_search_errors`): what-ifs,
    summaries. The search's result above them stands."""
    out = []
    for e in view(r).post_search_errors:
        unit = f" for {e.get('unit')}" if e.get("unit") else ""
        out.append(f"!! {e.get('step')}{unit} failed after the search: {e.get('error')} (the search's result stands)")
    stop = view(r).r.get("run_error")
    if isinstance(stop, dict):
        out.append(f"!! the run stopped: its {stop.get('step')} failed: {stop.get('error')} (what finished is above)")
    return out


def whatif_lines(r: dict | ReportView) -> list[str]:
    """The what-if lines of a report's culprits (for `run`'s summary and `report show`)."""
    out = []
    for c in view(r).culprits:
        p = c.get("precision") if isinstance(c, dict) else None
        if not isinstance(p, dict):
            continue
        out.append(f"precision what-if for {c.get('unit')}: suggested fix: {p.get('suggested')}")
        for t in p.get("whatifs") or []:
            out.append(f"  {t.get('whatif')}: {t.get('line')}")
    return out

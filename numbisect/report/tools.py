"""Reports for bug tickets: `bisect report diff` (did the fix work?) and `bisect report md`.

Everything here reads report dicts alone (as `load_report` returns them): no model, no
torch, no vLLM, so it runs on the machine of whoever reads the ticket.

1. `diff(a, b)`: A is "before", B is "after". The judged metric and k3 per token group
   before and after, RL cost, per-unit deltas (propagated and local rel-L2), which
   culprits were resolved, appeared or persist, and every input that differs between
   the two runs as a "not comparable: ..." line. `d["aligned"]` is B's verdict.
2. `render_diff(d)`: the same as text for a terminal.
3. `markdown(r)`: a Markdown summary to paste into a GitHub issue: verdict, culprit with
   its evidence, a small per-layer table, linear attention's recurrent state per layer
   (`numbisect.report.sections.recurrent.markdown_lines`), token groups, RL cost, environment and the
   command that reproduces the run.

Both read reports through `numbisect.report.view` (a report dict or its view). Non-finite
numbers arrive as the strings "inf", "-inf", "nan" (the report's encoding);
`formatting.num()` turns them back into floats.

The view's strings are printable (no escape sequences, no line breaks), and Markdown
shows each one as escaped text or as a code span, so it cannot end a table cell or add markup.
"""

from __future__ import annotations

import math
import re
import shlex

from numbisect.common.formatting import fmt, num, pct
from numbisect.common.textsafe import md_code, md_text, printable, printable_text
from numbisect.report.findings import checkpoint_differs, mark
from numbisect.report.sections.conditions import (
    engine_config_finding,
    user_modes_lines,
)
from numbisect.report.sections.decode import markdown_lines as decode_md
from numbisect.report.sections.recurrent import markdown_lines as state_md
from numbisect.report.sections.weights import markdown_lines as weights_md
from numbisect.report.sections.weights import weights_differ
from numbisect.report.summary import checkpoint_lines, contract_lines, systematic_lines
from numbisect.report.view import ReportView, bitwise, get, rel, view

MAX_DIFF_UNITS = 25  # unit rows shown by render_diff before the rest are summarised


# -- small helpers ----------------------------------------------------------------------------
def _delta(before, after) -> float | None:
    a, b = num(before), num(after)
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
        return None
    return b - a


def _short(h) -> str:
    return h[:12] if isinstance(h, str) else "-"


def _fmt_signed(x) -> str:
    if x is None:
        return "-"
    return "0" if x == 0 else ("+" if x > 0 else "-") + fmt(abs(x))


def _opts(side: dict) -> dict:
    """A backend's options without the unset (None) ones: unset and absent mean the same."""
    o = side.get("options")
    return {k: v for k, v in o.items() if v is not None} if isinstance(o, dict) else {}


def _kv(d) -> str:
    return ", ".join(f"{k}={v}" for k, v in d.items()) if isinstance(d, dict) else str(d)


def _eq(bitwise) -> str:
    return "-" if bitwise is None else ("=" if bitwise else "!=")


# -- diff -------------------------------------------------------------------------------------
def _side(v: ReportView, label: str) -> dict:
    return {
        "label": label,
        "kind": v.kind,
        "created": v.created,
        "verdict": v.verdict,
        "value": num(v.value),
        "metric": v.metric,
        "group": v.group,
        "threshold": num(v.threshold),
        "search_verdict": get(v.r, "search", "verdict"),
        "checkpoint_differs": checkpoint_differs(v.checkpoint_diff),
    }


def _incomparable(a: ReportView, b: ReportView) -> list[str]:
    """One "not comparable: ..." line per input that differs between the two runs."""
    out = []

    def sha_line(what: str, sa, sb) -> None:
        if sa == sb:
            return
        if isinstance(sa, dict) and isinstance(sb, dict):
            files = sorted(set(sa) | set(sb))
            parts = [f"{f} {_short(sa.get(f))} vs {_short(sb.get(f))}" for f in files if sa.get(f) != sb.get(f)]
            out.append(f"not comparable: {what} checkpoint differs (sha256 {'; '.join(parts)})")
        else:
            out.append(f"not comparable: {what} checkpoint differs (sha256 {_short(sa)} vs {_short(sb)})")

    for side, what in (("ref", "reference"), ("engine", "engine")):
        sa, sb = a.side(side), b.side(side)
        if sa.get("backend") != sb.get("backend"):
            out.append(f"not comparable: {what} backend differs ({sa.get('backend')} vs {sb.get('backend')})")
        if sa.get("arch") != sb.get("arch"):
            out.append(f"not comparable: {what} architecture differs ({sa.get('arch')} vs {sb.get('arch')})")
        sha_line(what, sa.get("sha256"), sb.get("sha256"))
        if sa.get("dtype") != sb.get("dtype"):
            out.append(f"not comparable: {what} dtype differs ({sa.get('dtype')} vs {sb.get('dtype')})")
        oa, ob = _opts(sa), _opts(sb)
        if oa != ob:
            keys = sorted(set(oa) | set(ob), key=str)
            parts = [f"{k} {oa.get(k)!r} vs {ob.get(k)!r}" for k in keys if oa.get(k) != ob.get(k)]
            out.append(f"not comparable: {what} options differ ({'; '.join(parts)})")
    ma, mb = a.engine_mode, b.engine_mode
    if ma != mb:
        out.append(f"not comparable: engine mode differs ({ma} vs {mb})")
    ta, tb = a.trace, b.trace
    if ta.get("sha256") != tb.get("sha256"):
        out.append(f"not comparable: trace differs (sha256 {_short(ta.get('sha256'))} vs {_short(tb.get('sha256'))})")
    fa = [f.get("spec") for f in a.faults]
    fb = [f.get("spec") for f in b.faults]
    if fa != fb:
        out.append(f"not comparable: planted faults differ ({', '.join(fa) or 'none'} vs {', '.join(fb) or 'none'})")
    sa, sb = a.settings, b.settings
    if sa != sb:
        keys = sorted(set(sa) | set(sb))
        parts = [f"{k} {sa.get(k)!r} vs {sb.get(k)!r}" for k in keys if sa.get(k) != sb.get(k)]
        out.append(f"not comparable: verdict settings differ ({'; '.join(parts)})")
    if a.tool_version != b.tool_version:
        out.append(f"not comparable: numbisect version differs ({a.tool_version} vs {b.tool_version})")
    ea, eb = a.environment, b.environment
    for key in ("torch", "transformers", "vllm", "python", "machine", "device", "threads", "seeds"):
        if ea.get(key) != eb.get(key):
            out.append(f"not comparable: {key} differs ({ea.get(key)} vs {eb.get(key)})")
    return out


def _groups(a: ReportView, b: ReportView) -> dict:
    ga, gb = a.groups, b.groups
    out = {}
    for g in list(ga) + [g for g in gb if g not in ga]:
        va, vb = ga.get(g) or {}, gb.get(g) or {}
        row = {"tokens": [va.get("tokens"), vb.get("tokens")]}
        for key, path in (("k3_mean", ("k3", "mean")), ("k3_p99", ("k3", "p99")), ("k3_max", ("k3", "max")), ("kl_mean", ("kl", "mean"))):
            before, after = num(get(va, *path)), num(get(vb, *path))
            row[key] = {"before": before, "after": after, "delta": _delta(before, after)}
        out[g] = row
    return out


def _units(a: ReportView, b: ReportView) -> list[dict]:
    ua, ub = a.unit_map, b.unit_map
    names = list(ua) + [n for n in ub if n not in ua]
    rows = []
    for n in names:
        x, y = ua.get(n), ub.get(n)
        row = {"name": n, "kind": (x or y).get("kind"), "in": "both" if x and y else ("a" if x else "b")}
        for side in ("propagated", "local"):
            before, after = rel(x, side), rel(y, side)
            row[side] = {"before": before, "after": after, "delta": _delta(before, after)}
        row["bitwise"] = {"before": bitwise(x, "local") if get(x, "local") else bitwise(x, "propagated"),
                          "after": bitwise(y, "local") if get(y, "local") else bitwise(y, "propagated")}
        rows.append(row)
    return rows


def _culprit_changes(a: ReportView, b: ReportView) -> list[dict]:
    """Each culprit of either side with its status: resolved, persists, appeared or unknown."""
    ca, cb = {c["unit"]: c for c in a.named_culprits}, {c["unit"]: c for c in b.named_culprits}
    ub = b.unit_map
    out = []
    for name, c in ca.items():
        if name in cb:
            status = "persists"
        elif b.aligned or b.searched:
            status = "resolved"  # B is aligned, or B's search did not name it
        else:
            status = "unknown"  # B diverged but was not searched: cannot tell
        out.append({
            "unit": name, "kind": c.get("kind"), "status": status,
            "alone_before": num(c.get("alone")), "complement_before": num(c.get("complement")),
            "local_rel_l2_after": rel(ub.get(name), "local"),
        })
    for name, c in cb.items():
        if name not in ca:
            out.append({
                "unit": name, "kind": c.get("kind"),
                "status": "appeared" if (a.searched or a.aligned) else "named",
                "alone_after": num(c.get("alone")), "complement_after": num(c.get("complement")),
            })
    return out


def diff(a: dict | ReportView, b: dict | ReportView, labels: tuple[str, str] = ("A", "B")) -> dict:
    """Compare report A (before) with report B (after). JSON-safe except for non-finite floats;
    every string in it (labels included) printable."""
    a, b = view(a), view(b)
    labels = (printable(labels[0]), printable(labels[1]))
    ra, rb = a.rl_cost, b.rl_cost
    before, after = _side(a, labels[0]), _side(b, labels[1])
    return {
        "a": before,
        "b": after,
        "judged": {
            "metric": after["metric"] or before["metric"],
            "group": after["group"] or before["group"],
            "before": before["value"],
            "after": after["value"],
            "delta": _delta(before["value"], after["value"]),
            "threshold": after["threshold"],
        },
        "groups": _groups(a, b),
        "rl_cost": {
            k: {"before": num(ra.get(k)), "after": num(rb.get(k)), "delta": _delta(ra.get(k), rb.get(k))}
            for k in ("seq_frac_rejected", "token_frac_tis", "token_frac_icepop")
        },
        "units": _units(a, b),
        "culprits": _culprit_changes(a, b),
        "not_comparable": _incomparable(a, b),
        "aligned": b.aligned,
    }


def _verdict_word(side: dict) -> str:
    v = side["verdict"]
    return mark(v == "aligned", bool(side.get("checkpoint_differs"))) if v in ("aligned", "diverged") else str(v)


def render_diff(d: dict) -> str:
    a, b, j = d["a"], d["b"], d["judged"]
    lines = [
        f"numbisect diff | before {a['label']} ({a['kind']}, {a['created']}) -> after {b['label']} ({b['kind']}, {b['created']})",
        f"verdict: {_verdict_word(a)} -> {_verdict_word(b)}  {j['metric']} (group {j['group']}) "
        f"{fmt(j['before'])} -> {fmt(j['after'])}, threshold {fmt(j['threshold'])}",
    ]
    nc = d["not_comparable"]
    lines += nc if nc else ["inputs: same checkpoints, trace, dtypes, options, faults, settings and versions"]
    lines += ["", f"{'tokens':<12}{'k3 mean':>10}{'->':>4}{'after':>10}{'k3 p99':>10}{'->':>4}{'after':>10}{'KL mean':>10}{'->':>4}{'after':>10}"]
    for g, v in d["groups"].items():
        m, p, k = v["k3_mean"], v["k3_p99"], v["kl_mean"]
        lines.append(
            f"{g:<12}{fmt(m['before']):>10}{'->':>4}{fmt(m['after']):>10}{fmt(p['before']):>10}{'->':>4}{fmt(p['after']):>10}"
            f"{fmt(k['before']):>10}{'->':>4}{fmt(k['after']):>10}"
        )
    rc = d["rl_cost"]
    lines.append(
        f"RL cost: sequences rejected {pct(rc['seq_frac_rejected']['before'])} -> {pct(rc['seq_frac_rejected']['after'])};"
        f" tokens over TIS cap {pct(rc['token_frac_tis']['before'])} -> {pct(rc['token_frac_tis']['after'])};"
        f" outside IcePop {pct(rc['token_frac_icepop']['before'])} -> {pct(rc['token_frac_icepop']['after'])}"
    )
    if d["culprits"]:
        lines.append("")
        for c in d["culprits"]:
            if c["status"] == "resolved":
                extra = f"; its local rel-L2 is now {fmt(c['local_rel_l2_after'])}" if c.get("local_rel_l2_after") is not None else ""
                lines.append(f"resolved: {c['unit']} ({c['kind']}), culprit in {a['label']} (swapped alone: {fmt(c['alone_before'])}){extra}")
            elif c["status"] == "persists":
                lines.append(f"persists: {c['unit']} ({c['kind']}) is a culprit in both")
            elif c["status"] == "appeared":
                lines.append(f"appeared: {c['unit']} ({c['kind']}), a culprit in {b['label']} only (swapped alone: {fmt(c.get('alone_after'))})")
            elif c["status"] == "named":
                lines.append(f"named: {c['unit']} ({c['kind']}), a culprit in {b['label']} ({a['label']} was not searched)")
            else:
                lines.append(f"unknown: {c['unit']} ({c['kind']}), a culprit in {a['label']}; {b['label']} diverged but was not searched")
    changed = [u for u in d["units"] if any(u[s]["before"] != u[s]["after"] for s in ("propagated", "local")) or u["in"] != "both"]
    if d["units"]:
        lines += ["", f"units: {len(changed)} of {len(d['units'])} changed (rel-L2, before -> after)"]
    if changed:
        shown = changed
        if len(changed) > MAX_DIFF_UNITS:
            def size(u):
                return max(abs(u[s]["delta"]) if u[s]["delta"] is not None else math.inf for s in ("propagated", "local"))
            keep = {u["name"] for u in sorted(changed, key=size, reverse=True)[:MAX_DIFF_UNITS]}
            shown = [u for u in changed if u["name"] in keep]
        lines.append(f"{'unit':<28}{'propagated':>10}{'->':>4}{'after':>10}{'delta':>11}{'local':>10}{'->':>4}{'after':>10}{'delta':>11}{'bitwise':>11}")
        for u in shown:
            p, loc, bw = u["propagated"], u["local"], u["bitwise"]
            eq = f"{_eq(bw['before'])} -> {_eq(bw['after'])}"
            note = "" if u["in"] == "both" else f"  (only in {a['label'] if u['in'] == 'a' else b['label']})"
            lines.append(
                f"{u['name']:<28}{fmt(p['before']):>10}{'->':>4}{fmt(p['after']):>10}{_fmt_signed(p['delta']):>11}"
                f"{fmt(loc['before']):>10}{'->':>4}{fmt(loc['after']):>10}{_fmt_signed(loc['delta']):>11}{eq:>11}{note}"
            )
        if len(shown) < len(changed):
            lines.append(f"(+{len(changed) - len(shown)} more changed units; --json lists all)")
    return printable_text("\n".join(lines) + "\n")


# -- markdown ---------------------------------------------------------------------------------
def _md(s) -> str:
    """A report's string as Markdown text: printable, one line, its markup escaped
    (safe inside a table cell too)."""
    return md_text(s)


def _code(s) -> str:
    """A report's string as an inline code span (outside tables)."""
    return md_code(s)


def _cell_code(s) -> str:
    """A report's string as an inline code span inside a table cell."""
    return md_code(s, table=True)


def _engine_words(v: ReportView) -> str:
    eng = v.engine
    if v.engine_recorded:
        return f"the trace's {_md(eng.get('backend'))} log-probs"
    return f"{_md(eng.get('backend'))} {_md(eng.get('dtype'))}"


def _evidence(v: ReportView, c: dict) -> str:
    s = v.search or {}
    u = v.unit_map.get(c["unit"])
    text = (
        f"Swapping {_code(c['unit'])} ({_md(c.get('kind'))}) alone for the reference's module takes {_md(v.metric)} "
        f"from {fmt(num(s.get('baseline')))} to {fmt(num(c.get('alone')))} (threshold {fmt(num(v.threshold))}); "
        f"with every other unit swapped and this one left in, it is {fmt(num(c.get('complement')))}."
    )
    loc = rel(u, "local")
    if loc is not None:
        rank = f", rank {_md(c['local_rank'])} of {len(v.local_ranking)} by own error" if c.get("local_rank") else ""
        text += f" Fed the reference's input, its output differs by rel-L2 {fmt(loc)}{rank}."
    return text


def _title(v: ReportView) -> str:
    arch = v.ref.get("arch") or "?"
    s = v.search or {}
    culprits = v.named_culprits
    if v.aligned:
        what = "aligned"
    elif culprits:
        what = "diverges, culprit " + ", ".join(_code(c["unit"]) for c in culprits)
    elif v.systematic:
        what = "diverges, systematic culprit " + ", ".join(_code(k) for k in v.systematic.get("kinds") or []) + " in every layer"
    elif s.get("verdict") == "diffuse":
        what = "diverges, diffuse (no single culprit)"
    else:
        what = "diverges"
    return (f"numbisect {_md(v.kind)}: {_md(arch)}, engine {_engine_words(v)} vs reference "
            f"{_md(v.ref.get('backend'))} {_md(v.ref.get('dtype'))}: {what}")


def _layer_table(v: ReportView) -> list[str]:
    units = v.units
    layers = sorted({u["layer"] for u in units if isinstance(u.get("layer"), int)})
    if not layers:
        return []
    has_local = any(u.get("local") for u in units)
    side = "local" if has_local else "propagated"
    culprits = [c["unit"] for c in v.named_culprits]
    out = [
        f"| layer | attn ({side}) | MoE / MLP ({side}) | layer output (propagated) | first unit not bitwise equal ({side}) | note |",
        "|---:|---:|---:|---:|---|---|",
    ]
    for i in layers:
        mine = [u for u in units if u.get("layer") == i]
        attn = next((u for u in mine if u.get("kind") == "attn"), None)
        ffn = next((u for u in mine if u.get("kind") in ("moe", "mlp")), None)
        out_u = next((u for u in mine if u.get("kind") == "layer"), None)
        first_ne = next((u["name"] for u in mine if bitwise(u, side) is False), None)
        prefix = f"layers.{i}"
        notes = [f"**culprit** {_cell_code(c)}" for c in culprits if c == prefix or c.startswith(prefix + ".")]
        notes += [f"planted fault {_cell_code(f.get('spec'))}" for f in v.faults if str(f.get("unit", "")).startswith(prefix + ".") or f.get("unit") == prefix]
        out.append(
            f"| {i} | {fmt(rel(attn, side))} | {fmt(rel(ffn, side))} | {fmt(rel(out_u, 'propagated'))} | "
            f"{_cell_code(first_ne) if first_ne else '-'} | {'; '.join(notes)} |"
        )
    return out


def _groups_table(v: ReportView) -> list[str]:
    if not v.groups:
        return []
    out = ["| tokens | count | k3 mean | k3 p99 | k3 max | KL mean | top-1 agree |", "|---|---:|---:|---:|---:|---:|---:|"]
    for g, x in v.groups.items():
        out.append(
            f"| {_md(g)} | {_md(x.get('tokens'))} | {fmt(num(get(x, 'k3', 'mean')))} | {fmt(num(get(x, 'k3', 'p99')))} | "
            f"{fmt(num(get(x, 'k3', 'max')))} | {fmt(num(get(x, 'kl', 'mean')))} | {pct(num(x.get('top1_agree')))} |"
        )
    return out


def _rl_line(v: ReportView) -> str | None:
    c = v.rl_cost
    if not c:
        return None
    t = c.get("thresholds") or {}
    return (
        f"**RL cost:** {pct(num(c.get('seq_frac_rejected')))} of {_md(c.get('sequences'))} sequences would be rejected "
        f"(TIS > {_md(t.get('tis_cap'))}: {pct(num(c.get('seq_frac_tis')))}, IcePop [{_md(t.get('icepop_low'))}, {_md(t.get('icepop_high'))}]: "
        f"{pct(num(c.get('seq_frac_icepop')))}, geometric-mean ratio outside [{_md(t.get('geo_low'))}, {_md(t.get('geo_high'))}]: "
        f"{pct(num(c.get('seq_frac_geo')))}, sequence k3 > {_md(t.get('seq_k3_max'))}: {pct(num(c.get('seq_frac_k3')))}); "
        f"tokens over the TIS cap {pct(num(c.get('token_frac_tis')))}, outside IcePop {pct(num(c.get('token_frac_icepop')))}."
    )


def _search_lines(v: ReportView) -> list[str]:
    s = v.search
    if s is None:
        return []
    if v.swap is not None:
        return [f"**Swap:** {_md(str(line).strip())}  " for line in v.swap_lines]
    out = [f"**Search** ({_md(s.get('strategy'))}): {_md(s.get('trials_used'))} trials; {_md(s.get('stop_reason'))}."]
    for c in v.named_culprits:
        out += ["", f"**Culprit {_code(c['unit'])}:** {_evidence(v, c)}"]
        p = c.get("precision")
        if isinstance(p, dict):
            out += ["", f"**Suggested fix** (precision what-if, measured): {_md(str(p.get('suggested')))}", ""]
            out += [f"- {_code(t.get('whatif'))}: {_md(str(t.get('line')))}" for t in p.get("whatifs") or [] if isinstance(t, dict)]
    if v.systematic:
        out += [""] + [f"{_md(line.strip())}  " for line in systematic_lines(v)]
    if s.get("verdict") == "diffuse":
        out += ["", "**Diffuse:** no set smaller than every layer reaches the threshold. Per-layer contributions:", "",
                "| layer | swapped alone | all others swapped |", "|---|---:|---:|"]
        for name, c in v.contributions.items():
            out.append(f"| {_cell_code(name)} | {fmt(num(get(c, 'alone')))} | {fmt(num(get(c, 'complement')))} |")
        per_kind = v.diffuse_kinds.get("per_kind")
        if isinstance(per_kind, dict) and per_kind:
            out += ["", "Only every kind together fixes it; no proper subset of the kinds does. Per-kind contributions:", "",
                    "| kind | swapped alone | all other kinds swapped |", "|---|---:|---:|"]
            for name, c in per_kind.items():
                out.append(f"| {_cell_code(name)} | {fmt(num(get(c, 'alone')))} | {fmt(num(get(c, 'complement')))} |")
    return out


def _env_lines(v: ReportView) -> list[str]:
    e = v.environment
    out = [
        f"- numbisect {_md(v.tool_version)} (report schema v{_md(v.schema_version)}), created {_md(v.created)}",
        f"- python {_md(e.get('python'))}, torch {_md(e.get('torch'))}, transformers {_md(e.get('transformers'))}, vllm {_md(e.get('vllm'))}",
        f"- {_md(e.get('platform'))} ({_md(e.get('machine'))}), device {_md(e.get('device'))}, {_md(e.get('threads'))} threads, seeds {_md(_kv(e.get('seeds')))}",
    ]
    for side, what in (("ref", "reference"), ("engine", "engine")):
        x = v.side(side)
        sha = x.get("sha256") or {}
        digest = ", ".join(f"{_md(k)} {_md(_short(h))}" for k, h in sha.items()) if isinstance(sha, dict) else _md(_short(sha))
        opts = _opts(x)
        out.append(
            f"- {what}: {_md(x.get('backend'))}:{_code(x.get('path'))} {_md(x.get('dtype') or '')}"
            + (f", options {_code(_kv(opts))}" if opts else "") + (f", sha256 {digest}" if digest else "")
        )
    tr = v.trace
    out.append(f"- trace: {_code(tr.get('path'))}, {_md(tr.get('samples'))} samples, {_md(tr.get('completion_tokens'))} completion tokens, "
               f"sha256 {_md(_short(tr.get('sha256')))}")
    faults = [f.get("spec") for f in v.faults]
    if faults:
        out.append("- planted faults: " + ", ".join(_code(f) for f in faults))

    out += [f"- {_md(line.strip())}" for line in checkpoint_lines(v)]
    return out


def _engine_config_md(v: ReportView) -> list[str]:
    """The `engine_config` section (`--engine-config`): whether the module search saw the
    user's numbers, and the settings changed so hooks could run."""
    ec = v.r.get("engine_config")
    if not isinstance(ec, dict):
        return []
    _, sentence = engine_config_finding(ec, v.aligned, v.value, v.threshold)
    src = f" ({_code(ec.get('file'))})" if ec.get("file") else ""
    changed = ec.get("changed") if isinstance(ec.get("changed"), list) else []
    more = f" Changed so hooks can run: {', '.join(_code(c) for c in changed)}." if changed and ec.get("child") is True else ""
    modes = [f"- {_md(line.strip())}" for line in user_modes_lines(ec.get("engine_modes") if isinstance(ec.get("engine_modes"), dict) else {})]
    return ["", f"**Your engine configuration**{src}: {_md(sentence)}.{more}"] + ([""] + modes if modes else [])


def markdown(r: dict | ReportView) -> str:
    """A Markdown summary of one report, to paste into a GitHub issue; a report's strings
    show as escaped text or code spans (no markup, no control characters of their own)."""
    v = view(r)
    differs = checkpoint_differs(v.checkpoint_diff)
    held = weights_differ(v)
    word = (("tokens aligned, engine weights DIFFER" if held else "tokens aligned, checkpoints DIFFER" if differs else "aligned")
            if v.aligned else "DIVERGED")
    verdict = (
        f"**Verdict: {word}.** {_md(v.metric)} over {_md(v.group)} tokens is "
        f"{fmt(num(v.value))}, {'at or under' if v.aligned else 'above'} the threshold {fmt(num(v.threshold))}."
        + (" The engine's checkpoint differs from the reference's (below): not the same model." if v.aligned and differs else "")
    )
    parts = [f"### {_title(v)}", "", verdict]

    cl = contract_lines(v)
    if v.logprob_contract.get("verdict") == "processed":  # the first finding, before any numeric one
        parts += ["", f"**First finding: the log-prob contract.** {_md(cl[0].removeprefix('!! log-prob contract: '))}"]
        parts += [f"{_md(x.strip())}" for x in cl[1:]]
    elif cl:
        parts += ["", _md(cl[0])]
    parts += _engine_config_md(v)
    parts += weights_md(v, code=_code, text=_md)  # a weight check's report: which units hold other weights
    sl = _search_lines(v)
    if sl:
        parts += [""] + sl
    errs = v.post_search_errors
    if errs:  # steps after the search that failed; its result above stands
        parts += ["", "**Failed after the search** (the search's result stands):", ""]
        parts += [f"- {_md(e.get('step'))}{' for ' + _code(e.get('unit')) if e.get('unit') else ''}: {_code(e.get('error'))}"
                  for e in errs]
    lt = _layer_table(v)
    if lt:
        parts += ["", "Per layer, relative L2 error of the engine against the reference "
                      "(local: the engine unit fed the reference's input; propagated: each side on its own inputs):", ""] + lt
        fd = v.first_divergence
        if fd:
            parts += ["", f"First unit not bitwise equal: {_code(fd.get('bitwise')) if fd.get('bitwise') else 'none'}; "
                          f"first above rel-L2 {fmt(num(v.unit_tol))}: {_code(fd.get('above_tol')) if fd.get('above_tol') else 'none'}."]
    parts += state_md(v)  # linear attention's recurrent state, per layer
    gt = _groups_table(v)
    if gt:
        parts += [""] + gt
    rl = _rl_line(v)
    if rl:
        parts += ["", rl]
    parts += decode_md(v)
    parts += ["", "<details><summary>Environment and inputs</summary>", ""] + _env_lines(v) + ["", "</details>"]
    if v.command:
        line = shlex.join(str(x) for x in v.command)
        fence = "`" * max([3] + [len(run) + 1 for run in re.findall(r"`{3,}", line)])
        parts += ["", "To reproduce:", "", f"{fence}sh", line, fence]
    return printable_text("\n".join(parts) + "\n")

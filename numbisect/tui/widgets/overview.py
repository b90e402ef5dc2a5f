"""Overview: inputs, the verdict (k3 mean / p99 / max against the threshold), the RL
cost, the token groups and the first divergence (of a linear-attention layer's recurrent
state too); for a conditions report, its settings, atoms, cost against the
reference and localisation (`widgets/conditions.py`) in place of the RL cost; for a report
of `compare` / `run --engine-config`, where each part ran and whether the module search saw
your numbers (`widgets/engine_config.py`), before the RL cost; for a weight check's report,
the units whose engine weights differ (`report.sections.weights`)."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from numbisect.common.formatting import fmt, num, pct
from numbisect.report.sections.recurrent import first_lines
from numbisect.report.sections.weights import render_lines as weights_lines
from numbisect.report.summary import header, search_lines, token_table
from numbisect.report.view import ReportView, view
from numbisect.tui import model as M
from numbisect.tui.widgets.conditions import conditions_text
from numbisect.tui.widgets.engine_config import engine_config_text


def overview_text(r: dict | ReportView) -> Text:
    rv = view(r)
    t = Text()
    g = rv.groups.get(rv.group) or {}
    for line in header(rv)[:-1]:  # the verdict line is drawn below, with its numbers
        t.append(line + "\n", style="dim")
    mark, style, _ = M.verdict_line(rv)
    cond = M.conditions_of(rv) is not None
    t.append("\n")
    t.append(mark, style=style)
    against = " against the known-good configuration" if cond else ""
    t.append(f"  judged on {M.metric_words(rv.metric)} of {rv.group} tokens{against}, threshold {fmt(rv.threshold)}\n")
    if g:
        k3 = g["k3"]
        t_num = num(rv.threshold)
        for key, label in (("mean", "k3 mean"), ("p99", "k3 p99 "), ("max", "k3 max ")):
            v = k3.get(key)
            v_num = num(v)
            over = v_num is not None and t_num is not None and (v_num > t_num or v_num != v_num)  # NaN counts as over
            sym = ">" if over else "<="
            t.append(f"  {label} {fmt(v):>10}  {sym} {fmt(rv.threshold)}  ")
            t.append("over\n" if over else "under\n", style="red" if over else "green")
        if g.get("kl"):
            t.append(f"  KL mean {fmt(g['kl'].get('mean')):>10}   top-1 agreement {pct(g.get('top1_agree'))}\n")
    if M.engine_config_of(rv) is not None:
        t.append("\n")
        t.append(engine_config_text(rv))
    wl = weights_lines(rv)  # a weight check's report (`bisect weights`, numbisect.live)
    if wl:
        ok = len(wl) == 1 and ": all ok" in wl[0]
        t.append("\n" + wl[0] + "\n", style="green" if ok else "bold red")
        for line in wl[1:]:
            t.append(line + "\n")
    c = rv.rl_cost
    if cond:  # a conditions report: its own sections; the tokens below are yours vs the known-good
        t.append("\n")
        t.append(conditions_text(rv))
    elif c:
        tt = c["thresholds"]
        t.append("\nRL cost ", style="bold")
        t.append(f"({c['sequences']} sequences, {c['tokens']} tokens)\n")
        t.append(f"  sequences rejected   {pct(c['seq_frac_rejected']):>7}", style="bold")
        t.append("   (any rule below)\n")
        rules = [
            (f"TIS ratio > {tt['tis_cap']}", c["seq_frac_tis"]),
            (f"IcePop outside [{tt['icepop_low']}, {tt['icepop_high']}]", c["seq_frac_icepop"]),
            (f"geo-mean outside [{tt['geo_low']}, {tt['geo_high']}]", c["seq_frac_geo"]),
            (f"sequence k3 > {tt['seq_k3_max']}", c["seq_frac_k3"]),
        ]
        for label, v in rules:
            t.append(f"    {label:<30}{pct(v):>7}\n")
        t.append(f"  tokens over TIS cap {pct(c['token_frac_tis'])}, outside IcePop {pct(c['token_frac_icepop'])}\n")
    t.append("\nToken groups" + (" (yours against the known-good configuration)" if cond else "") + "\n", style="bold")
    for line in token_table(rv):
        t.append("  " + line + "\n")
    sc = rv.self_check
    if sc:
        ok = "passed" if sc["passed"] else "FAILED"
        t.append(f"\nswap self-check {ok}: every unit swapped gives k3 {fmt(sc['k3_mean'])}\n")
    fd = rv.first_divergence
    if fd:
        t.append(
            f"first divergence: {fd.get('bitwise') or 'none'} (not bitwise equal); "
            f"{fd.get('above_tol') or 'none'} (over rel-L2 {fmt(rv.unit_tol)})\n"
        )
    if rv.recurrent_state:  # linear attention: where the state first drifts; per layer in the unit detail
        t.append("recurrent state: " + "; ".join(first_lines(rv.recurrent_state, rv.unit_tol)) + " (each layer's: Units tab)\n")
    sl = search_lines(rv)
    if sl:
        t.append("\n" + "\n".join(sl) + "\n")
    return t


class OverviewPanel(Static):
    def show(self, report: dict | None, note: str = "") -> None:
        self.update(overview_text(report) if report else Text(note or "no report yet"))

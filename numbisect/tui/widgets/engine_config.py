"""The Overview's section for a report of `compare` / `run --engine-config FILE`: whether
the module search saw your numbers (the hookable configuration's log-probs against yours),
where each part ran, both configurations against the reference, your settings against the
hookable ones, the custom ops your engine reported, and the log-prob contract of the
tokens your engine sampled. Reads the report through `numbisect.tui.model`."""

from __future__ import annotations

from rich.text import Text

from numbisect.common.formatting import fmt, num, pct
from numbisect.report.view import ReportView, view
from numbisect.tui import model as M
from numbisect.tui.widgets.conditions import cell, pairs


def _against_reference(t: Text, rv: ReportView, ec: dict) -> None:
    """Yours (the report's verdict) and the hookable configuration's own, against the reference."""
    hb = M.section(ec, "hookable_baseline")
    t.append(f"\n  {cell('against the reference', 24)} {'value':>10}  {cell('verdict', 9)} {'rejected':>8}\n", style="dim")
    rows = [("yours", rv.value, "aligned" if rv.aligned else "diverged", rv.rl_cost.get("seq_frac_rejected"))]
    if ec.get("child") is True:
        rows.append(("hookable", hb.get("value"), hb.get("verdict"), hb.get("seq_frac_rejected")))
    for label, value, verdict, rej in rows:
        t.append(f"  {cell(label, 24)} {fmt(value):>10}  ")
        t.append(cell(str(verdict), 9), style="green" if verdict == "aligned" else "red" if verdict == "diverged" else "")
        t.append(f" {pct(rej):>8}\n")
    vs = M.section(ec, "hookable_vs_user")
    if vs:
        same = "bitwise equal" if vs.get("bitwise") is True else "not bitwise equal" if vs.get("bitwise") is False else "?"
        t.append(f"  hookable vs yours: {same} (k3 {fmt(vs.get('k3_mean'))}, max |diff| {fmt(vs.get('max_abs_diff'))})\n")


def _contract(t: Text, rv: ReportView) -> None:
    """The log-prob contract fitted on the tokens the user's engine sampled, when present."""
    c = rv.logprob_contract
    if not c.get("verdict") or c.get("source") != "engine_config":
        return
    fit = M.section(c, "fitted")
    t.append("\nLog-prob contract (tokens your engine sampled, with your sampling and logprobs_mode)\n", style="bold")
    if c.get("verdict") == "processed":
        t.append("  !! processed: ", style="bold red")
        t.append(f"{c.get('advice')}\n")
    else:
        t.append(f"  {c.get('verdict')}", style="green" if c.get("verdict") == "raw" else "yellow")
        t.append(f": {c.get('advice')}\n" if c.get("advice") else "\n")
    t.append(f"  fitted on {c.get('positions')} tokens: mean |log-prob error| {fmt(c.get('raw_error'))} as raw, "
             f"{fmt(c.get('fit_error'))} as processed (temperature {fmt(fit.get('temperature'))}, top-p {fmt(fit.get('top_p'))}, "
             f"top-k {fit.get('top_k') or 'off'})\n", style="dim")


def engine_config_text(r: dict | ReportView) -> Text:
    rv = view(r)
    ec = M.engine_config_of(rv) or {}
    t = Text()
    src = f" ({ec.get('file')})" if ec.get("file") else ""
    t.append(f"Your engine configuration{src}\n", style="bold")
    mark, style, sentence = M.engine_config_finding(rv)
    t.append(f"  {mark} ", style=style)
    t.append(sentence + "\n", style=style if mark == "!!" else "")
    parts = M.engine_part_rows(ec)
    if parts:
        t.append(f"\n  {cell('part', 46)} ran in\n", style="dim")
        secs = num(ec.get("seconds"))
        for part, where in parts:
            extra = f" (child process{f', {secs:.1f} s' if secs is not None else ''})" if where == "your settings" and ec.get("child") is True else ""
            t.append(f"  {cell(part, 46)} {where}{extra}\n")
        if ec.get("child") is True:
            t.append("  the verdict, the RL cost and the Tokens tab are yours; the Units and Trials tabs the hookable "
                     "configuration's\n", style="dim")
    _against_reference(t, rv, ec)
    pairs(t, "Your settings against the hookable ones (≠: changed so hooks can run; ~: written out, the same in effect)", M.engine_settings_rows(ec),
          width=24, other="hookable")
    on, off = M.engine_op_rows(ec)
    if on or off:
        t.append("\nCustom ops, as your engine reported them\n", style="bold")
        t.append(f"  on:  {', '.join(on) or 'none'}\n  off: {', '.join(off) or 'none'}\n")
    _contract(t, rv)
    return t

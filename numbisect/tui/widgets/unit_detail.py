"""What one unit did: its propagated and local error, bitwise / ulps, worst token, its
routing (a router) or recurrent state (a linear-attention layer), the trials that swapped
it, and manual swap trials run on it in live mode."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from numbisect.common.formatting import fmt, num
from numbisect.report.sections import recurrent as RR
from numbisect.report.sections.routing import flip_line
from numbisect.report.view import view as report_view
from numbisect.tui import model as M


def _metrics_block(t: Text, title: str, m: dict | None, active: bool) -> None:
    t.append(("> " if active else "  ") + title, style="bold" if active else "")
    if not m:
        t.append(": not measured\n", style="dim")
        return
    t.append("\n")
    ul = m.get("ulps") or {}
    eq = "bitwise identical" if ul.get("bitwise_equal") else f"{100 * (ul.get('frac_differ') or 0):.1f}% of elements differ"
    t.append(f"    rel-L2 {fmt(m.get('rel_l2'))}  max abs {fmt(m.get('max_abs'))}  cosine {fmt(m.get('cosine'), 4)}\n")
    t.append(f"    SQNR {fmt(m.get('sqnr_db'))} dB  worst-token rel {fmt(m.get('token_rel_max'))}\n")
    mu = ul.get("max_ulps")
    t.append(f"    {eq}" + (f", max {mu} ulps" if mu is not None else "") + "\n")
    wt = m.get("worst_token")
    if isinstance(wt, dict):
        t.append(f"    worst token: sample {wt.get('sample')} token {wt.get('token')}\n")


def _routing_block(t: Text, report: dict, name: str, flips: int = 8) -> None:
    """Expert-set agreement and flips of the MoE layer a router (or MoE block) belongs to."""
    router = name if name.endswith(".moe.router") else (name + ".router" if name.endswith(".moe") else None)
    row = next((r for r in (report_view(report).routing or {}).get("layers") or [] if r["unit"] == router), None)
    if row is None:
        return
    t.append("\nrouting (top-k expert sets)\n", style="bold")
    for side in ("propagated", "local"):
        p = row.get(side)
        if not p:
            continue
        err = num((p.get("logit_error") or {}).get("rel_l2"))
        t.append(f"  {side}: {100 * (num(p.get('agree_frac')) or 0):.1f}% agree, {p.get('flipped')} of {p.get('tokens')} tokens flipped, logit rel-L2 {fmt(err)}\n")
        if p.get("flipped"):
            t.append(f"    margin p50 {fmt(num(p.get('margin_p50_all')))} over all tokens, {fmt(num(p.get('margin_p50_flipped')))} at flips\n")
    p = row.get("propagated") or {}
    for f in (p.get("flips") or [])[:flips]:
        t.append("  flip " + flip_line(f) + "\n")
    more = (p.get("flipped") if isinstance(p.get("flipped"), int) else 0) - min(flips, len(p.get("flips") or []))
    if more > 0:
        t.append(f"  ... {more} more flips (bisect report show)\n", style="dim")
    rr = report_view(report).routing_replay
    lay = next((x for x in (rr or {}).get("layers") or [] if x["unit"] == router), None)
    if lay and num(lay.get("value_replayed_alone")) is not None:
        t.append(
            f"  replay ({rr['direction']}) here alone: {lay['flips_before']} flips -> {lay.get('flips_after_alone')}, "
            f"{M.metric_words(str(rr.get('metric', 'k3')))} {fmt(num(rr['baseline']))} -> {fmt(num(lay['value_replayed_alone']))}\n"
        )


# A linear-attention layer's state passes (recurrent_state rows): what each is, where its
# final state is taken, and what its points (by tokens) are.
STATE_PASSES = (
    ("propagated", "on its own inputs", "after the sample", "every chunk"),
    ("local", "fed the reference's input", "after the sample", "every chunk"),
    ("decode", "run as a rollout, one token per step", "after the last step", "after the prompt and steps"),
)


def _state_block(t: Text, report: dict, name: str, cap: int = 8) -> None:
    """The recurrent state of a linear-attention layer (numbisect.pipeline.recurrent): its rel-L2
    after the sample on each pass and along the sequence, whether it is the first layer
    above the unit tolerance, and its decode points not read. Read as `report show` reads
    them (numbisect.report.sections.recurrent)."""
    rs = report_view(report).recurrent_state
    row = next((x for x in RR.layers(rs) if x.get("unit") == name), None)
    if row is None:
        return
    t.append("\nrecurrent state (rel-L2 against the reference's state after the same tokens)\n", style="bold")
    for key, what, end, along in STATE_PASSES:
        if isinstance(row.get(key), dict):
            t.append(f"  {key} ({what}): {end} {fmt(RR.final(row, key))}\n")
            t.append(f"    {along}, by tokens: {RR.trend(RR.points(row, key), cap)}\n", style="dim")
    tol = M.unit_tol(report)
    for field, when in (("first_above_tol", ""), ("first_above_tol_decode", " after decode steps")):
        if rs.get(field) == name:
            t.append(f"  the first linear-attention layer whose state is above rel-L2 {fmt(tol)}{when}\n", style="bold yellow")
    mine = [u for u in RR.unread(rs) if u.startswith(name + "@")]
    if mine:
        t.append(f"  decode states not read (not measured): {RR.few(mine)}\n", style="yellow")


def detail_text(report: dict, name: str, view: str, trials: list[dict], manual: list[dict]) -> Text:
    t = Text()
    if name == "model" or not name:
        t.append("model", style="bold")
        t.append("\nSelect a unit (arrows, mouse) to see its error, the trials that swapped it and its worst token.\n")
        t.append("\n" + M.legend(M.unit_tol(report)) + "\n", style="dim")
        return t
    rv = report_view(report)
    u = rv.unit(name)
    if u is None:
        t.append(f"{name}: not in this report\n")
        return t
    tol = M.unit_tol(report)
    key, vs, _ = M.unit_severity(u, view, tol)
    sym, style, meaning = M.SEVERITY[key]
    t.append(name, style="bold")
    t.append(f"  ({u['kind']})\n")
    t.append(f"{sym} {vs}: {meaning} ({view}, tolerance {fmt(tol)})\n", style=style)
    for c in rv.culprits:
        if c["unit"] == name:
            s = rv.search or {}
            t.append(
                f"{M.CULPRIT_MARK} CULPRIT: alone {fmt(s.get('baseline'))} -> {fmt(c['alone'])}; "
                f"all others swapped {fmt(c['complement'])}\n",
                style="bold magenta",
            )
            p = c.get("precision")
            if isinstance(p, dict):
                t.append(f"suggested fix: {p.get('suggested')}\n", style="bold")
                for w in p.get("whatifs") or []:
                    if isinstance(w, dict):
                        t.append(f"  {w.get('whatif')}: {w.get('line')}\n")
    rank = rv.local_ranking.get(name)
    if rank:
        t.append(f"local-error rank {rank} of {len(rv.local_ranking)}\n")
    _metrics_block(t, "propagated", u.get("propagated"), view == "propagated")
    _metrics_block(t, "local (teacher-forced)", u.get("local"), view == "local")
    _routing_block(t, report, name)
    _state_block(t, report, name)
    hits = M.trials_with(trials, report, name)
    th = rv.threshold
    t.append(f"\ntrials that swapped it: {len(hits)}\n", style="bold")
    for tr, how in hits:
        fixed = M.value_mark(tr["value"], th)
        how = "" if how == "itself" else f" ({how})"
        t.append(f"  #{tr['index']} {tr['role']}: {fmt(tr['value'])} {fixed}".rstrip() + how + "\n")
    if manual:
        t.append("\nmanual swap trials\n", style="bold")
        for m in manual:
            verdict = "under the threshold" if m["fixed"] else "still over"
            t.append(f"  {m['label']}: {M.metric_words(m['metric'])} {fmt(m['before'])} -> {fmt(m['after'])} ({verdict})\n")
    return t


class UnitDetail(Static):
    def show(self, report: dict | None, name: str, view: str, trials: list[dict], manual: list[dict]) -> None:
        if report is None:
            self.update("")
            return
        self.update(detail_text(report, name, view, trials, manual))

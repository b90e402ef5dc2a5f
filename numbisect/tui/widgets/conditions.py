"""The Overview of a `bisect conditions` report: your settings against the known-good
ones, the custom ops as the engines reported them, every atom's result alone, both
configurations against the reference (RL cost), the search, and the units a guilty
custom op changes (localisation; under the compiled path also how much of it those units
compiled alone reproduce, the text summary's line). Reads the report through
`numbisect.tui.model`."""

from __future__ import annotations

from rich.text import Text

from numbisect.common.formatting import fmt
from numbisect.report.sections.conditions import (
    chained_line,
    localisations_of,
    localised_what,
)
from numbisect.report.view import ReportView, view
from numbisect.tui import model as M


def cell(s: str, width: int) -> str:
    """`s` in a column of `width` (cut with an ellipsis when longer)."""
    return (s if len(s) <= width else s[: width - 1] + "…").ljust(width)


def pairs(t: Text, title: str, rows: list[tuple[str, str, str, str]], width: int = 28, other: str = "known-good") -> None:
    """A table of (mark, name, yours, the other configuration's), the differing rows marked."""
    t.append(f"\n{title}\n", style="bold")
    t.append(f"  {'':2}{cell('', width)} {cell('yours', 34)} {other}\n", style="dim")
    for mark, name, a, b in rows:
        differs = mark == "≠"
        t.append(f"  {mark} {cell(name, width)} ", style="bold" if differs else "")
        t.append(cell(a, 34) + " ", style="yellow" if differs else "")
        t.append(b + "\n")


def conditions_text(r: dict | ReportView) -> Text:
    rv = view(r)
    cond = M.conditions_of(rv) or {}
    t = Text()
    s = M.section(cond, "search")
    t.append(f"search: {s.get('verdict')} after {s.get('trials_used')} trials: {s.get('stop_reason')}\n")
    pairs(t, "Settings (≠: differs, an atom below; ~: written differently, the same in effect)", M.settings_rows(cond))
    ops = M.op_rows(cond)
    if ops:
        pairs(t, "Custom ops, as the engines reported them", ops)

    atoms = M.atom_rows(cond)
    t.append("\nAtoms, each alone in your state (every other one reverted)\n", style="bold")
    if not atoms:
        t.append("  none: your settings do not differ from the known-good ones\n", style="dim")
    else:
        t.append(f"  {cell('atom', 32)} {'alone k3':>9}  {cell('result', 25)} {'vs ref k3':>9} {'rejected':>8}\n", style="dim")
        for a in atoms:
            t.append(f"  {cell(a['atom'], 32)} {a['alone']:>9}  ")
            t.append(cell(a["result"], 25), style=a["style"])
            t.append(f" {a['ref_k3']:>9} {a['ref_rejected']:>8}\n")
            if a["description"]:
                t.append(f"    {a['description']}\n", style="dim")
        t.append("  alone k3: mean completion k3 against the known-good configuration (0: bitwise equal);"
                 " vs ref: the same run against the reference\n", style="dim")

    ref = M.reference_rows(cond)
    if ref:
        t.append("\nAgainst the reference (completion k3 mean, then the fraction of sequences an RL rule rejects)\n", style="bold")
        t.append(f"  {cell('', 11)}" + "".join(f"{c:>10}" for c in M.REFERENCE_COLUMNS) + "\n", style="dim")
        for label, cells in ref:
            t.append(f"  {cell(label, 11)}" + "".join(f"{c:>10}" for c in cells) + "\n")

    for loc in localisations_of(cond):
        t.append(f"\nLocalisation under {loc.get('atom')}\n", style="bold")
        if loc.get("done") is not True:
            t.append(f"  not localised: {loc.get('why')}\n", style="yellow")
        else:
            named = loc.get("named") if isinstance(loc.get("named"), list) else []
            t.append(f"  units {localised_what(loc)}: ")
            t.append((", ".join(map(str, named)) or "none") + "\n", style="bold magenta" if named else "green")
            chain = chained_line(loc.get("units_chained"))  # the summary's line: how much of the compiled path they carry
            if chain:
                t.append(f"  {chain}\n")
            if loc.get("method"):
                t.append(f"  {loc.get('method')}\n", style="dim")
            rows = M.localisation_rows(cond, loc)
            if rows:
                t.append(f"  {cell('unit', 28)} {cell('local output', 13)} {'rel-L2':>9} {'max abs':>9}\n", style="dim")
                for u in rows:
                    t.append(f"  {cell(u['unit'], 28)} ")
                    t.append(cell(u["state"], 13), style="green" if u["equal"] else "yellow")
                    t.append(f" {u['rel_l2']:>9} {u['max_abs']:>9}\n")
    t.append(f"\nTrials tab: the search's trials (atoms reverted, k3 vs the known-good configuration, "
             f"RL cost vs the reference); threshold {fmt(rv.threshold)}\n", style="dim")
    return t

"""Trials: the search log as a table that fills in live, and a sparkline of the judged
value across trials (log10). A conditions report's trials revert atoms (settings) to the
known-good state: their table adds each trial's RL cost against the reference."""

from __future__ import annotations

import math

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import DataTable, Sparkline, Static

from numbisect.common.formatting import fmt, num
from numbisect.tui import model as M

COLUMNS = ("#", "role", "n", "value", "", "swapped")
CONDITION_COLUMNS = ("#", "role", "n", "k3 vs good", "", "rejected", "reverted to the known-good state")


def role(t: dict) -> str:
    """A trial's role (absent in some reports: "-")."""
    return str(t.get("role") or "-")


def log10_floor(v, floor: float) -> float:
    """log10 of a value, floored (0 and 1000x under the threshold draw the same)."""
    x = num(v)
    if x is None or math.isnan(x) or x <= 0:
        return floor
    return max(floor, math.log10(min(x, 1e300)))  # inf draws as the largest float


def trial_text(t: dict, threshold: float, metric: str) -> Text:
    """One trial in full: every swapped unit and each group's numbers."""
    out = Text()
    fixed = M.value_mark(t["value"], threshold) == "fixed"
    out.append(f"trial {t['index']} ({role(t)})\n", style="bold")
    out.append(f"{metric} {fmt(t['value'])} ", style="green" if fixed else "red")
    out.append("<= threshold: fixed\n" if fixed else "> threshold\n")
    metrics = t.get("metrics") if isinstance(t.get("metrics"), dict) else {}
    groups = metrics.get("groups") if isinstance(metrics.get("groups"), dict) else {}
    for g, v in groups.items():
        v = v if isinstance(v, dict) else {}
        out.append(f"  {g:<11} k3 mean {fmt(v.get('k3_mean')):>9}  p99 {fmt(v.get('k3_p99')):>9}\n")
    rej = num(metrics.get("seq_frac_rejected"))
    if rej is not None:
        out.append(f"  sequences rejected {100 * rej:.1f}%\n")
    out.append(f"swapped ({len(t['swapped'])}):\n", style="bold")
    for name in t["swapped"]:
        out.append(f"  {name}\n")
    return out


def condition_trial_text(t: dict, threshold: float) -> Text:
    """One trial of a conditions search in full: the atoms reverted, k3 against the
    known-good configuration, the same run against the reference (RL cost), its settings."""
    out = Text()
    fixed = M.value_mark(t["value"], threshold) == "fixed"
    metrics = t.get("metrics") if isinstance(t.get("metrics"), dict) else {}
    out.append(f"trial {t['index']} ({role(t)})\n", style="bold")
    out.append(f"k3 vs the known-good configuration {fmt(t['value'])} ", style="green" if fixed else "red")
    out.append("<= threshold: as good as the known-good\n" if fixed else "> threshold\n")
    if metrics.get("bitwise_equal_good") is not None:
        eq = metrics.get("bitwise_equal_good") is True
        out.append(f"  log-probs bitwise equal to the known-good: {'yes' if eq else 'no'}"
                   + ("" if eq else f" (max |diff| {fmt(metrics.get('max_abs_diff_good'))})") + "\n")
    ref = M.trial_reference(t)
    if ref:
        out.append("against the reference\n", style="bold")
        for label, cell in zip(M.REFERENCE_COLUMNS, M.reference_cells(ref)):
            out.append(f"  {label:<9} {cell:>9}\n")
    out.append(f"reverted to the known-good state ({len(t['swapped'])}):\n", style="bold")
    for name in t["swapped"]:
        out.append(f"  {name}\n")
    settings = metrics.get("settings")
    if isinstance(settings, dict) and settings:
        out.append("settings this trial ran with:\n", style="bold")
        for k in sorted(settings, key=str):
            out.append(f"  {k} = {M.setting_text(settings[k])}\n")
    return out


class TrialsPanel(Vertical):
    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.trials: list[dict] = []
        self.threshold = 1e-3
        self.metric = "k3-mean"
        self.universe: list[str] = []
        self.conditions = False  # the trials of a conditions search (atoms reverted)
        self.note = ""  # the caption's end: which configuration the trials ran in

    def compose(self) -> ComposeResult:
        yield Static("", id="trials-caption")
        yield Sparkline([], id="trials-spark")
        with Horizontal(id="trials-body"):
            yield DataTable(id="trials-table", cursor_type="row", zebra_stripes=True)
            with VerticalScroll(id="trial-detail-scroll"):
                yield Static("", id="trial-detail")

    def on_mount(self) -> None:
        self.query_one(DataTable).add_columns(*COLUMNS)

    def reset(self, trials: list[dict], threshold: float, metric: str, universe: list[str], conditions: bool = False,
              note: str = "") -> None:
        """Show `trials`; `note` ends the caption (which configuration the trials ran in)."""
        self.threshold, self.metric, self.universe, self.note = threshold, metric, universe, note
        self.trials = []
        table = self.query_one(DataTable)
        if conditions != self.conditions:
            self.conditions = conditions
            table.clear(columns=True)
            table.add_columns(*(CONDITION_COLUMNS if conditions else COLUMNS))
        table.clear()
        for t in trials:
            self.add_trial(t, redraw=False)
        self._redraw()

    def add_trial(self, t: dict, redraw: bool = True) -> None:
        self.trials.append(t)
        fixed = M.value_mark(t["value"], self.threshold)
        cells = [
            Text(str(t["index"])),
            Text(role(t)),  # Text, not str: a DataTable reads a str cell as markup
            Text(str(len(t["swapped"]))),
            Text(fmt(t["value"]), style="green" if fixed == "fixed" else "red"),
            Text(fixed, style="green"),
        ]
        if self.conditions:
            cells.append(Text(M.reference_cells(M.trial_reference(t))[1], justify="right"))
            cells.append(Text(M.abbreviate(t["swapped"], self.universe, width=60) if t["swapped"] else "nothing (your settings)"))
        else:
            cells.append(Text(M.abbreviate(t["swapped"], self.universe, width=60)))
        self.query_one(DataTable).add_row(*cells, key=f"{len(self.trials) - 1}")
        if redraw:
            self._redraw()
            self.query_one(DataTable).move_cursor(row=len(self.trials) - 1)

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        key = event.row_key.value if event.row_key is not None else None
        # rows are keyed by their position: a report may repeat a trial index
        t = self.trials[int(key)] if key is not None and key.isdigit() and int(key) < len(self.trials) else None
        if t is None:
            self.query_one("#trial-detail", Static).update("")
        elif self.conditions:
            self.query_one("#trial-detail", Static).update(condition_trial_text(t, self.threshold))
        else:
            self.query_one("#trial-detail", Static).update(trial_text(t, self.threshold, self.metric))

    def _redraw(self) -> None:
        spark = self.query_one(Sparkline)
        spark.styles.width = max(12, 4 * len(self.trials))
        floor = math.log10(self.threshold) - 3 if 0 < self.threshold < math.inf else -12.0
        spark.data = [log10_floor(t["value"], floor) for t in self.trials]
        spark.display = bool(self.trials)
        n_fixed = sum(1 for t in self.trials if M.value_mark(t["value"], self.threshold) == "fixed")
        what = "k3 vs the known-good" if self.conditions else self.metric
        cap = (
            f"{len(self.trials)} trials, {n_fixed} under the threshold {fmt(self.threshold)}; "
            f"sparkline: log10 {what} per trial"
            + ("; rejected: sequences an RL rule rejects, against the reference" if self.conditions else "")
            if self.trials
            else "no trials (yet): a compare report has none; in live mode they appear as the search runs"
        ) + self.note
        self.query_one("#trials-caption", Static).update(Text(cap, style="dim"))

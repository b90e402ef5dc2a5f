"""Trials: the search log as a table that fills in live, and a sparkline of the judged
value across trials (log10)."""

from __future__ import annotations

import math

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import DataTable, Sparkline, Static

from numbisect.formatting import fmt, num
from numbisect.tui import model as M

COLUMNS = ("#", "role", "n", "value", "", "swapped")


def role(t: dict) -> str:
    """A trial's role (absent in some reports: "-")."""
    return str(t.get("role") or "-")


def _log(v, floor: float) -> float:
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


class TrialsPanel(Vertical):
    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.trials: list[dict] = []
        self.threshold = 1e-3
        self.metric = "k3-mean"
        self.universe: list[str] = []

    def compose(self) -> ComposeResult:
        yield Static("", id="trials-caption")
        yield Sparkline([], id="trials-spark")
        with Horizontal(id="trials-body"):
            yield DataTable(id="trials-table", cursor_type="row", zebra_stripes=True)
            with VerticalScroll(id="trial-detail-scroll"):
                yield Static("", id="trial-detail")

    def on_mount(self) -> None:
        self.query_one(DataTable).add_columns(*COLUMNS)

    def reset(self, trials: list[dict], threshold: float, metric: str, universe: list[str]) -> None:
        self.threshold, self.metric, self.universe = threshold, metric, universe
        self.trials = []
        self.query_one(DataTable).clear()
        for t in trials:
            self.add_trial(t, redraw=False)
        self._redraw()

    def add_trial(self, t: dict, redraw: bool = True) -> None:
        self.trials.append(t)
        fixed = M.value_mark(t["value"], self.threshold)
        self.query_one(DataTable).add_row(
            Text(str(t["index"])),
            Text(role(t)),  # Text, not str: a DataTable reads a str cell as markup
            Text(str(len(t["swapped"]))),
            Text(fmt(t["value"]), style="green" if fixed == "fixed" else "red"),
            Text(fixed, style="green"),
            Text(M.abbreviate(t["swapped"], self.universe, width=60)),
            key=f"{len(self.trials) - 1}",
        )
        if redraw:
            self._redraw()
            self.query_one(DataTable).move_cursor(row=len(self.trials) - 1)

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        key = event.row_key.value if event.row_key is not None else None
        # rows are keyed by their position: a report may repeat a trial index
        t = self.trials[int(key)] if key is not None and key.isdigit() and int(key) < len(self.trials) else None
        self.query_one("#trial-detail", Static).update(trial_text(t, self.threshold, self.metric) if t else "")

    def _redraw(self) -> None:
        spark = self.query_one(Sparkline)
        spark.styles.width = max(12, 4 * len(self.trials))
        floor = math.log10(self.threshold) - 3 if 0 < self.threshold < math.inf else -12.0
        spark.data = [_log(t["value"], floor) for t in self.trials]
        spark.display = bool(self.trials)
        n_fixed = sum(1 for t in self.trials if M.value_mark(t["value"], self.threshold) == "fixed")
        cap = (
            f"{len(self.trials)} trials, {n_fixed} under the threshold {fmt(self.threshold)}; "
            f"sparkline: log10 {self.metric} per trial"
            if self.trials
            else "no trials (yet): a compare report has none; in live mode they appear as the search runs"
        )
        self.query_one("#trials-caption", Static).update(Text(cap, style="dim"))

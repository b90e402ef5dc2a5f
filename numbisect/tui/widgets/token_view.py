"""Token view: one heat strip of per-token k3 per sample, a group filter, the worst tokens.

A strip cell is a block whose height is the decade of k3 relative to the threshold
(readable without colour). For the completion (prompt) group only those positions are
drawn; for `all` and trace groups every position is, `·` outside the group and `|`
between prompt and completion.
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import Select, Static

from numbisect.common.formatting import fmt
from numbisect.tui import model as M

LEVEL_STYLES = ["green", "green", "green", "green", "yellow", "red", "bold red", "bold red"]


def strips_text(td: M.TokenData, group: str) -> Text:
    t = Text(no_wrap=True, overflow="ellipsis")
    if not td.per_sample:
        t.append("no per-token values in this report", style="italic")
        return t
    for i, ps in enumerate(td.per_sample):
        vals = td.values(i, group)
        mean = sum(vals) / len(vals) if vals else None
        over = mean is not None and (mean > td.threshold or mean != mean)  # NaN counts as over
        t.append(f"#{ps['sample']:<3}", style="bold")
        t.append(f"{fmt(mean):>9}{'!' if over else ' '} ", style="red" if over else "")
        only_group = group in ("completion", "prompt")  # the other part would be all `·`
        for j, (v, m) in enumerate(zip(td.k3(i), td.mask(i, group))):
            if only_group and not m:
                continue
            if j + 1 == ps["prompt_len"] and not only_group:
                t.append("|", style="dim")
            if not m or v is None:
                t.append("·", style="dim")
                continue
            lv = td.level(v)
            t.append(M.HEAT_CHARS[lv], style=LEVEL_STYLES[lv])
        t.append("\n")
    return t


def worst_text(td: M.TokenData, group: str, k: int = 10) -> Text:
    t = Text()
    t.append(f"worst {group} tokens\n", style="bold")
    t.append(f"{'smp':>4}{'pos':>5}{'id':>5}{'k3':>10}\n", style="dim")
    for w in td.worst(group, k):
        over = w["value"] > td.threshold or w["value"] != w["value"]
        tid = "-" if w["token_id"] is None else str(w["token_id"])
        t.append(f"{w['sample']:>4}{w['position']:>5}{tid:>5}{fmt(w['value']):>10}")
        t.append(" !\n" if over else "\n", style="red" if over else "")
    return t


class TokenView(Vertical):
    """Set `data` with `show()`; the group Select (or key g) filters."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.data: M.TokenData | None = None
        self.group = "completion"

    def compose(self) -> ComposeResult:
        with Horizontal(id="token-bar"):
            yield Static("group", id="group-label")
            yield Select([("completion", "completion")], value="completion", allow_blank=False, compact=True, id="group-select")
            yield Static("", id="token-note")
        yield Static("", id="token-legend")
        with Horizontal(id="token-body"):
            with VerticalScroll(id="strips-scroll"):
                yield Static("", id="strips")
            yield Static("", id="worst")

    def show(self, data: M.TokenData | None, group: str | None = None) -> None:
        self.data = data
        if group is not None:
            self.group = group
        sel = self.query_one("#group-select", Select)
        if data is None:
            self.query_one("#strips", Static).update(Text("no report yet", style="italic"))
            self.query_one("#worst", Static).update("")
            return
        if self.group not in data.groups:
            self.group = "completion"
        with sel.prevent(Select.Changed):
            sel.set_options([(Text(g), g) for g in data.groups])  # Text: a group name is not markup
            sel.value = self.group
        self.query_one("#token-note", Static).update(Text(data.note, style="dim"))
        self.query_one("#token-legend", Static).update(Text(data.scale(), style="dim"))
        self.redraw()

    def redraw(self) -> None:
        if self.data is None:
            return
        self.query_one("#strips", Static).update(strips_text(self.data, self.group))
        self.query_one("#worst", Static).update(worst_text(self.data, self.group))

    def set_group(self, group: str) -> None:
        if self.data is None or group not in self.data.groups:
            return
        self.group = group
        sel = self.query_one("#group-select", Select)
        if sel.value != group:
            with sel.prevent(Select.Changed):
                sel.value = group
        self.redraw()

    def cycle_group(self) -> str:
        if self.data is not None:
            gs = self.data.groups
            self.set_group(gs[(gs.index(self.group) + 1) % len(gs)] if self.group in gs else gs[0])
        return self.group

    def on_select_changed(self, event: Select.Changed) -> None:
        event.stop()
        if isinstance(event.value, str):
            self.set_group(event.value)

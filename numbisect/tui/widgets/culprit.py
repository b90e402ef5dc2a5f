"""The answer bar: the verdict and the culprit sentence with its evidence."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from numbisect.tui import model as M


class CulpritPanel(Static):
    """Always visible above the tabs: the first thing a user reads."""

    def show(self, report: dict | None, note: str = "") -> None:
        t = Text()
        if report is None:
            t.append(note or "no report yet", style="italic")
            self.update(t)
            return
        mark, style, text = M.verdict_line(report)
        t.append(mark, style=style)
        t.append("  " + text)
        lines = M.culprit_lines(report)
        if note:
            lines = [("italic", note)]
        for st, line in lines:
            t.append("\n")
            t.append(line, style=st)
        self.update(t)

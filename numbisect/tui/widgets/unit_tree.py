"""The unit tree: model > layers > attn / moe > router / experts, in execution order.

Each row reads without colour: a severity symbol (= . ! !!), the relative L2 error of
the chosen view (propagated or local), the short name, and a culprit mark.
"""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Tree

from numbisect.report.view import view as report_view
from numbisect.tui import model as M


def row_label(row: M.UnitRow, view: str, tol: float, culprits: set[str], first: str | None) -> Text:
    key, vs, _ = M.unit_severity(row.data, view, tol)
    sym, style, _ = M.SEVERITY[key]
    t = Text()
    t.append(f"{sym:<2} ", style=style)
    t.append(f"{vs:>9} ", style=style)
    t.append(row.label, style="bold" if row.name in culprits else "")
    if row.name in culprits:
        t.append(f" {M.CULPRIT_MARK} CULPRIT", style="bold magenta")
    elif row.name == first:
        t.append("  <first > tol", style="dim")
    return t


class UnitTree(Tree[str]):
    """Tree nodes carry the unit name as data ("model" for the root)."""

    def on_mount(self) -> None:
        self.guide_depth = 3

    def populate(self, report: dict | None, view: str, filter_text: str = "", keep: str | None = None) -> None:
        self.clear()
        rv = report_view(report) if report is not None else None
        if rv is None or not rv.units:
            cond = rv is not None and M.conditions_of(rv) is not None
            note = "model (a conditions report: its localisation's units are in the Overview)" if cond else "model (no per-unit data)"
            self.root.set_label(Text(note, style="italic"))
            return
        tol = M.unit_tol(report)
        culprits = M.culprit_names(report)
        first = rv.first_divergence.get("above_tol")
        shown = M.visible_units(report, filter_text)
        mark, style, _ = M.verdict_line(report)
        root = Text("model  ")
        root.append(mark, style=style)
        root.append(f"  ({view} error)", style="dim")
        self.root.set_label(root)
        self.root.data = "model"
        nodes = {"model": self.root}
        for row in M.unit_rows(report):
            if shown is not None and row.name not in shown:
                continue
            parent = row.data.get("parent") or "model"
            pnode = nodes.get(parent, self.root)
            has_kids = any((u.get("parent") == row.name) for u in rv.units)
            label = row_label(row, view, tol, culprits, first)
            if has_kids:
                node = pnode.add(label, data=row.name, expand=True)
            else:  # the width of the fold arrow, so siblings' columns line up
                node = pnode.add_leaf(Text("  ") + label, data=row.name)
            nodes[row.name] = node
        self.root.expand()
        target = nodes.get(keep or "")
        if target is not None:
            self.call_after_refresh(self._show_node, target)

    def _show_node(self, node) -> None:
        """Cursor on `node`, with its parent rows in view above it where they fit."""
        self.move_cursor(node)
        y = max(0, node.line - max(2, self.size.height // 3))
        self.call_after_refresh(self.scroll_to, y=y, animate=False)

    def node_for(self, name: str):
        stack = [self.root]
        while stack:
            n = stack.pop()
            if n.data == name:
                return n
            stack.extend(n.children)
        return None

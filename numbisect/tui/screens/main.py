"""The main screen: the answer bar, then tabs (Overview, Units, Tokens, Trials), a
status line and the footer of key bindings."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Header, Input, Static, TabbedContent, TabPane

from numbisect.tui.widgets.culprit import CulpritPanel
from numbisect.tui.widgets.overview import OverviewPanel
from numbisect.tui.widgets.token_view import TokenView
from numbisect.tui.widgets.trials import TrialsPanel
from numbisect.tui.widgets.unit_detail import UnitDetail
from numbisect.tui.widgets.unit_tree import UnitTree

TABS = ("overview", "units", "tokens", "trials")


class MainScreen(Screen):
    def compose(self) -> ComposeResult:
        yield Header(icon="≠")
        yield CulpritPanel(id="culprit")
        with TabbedContent(initial="overview", id="tabs"):
            with TabPane("1 Overview", id="overview"):
                with VerticalScroll(id="overview-scroll"):
                    yield OverviewPanel(id="overview-panel")
            with TabPane("2 Units", id="units"):
                with Horizontal(id="units-body"):
                    with Vertical(id="units-left"):
                        yield Input(placeholder="/ filter units (name or kind)", id="unit-filter", compact=True)
                        yield Static("", id="unit-legend")
                        yield UnitTree("model", id="unit-tree")
                    with VerticalScroll(id="unit-detail-scroll"):
                        yield UnitDetail(id="unit-detail")
            with TabPane("3 Tokens", id="tokens"):
                yield TokenView(id="token-view")
            with TabPane("4 Trials", id="trials"):
                yield TrialsPanel(id="trials-panel")
        yield Static("", id="status")
        yield Footer()

    def on_mount(self) -> None:
        self.app.main_ready()

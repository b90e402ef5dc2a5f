"""The help screen: every key binding (from the app's bindings) and what the rows mean."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Static

from numbisect.tui import model as M

EXTRA = [
    ("up / down, mouse", "move in the unit tree or the trials table"),
    ("enter / space", "select / fold a tree node"),
    ("tab / shift+tab", "move focus"),
    ("escape", "leave the filter, close a dialog"),
]


def help_table(bindings: list[Binding], live: bool) -> Table:
    t = Table(box=None, show_header=False, padding=(0, 2, 0, 0))
    t.add_column(style="bold cyan", no_wrap=True)
    t.add_column()
    for b in bindings:
        keys = b.key_display or ", ".join(k.replace("question_mark", "?").replace("slash", "/") for k in b.key.split(","))
        desc = HELP_TEXT.get(b.id or "", b.description)
        if b.id in LIVE_ONLY and not live:
            desc += " (live mode only)"
        t.add_row(keys, desc)
    for k, d in EXTRA:
        t.add_row(k, d)
    return t


HELP_TEXT = {
    "quit": "quit",
    "help": "this help",
    "run": "run the search (compare, self-check, bisection); the Trials tab fills in",
    "swap": "swap the selected unit for the reference's and run one trial: before -> after",
    "swap_kind": "swap every unit of the selected unit's kind and run one trial",
    "toggle_error": "switch the unit tree between propagated and local (teacher-forced) error",
    "filter": "filter the unit tree by name or kind",
    "export": "write the report as JSON to a path you choose",
    "open": "open another report file",
    "group": "token view: next token group (completion, prompt, all, image, ...)",
    "tab_overview": "Overview tab",
    "tab_units": "Units tab",
    "tab_tokens": "Tokens tab",
    "tab_trials": "Trials tab",
}
LIVE_ONLY = {"run", "swap", "swap_kind"}


class HelpScreen(ModalScreen[None]):
    BINDINGS = [
        Binding("escape,q,question_mark,f1", "dismiss_help", "Close", show=False),
    ]

    def __init__(self, bindings: list[Binding], live: bool) -> None:
        super().__init__()
        self.table = help_table(bindings, live)

    def compose(self) -> ComposeResult:
        with Vertical(id="help-box", classes="dialog"):
            yield Static(Text("numbisect TUI: keys", style="bold"), classes="dialog-title")
            with VerticalScroll(id="help-scroll"):
                yield Static(self.table, id="help-keys")
                yield Static(
                    Text(
                        "\nUnit rows: symbol, relative L2 error of the unit's output, name. "
                        "= bitwise identical; . under the unit tolerance; ! over it; !! over 10x it; "
                        f"{M.CULPRIT_MARK} CULPRIT: named by the search.\n"
                        "Token strips: block height = decade of k3 relative to the threshold; "
                        "· = not in the group; | = prompt | completion.\n"
                        "Manual swap trials are shown but not added to the report: an exported "
                        "report is what `bisect run` writes.",
                        style="dim",
                    )
                )
            yield Button("Close", id="help-close", variant="primary")

    def action_dismiss_help(self) -> None:
        self.dismiss(None)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(None)

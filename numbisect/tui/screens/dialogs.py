"""Modal dialogs: a path prompt (export, open) and an error screen."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Static

from numbisect.common.textsafe import printable_text


class PathScreen(ModalScreen[str | None]):
    """Ask for a file path; dismisses with the path, or None when cancelled."""

    BINDINGS = [Binding("escape", "cancel", "Cancel", show=False)]
    AUTO_FOCUS = "#path-input"

    def __init__(self, title: str, value: str = "", action: str = "OK") -> None:
        super().__init__()
        self._title = title
        self._value = value
        self._action = action

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id="path-box"):
            yield Static(Text(self._title, style="bold"), classes="dialog-title")
            yield Input(value=self._value, placeholder="path/to/report.json", id="path-input")
            with Horizontal(classes="dialog-buttons"):
                yield Button(self._action, variant="primary", id="path-ok")
                yield Button("Cancel", id="path-cancel")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self._submit()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        if event.button.id == "path-ok":
            self._submit()
        else:
            self.dismiss(None)

    def _submit(self) -> None:
        value = self.query_one(Input).value.strip()
        self.dismiss(value or None)

    def action_cancel(self) -> None:
        self.dismiss(None)


class ErrorScreen(ModalScreen[None]):
    """One clear line (no traceback) and an OK button."""

    BINDINGS = [Binding("escape,enter,q", "close", "Close", show=False)]
    AUTO_FOCUS = "#error-ok"

    def __init__(self, title: str, message: str) -> None:
        super().__init__()
        self._title = title
        self.message = printable_text(message)  # an error may name a path holding escapes

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog error", id="error-box"):
            yield Static(Text(f"!! {self._title}", style="bold"), classes="dialog-title")
            yield Static(Text(self.message), id="error-message")
            with Horizontal(classes="dialog-buttons"):
                yield Button("OK", variant="error", id="error-ok")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.dismiss(None)

    def action_close(self) -> None:
        self.dismiss(None)

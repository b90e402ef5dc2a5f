"""The TUI tests (a package, so their conftest is `tui.conftest`, not a second `conftest`)."""

"""Screens of the numbisect TUI: the main screen and its modal dialogs."""

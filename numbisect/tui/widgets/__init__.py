"""Reusable widgets of the numbisect TUI; each draws from a report dict."""

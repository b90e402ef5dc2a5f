"""TUI tests run from the repository root, so report paths (and the trace path a report
names) resolve as they do for a user there, and snapshots show short, machine-independent
paths. Shared names live in tests/tui/support.py."""

from __future__ import annotations

import pytest

from tui.support import ROOT


@pytest.fixture(autouse=True)
def at_root(monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

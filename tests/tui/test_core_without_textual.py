"""The core runs without textual: only numbisect.tui may import it (harlequin's check)."""

from __future__ import annotations

import subprocess
import sys

from tui.support import ROOT

CODE = """
import sys
import numbisect, numbisect.cli, numbisect.session.session, numbisect.commands.run, numbisect.search.search, numbisect.report.document
import numbisect.report.summary, numbisect.pipeline.measure, numbisect.model.units, numbisect.patching.swap
core = sorted(m for m in sys.modules if m == "textual" or m.startswith("textual."))
import numbisect.tui.model, numbisect.tui.live  # the TUI's own computations are textual-free too
tui = sorted(m for m in sys.modules if m == "textual" or m.startswith("textual."))
print(repr((core, tui)))
"""


def test_core_and_cli_import_without_textual():
    out = subprocess.run([sys.executable, "-c", CODE], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    core, tui = eval(out.stdout.strip().splitlines()[-1])
    assert core == [], f"the core imported textual: {core}"
    assert tui == [], f"numbisect.tui.model / live imported textual: {tui}"


def test_the_tui_app_does_import_textual():
    code = "import sys, numbisect.tui.app; print('textual' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "True", out.stderr

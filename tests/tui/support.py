"""What the TUI tests share: the repository root, the bundled reports they open, and
helpers that read a report's own numbers (a module of its own, not conftest.py: test files
importing names from a `conftest` module get whichever conftest pytest imported last)."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REPORT = "fixtures/reports/qwen3_moe_planted_fault.json"
COMPARE_REPORT = "tests/data/report_compare_hf.json"


def report_app(path: str = REPORT):
    from numbisect.report.document import load_report
    from numbisect.tui.app import BisectApp

    return BisectApp(report=load_report(path), report_path=path)


def read(path) -> dict:
    return json.loads(Path(path).read_text())


def expected_sentence(r: dict) -> str:
    """The culprit sentence the report's own numbers give (the fixture is regenerated
    from a real vLLM run, so its digits are read, not hard-coded)."""
    from numbisect.common.formatting import fmt

    c = r["culprits"][0]
    return f"{c['unit']}: swapping it alone takes mean k3 from {fmt(r['search']['baseline'])} to {fmt(c['alone'])}"


def unit_value(r: dict, name: str, view: str) -> str:
    from numbisect.common.formatting import fmt

    return fmt(next(u for u in r["units"] if u["name"] == name)[view]["rel_l2"])

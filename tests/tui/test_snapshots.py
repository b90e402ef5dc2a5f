"""Snapshots (pytest-textual-snapshot) of the main screens on the bundled example report.

Update after a deliberate change of looks: `pytest tests/tui/test_snapshots.py --snapshot-update`,
then look at the SVGs under tests/tui/__snapshots__/.
"""

from __future__ import annotations

import pytest

from conftest import report_app

SIZE = (100, 32)


SCREENS = {
    "overview": [],
    "units": ["2"],
    "units_local": ["2", "l"],
    "tokens": ["3"],
    "trials": ["4"],
    "help": ["question_mark"],
}


@pytest.mark.parametrize("keys", list(SCREENS.values()), ids=list(SCREENS))
def test_main_screens(snap_compare, keys):
    assert snap_compare(report_app(), press=keys, terminal_size=SIZE)


def test_main_screen_at_80x24(snap_compare):
    assert snap_compare(report_app(), terminal_size=(80, 24))


def test_units_at_200x50(snap_compare):
    assert snap_compare(report_app(), press=["2"], terminal_size=(200, 50))


COND = "fixtures/reports/qwen3_moe_conditions.json"


@pytest.mark.parametrize("keys", [[], ["4"]], ids=["overview", "trials"])
def test_conditions_report_screens(snap_compare, keys):
    assert snap_compare(report_app(COND), press=keys, terminal_size=SIZE)


ENGINE_CONFIG = {"eager_bitwise": "fixtures/reports/qwen3_moe_engine_config.json",
                 "compiled_alone_diverges": "fixtures/reports/qwen3_moe_engine_config_compiled.json"}


@pytest.mark.parametrize("path", list(ENGINE_CONFIG.values()), ids=list(ENGINE_CONFIG))
def test_engine_config_report_overview(snap_compare, path):
    assert snap_compare(report_app(path), terminal_size=(130, 50))

"""Pilot tests: each action's keys (or mouse) change the app's state and widgets."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console
from textual.widgets import DataTable, Input, Sparkline, Static, TabbedContent

from numbisect.common.formatting import fmt
from numbisect.tui.screens.dialogs import ErrorScreen, PathScreen
from numbisect.tui.screens.help import HelpScreen
from numbisect.tui.widgets.culprit import CulpritPanel
from numbisect.tui.widgets.token_view import TokenView
from numbisect.tui.widgets.trials import TrialsPanel
from numbisect.tui.widgets.unit_detail import UnitDetail
from numbisect.tui.widgets.unit_tree import UnitTree
from tui.support import (
    COMPARE_REPORT,
    REPORT,
    expected_sentence,
    read,
    report_app,
    unit_value,
)

pytestmark = pytest.mark.asyncio
SIZE = (100, 32)


def text(widget) -> str:
    return str(widget.render())


def tree_names(tree: UnitTree) -> list[str]:
    out, stack = [], [tree.root]
    while stack:
        n = stack.pop()
        out.append(n.data)
        stack.extend(reversed(n.children))
    return out


def tree_label(tree: UnitTree, name: str) -> str:
    return tree.node_for(name).label.plain


async def test_opens_with_the_culprit_in_view():
    app = report_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        panel = text(app.main.query_one(CulpritPanel))
        assert "!! DIVERGED" in panel
        assert expected_sentence(read(REPORT)) in panel
        assert expected_sentence(read(REPORT)).startswith("layers.2.moe.experts: swapping it alone takes mean k3 from ")
        assert app.selected == "layers.2.moe.experts"
        assert "CULPRIT" in tree_label(app.main.query_one(UnitTree), "layers.2.moe.experts")


async def test_number_keys_switch_tabs_and_focus_their_widget():
    app = report_app()
    async with app.run_test(size=SIZE) as pilot:
        tabs = app.main.query_one(TabbedContent)
        for key, tab, focus in (("2", "units", "unit-tree"), ("3", "tokens", "strips-scroll"), ("4", "trials", "trials-table"), ("1", "overview", "overview-scroll")):
            await pilot.press(key)
            assert tabs.active == tab
            assert app.focused.id == focus


async def test_clicking_a_tab_and_a_tree_row_with_the_mouse():
    app = report_app()
    async with app.run_test(size=SIZE) as pilot:
        await pilot.click("#tabs Tab#--content-tab-units")
        await pilot.pause()
        assert app.main.query_one(TabbedContent).active == "units"
        tree = app.main.query_one(UnitTree)
        tree.scroll_home(animate=False)
        await pilot.pause()
        embed = tree.node_for("embed")
        await pilot.click(tree, offset=(12, embed.line - int(tree.scroll_y)))
        await pilot.pause()
        assert app.selected == "embed"
        assert "embed  (embed)" in text(app.main.query_one(UnitDetail))


async def test_arrows_in_the_tree_select_a_unit_and_show_its_metrics_trials_and_worst_token():
    app = report_app()
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("2")
        await pilot.pause()
        assert app.selected == "layers.2.moe.experts"
        detail = text(app.main.query_one(UnitDetail))
        assert "CULPRIT" in detail and "trials that swapped it: 3" in detail
        assert "worst token: sample" in detail and "local-error rank 2 of 13" in detail
        await pilot.press("up")
        assert app.selected == "layers.2.moe.router"
        detail = text(app.main.query_one(UnitDetail))
        assert "layers.2.moe.router  (router)" in detail and "#5" in detail


async def test_l_toggles_propagated_and_local_error():
    app = report_app()
    async with app.run_test(size=SIZE) as pilot:
        r = read(REPORT)
        prop, local = unit_value(r, "layers.3.attn", "propagated"), unit_value(r, "layers.3.attn", "local")
        assert prop != local
        tree = app.main.query_one(UnitTree)
        assert prop in tree_label(tree, "layers.3.attn")
        await pilot.press("l")
        assert app.view == "local"
        assert "local error" in tree.root.label.plain
        assert local in tree_label(tree, "layers.3.attn")
        assert "> local" in text(app.main.query_one(UnitDetail))
        await pilot.press("l")
        assert app.view == "propagated" and prop in tree_label(tree, "layers.3.attn")


async def test_slash_filters_the_unit_tree_and_escape_leaves_the_filter():
    app = report_app()
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("slash")
        assert app.main.query_one(TabbedContent).active == "units"
        assert app.focused.id == "unit-filter"
        await pilot.press(*"router")
        await pilot.pause()
        names = [n for n in tree_names(app.main.query_one(UnitTree)) if n != "model"]
        assert app.filter_text == "router"
        assert {n for n in names if n.endswith("router")} == {f"layers.{i}.moe.router" for i in range(4)}
        assert "layers.2.attn" not in names and "embed" not in names
        await pilot.press("escape")
        assert app.focused.id == "unit-tree"
        app.main.query_one("#unit-filter", Input).value = ""
        await pilot.pause()
        assert "embed" in tree_names(app.main.query_one(UnitTree))


async def test_g_cycles_the_token_group_and_the_strips_follow():
    app = report_app()
    async with app.run_test(size=SIZE) as pilot:
        view = app.main.query_one(TokenView)
        assert view.group == "completion"
        before = text(view.query_one("#strips", Static))
        await pilot.press("g")
        assert app.main.query_one(TabbedContent).active == "tokens"
        assert view.group == "prompt"
        assert text(view.query_one("#strips", Static)) != before
        await pilot.press("g", "g")
        assert view.group == "image"
        worst = text(view.query_one("#worst", Static))
        assert "worst image tokens" in worst
        assert fmt(read(REPORT)["baseline"]["groups"]["image"]["k3"]["max"]) in worst


async def test_trials_table_and_sparkline_show_every_trial():
    app = report_app()
    async with app.run_test(size=(130, 36)) as pilot:
        await pilot.press("4")
        table = app.main.query_one("#trials-table", DataTable)
        assert table.row_count == 8
        assert len(app.main.query_one(Sparkline).data) == 8
        trial = read(REPORT)["trials"][6]
        row = table.get_row_at(6)
        assert trial["swapped"] == ["layers.2.moe.experts"]
        assert str(row[1]) == "probe" and str(row[3]) == fmt(trial["value"]) and str(row[4]) == "fixed" and str(row[5]) == "moe.experts[2]"
        await pilot.press("down")
        assert "trial 1 (all-swapped)" in text(app.main.query_one("#trial-detail", Static))


async def test_e_exports_the_report_to_a_chosen_path(tmp_path):
    app = report_app()
    out = tmp_path / "exported.json"
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("e")
        assert isinstance(app.screen, PathScreen)
        app.screen.query_one(Input).value = str(out)
        await pilot.press("enter")
        await pilot.pause()
        assert not isinstance(app.screen, PathScreen)
    assert read(out) == read(REPORT)


async def test_export_to_a_missing_directory_shows_an_error_screen(tmp_path):
    app = report_app()
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("e")
        app.screen.query_one(Input).value = str(tmp_path / "nope" / "r.json")
        await pilot.press("enter")
        await pilot.pause()
        assert isinstance(app.screen, ErrorScreen)
        assert "does not exist" in app.screen.message
        await pilot.press("escape")
        assert not isinstance(app.screen, ErrorScreen)


async def test_o_opens_another_report():
    app = report_app()
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("o")
        assert isinstance(app.screen, PathScreen)
        app.screen.query_one(Input).value = COMPARE_REPORT
        await pilot.press("enter")
        await pilot.pause()
        assert app.report["kind"] == "compare" and app.report_path == COMPARE_REPORT
        assert app.main.query_one(TrialsPanel).trials == []
        assert "report tests/data/report_compare_hf.json" in app.sub_title


@pytest.mark.parametrize(
    "content,needle",
    [
        ("{ not json", "not valid JSON"),
        (None, "schema version 99 is not supported"),
        ("[1, 2]", "not a numbisect report"),
    ],
)
async def test_opening_a_bad_report_shows_an_error_screen_not_a_traceback(tmp_path, content, needle):
    bad = tmp_path / "bad.json"
    if content is None:
        r = read(REPORT)
        r["schema_version"] = 99
        content = json.dumps(r)
    bad.write_text(content)
    app = report_app()
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("o")
        app.screen.query_one(Input).value = str(bad)
        await pilot.press("enter")
        await pilot.pause()
        assert isinstance(app.screen, ErrorScreen)
        assert needle in app.screen.message and "Traceback" not in app.screen.message
        await pilot.click("#error-ok")
        await pilot.pause()
        assert not isinstance(app.screen, ErrorScreen)
        assert app.report["kind"] == "run"  # the report shown is unchanged


async def test_escape_cancels_a_path_dialog():
    app = report_app()
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("o")
        await pilot.press("escape")
        assert not isinstance(app.screen, PathScreen)
        assert app.report_path == REPORT


async def test_question_mark_shows_help_with_every_binding():
    app = report_app()
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        console = Console(file=io.StringIO(), width=160)
        console.print(app.screen.table)
        body = console.file.getvalue()
        for words in ("run the search", "swap the selected unit", "propagated and local", "filter the unit tree",
                      "write the report", "open another report", "quit", "live mode only"):
            assert words in body
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)


async def test_live_actions_are_hidden_and_inert_on_a_report():
    app = report_app()
    async with app.run_test(size=SIZE) as pilot:
        assert app.check_action("run_search", ()) is False and app.check_action("swap_unit", ()) is False
        await pilot.press("r", "s", "S")
        await pilot.pause()
        assert app.busy is None and not list(app.workers) and app.manual == []
        app.action_run_search()  # called directly (not through a key): a warning, nothing runs
        assert app.busy is None


async def test_q_quits():
    app = report_app()
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("q")
    assert app.return_value == 0


async def test_a_report_with_values_from_a_later_version_opens_and_every_tab_draws(tmp_path):
    """Unit kinds, backends and what-ifs are open sets in the schema: the explorer shows an
    unknown one as it is."""
    r = read(REPORT)
    c = r["culprits"][0]
    for u in r["units"]:
        if u["name"] == c["unit"]:
            u["kind"] = "ssm_mixer"
    c["kind"] = "ssm_mixer"
    r["inputs"]["engine"]["backend"] = "sglang"
    c["precision"] = {"suggested": "accumulate the scan in fp32: fixes it",
                      "whatifs": [{"whatif": "fp32 scan", "fix": "accumulate the scan in fp32", "metric": "k3-mean",
                                   "threshold": 1e-3, "before": 5e-3, "value": 4e-5, "k3_mean": 4e-5, "verdict": "fixes",
                                   "line": "accumulate the scan in fp32: fixes it", "replaced_faults": [],
                                   "faults_not_carried": []}]}
    path = tmp_path / "future.json"
    path.write_text(json.dumps(r))
    app = report_app(str(path))
    async with app.run_test(size=SIZE) as pilot:
        for key in ("1", "2", "3", "4", "2"):
            await pilot.press(key)
            await pilot.pause()
        assert app.selected == c["unit"]
        detail = text(app.main.query_one(UnitDetail))
        assert "(ssm_mixer)" in detail and "suggested fix: accumulate the scan in fp32" in detail

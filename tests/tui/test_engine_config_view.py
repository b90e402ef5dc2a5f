"""A report of `compare` / `run --engine-config FILE` in the TUI: the answer bar and the
Overview say whether the module search (run in the hookable configuration) saw the user's
own numbers, where each part ran, both configurations against the reference, the settings
changed so hooks could run, the custom ops the user's engine reported, and the log-prob
contract of the tokens it sampled.

The two fixture reports are real runs (their command lines are in the reports):
- `qwen3_moe_engine_config.json`: `compare`, eager with prefix caching, batch "all",
  processed log-probs at temperature 0.7: the hookable log-probs are bitwise yours, the
  contract finds them processed;
- `qwen3_moe_engine_config_compiled.json`: `run`, compiled, at a threshold between the two
  configurations: only the user's diverges (exit 4).
Expected texts are read from their numbers, not hard-coded."""

from __future__ import annotations

import copy
import json

import pytest
from textual.widgets import DataTable, Static

from numbisect.common.formatting import fmt, pct
from numbisect.report.document import validate
from numbisect.tui import model as M
from numbisect.tui.widgets.culprit import CulpritPanel
from numbisect.tui.widgets.overview import OverviewPanel, overview_text
from tui.support import read

EAGER = "fixtures/reports/qwen3_moe_engine_config.json"
COMPILED = "fixtures/reports/qwen3_moe_engine_config_compiled.json"
SIZE = (130, 60)


def app_for(report: dict, path: str):
    from numbisect.tui.app import BisectApp, preflight

    preflight(report, path)
    return BisectApp(report=report, report_path=path)


def text(widget) -> str:
    return str(widget.render())


def row(lines: list[str], start: str) -> str:
    return next(x for x in lines if x.strip().startswith(start))


def test_the_fixtures_are_the_two_cases_a_user_meets():
    a, b = read(EAGER), read(COMPILED)
    assert validate(a) == [] and validate(b) == []
    ea, eb = a["engine_config"], b["engine_config"]
    assert ea["child"] and ea["hookable_vs_user"]["bitwise"] is True
    assert a["logprob_contract"]["verdict"] == "processed" and a["logprob_contract"]["source"] == "engine_config"
    assert b["kind"] == "run" and eb["child"] and eb["hookable_vs_user"]["bitwise"] is False
    assert b["verdict"] == "diverged" and eb["hookable_baseline"]["verdict"] == "aligned"
    assert eb["custom_ops"]["disabled"] and not eb["custom_ops"]["enabled"]


@pytest.mark.asyncio
async def test_bitwise_equal_says_the_search_sees_your_numbers_and_shows_the_contract_first():
    r = read(EAGER)
    ec, c = r["engine_config"], r["logprob_contract"]
    app = app_for(r, EAGER)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        bar = text(app.main.query_one(CulpritPanel)).splitlines()
        # the first finding: the log-probs are processed, with the fitted temperature
        assert bar[1] == (f"!! log-prob contract: your engine's log-probs are processed (fitted: temperature "
                          f"{fmt(c['fitted']['temperature'])}), not the model's raw ones: what to change is in the Overview")
        assert bar[-1] == "your engine configuration: the module search sees exactly your numbers"
        ov = text(app.main.query_one(OverviewPanel))
        lines = ov.splitlines()
        assert f"Your engine configuration ({ec['file']})" in ov
        assert "= the hookable configuration's log-probs are bitwise equal to yours: the module search sees exactly your numbers" in ov
        assert "your settings alone diverge" not in ov
        # where each part ran: the tokens in yours (a child, its seconds), the rest in the hookable one
        assert row(lines, "token comparison").endswith(f"your settings (child process, {ec['seconds']:.1f} s)")
        assert row(lines, "per-unit captures").endswith("hookable settings")
        assert row(lines, "module search").endswith("hookable settings")
        # both against the reference: yours is the report's baseline, the hookable one its own
        yours, hook = row(lines, "yours "), row(lines, "hookable ")
        assert fmt(r["baseline"]["value"]) in yours and "aligned" in yours and pct(r["baseline"]["rl_cost"]["seq_frac_rejected"]) in yours
        hb = ec["hookable_baseline"]
        assert fmt(hb["value"]) in hook and hb["verdict"] in hook and pct(hb["seq_frac_rejected"]) in hook
        assert "hookable vs yours: bitwise equal (k3 0, max |diff| 0)" in ov
        # every changed setting marked, with your value and the hookable one
        for k in ec["changed"]:
            x = row(lines, f"≠ {k} ")
            want = "(not set)" if k not in ec["hookable"] else M.setting_text(ec["hookable"][k])
            assert M.setting_text(ec["user"][k]) in x and x.rstrip().endswith(want), x
        assert row(lines, "enforce_eager").startswith("  ")  # unchanged: no mark
        assert "  on:  " + ", ".join(ec["custom_ops"]["enabled"]) in ov
        # the contract: what to change, and the fit's numbers
        assert "Log-prob contract (tokens your engine sampled" in ov
        assert f"!! processed: {c['advice']}" in ov
        assert (f"fitted on {c['positions']} tokens: mean |log-prob error| {fmt(c['raw_error'])} as raw, "
                f"{fmt(c['fit_error'])} as processed") in ov


@pytest.mark.asyncio
async def test_only_your_settings_diverging_is_the_answer():
    r = read(COMPILED)
    ec = r["engine_config"]
    hb, vs = ec["hookable_baseline"], ec["hookable_vs_user"]
    app = app_for(r, COMPILED)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        bar = text(app.main.query_one(CulpritPanel))
        sentence = (f"your settings alone diverge: yours {fmt(r['baseline']['value'])} > {fmt(r['threshold']['threshold'])}, "
                    f"the hookable configuration's {fmt(hb['value'])} is under it")
        assert sentence in bar.replace("\n", "") and "!! DIVERGED" in bar
        assert "aligned: " not in bar  # the search's own verdict (in the hookable one) is not the answer
        ov = text(app.main.query_one(OverviewPanel))
        lines = ov.splitlines()
        assert "!! " + sentence in ov
        assert f"`bisect conditions --engine-config {ec['file']}` names the setting" in ov
        assert "diverged" in row(lines, "yours ") and "aligned" in row(lines, "hookable ")
        assert f"hookable vs yours: not bitwise equal (k3 {fmt(vs['k3_mean'])}, max |diff| {fmt(vs['max_abs_diff'])})" in ov
        # compiled -> eager is a change; the custom ops written out are the same in effect
        assert row(lines, "≠ enforce_eager").split()[2:] == ["false", "true"]
        cc = row(lines, "~ compilation_config")
        assert all(f"-{op}" in cc for op in ec["custom_ops"]["disabled"])
        assert "  off: " + ", ".join(ec["custom_ops"]["disabled"]) in ov
        assert "Log-prob contract" not in ov
        # the search's trials are the hookable configuration's, and the caption says so
        await pilot.press("4")
        await pilot.pause()
        cap = text(app.main.query_one("#trials-caption", Static))
        assert cap.endswith(f"; the trials ran in the hookable configuration (yours: {fmt(r['baseline']['value'])}, the Overview)")
        assert [str(x) for x in app.main.query_one("#trials-table", DataTable).get_row_at(0)][3] == fmt(hb["value"])


def test_a_bitwise_difference_without_a_verdict_change_is_near_not_yours():
    r = copy.deepcopy(read(COMPILED))
    r["threshold"]["threshold"], r["verdict"] = 1e-3, "aligned"  # both configurations under it
    mark, _, sentence = M.engine_config_finding(r)
    vs = r["engine_config"]["hookable_vs_user"]
    assert mark == "!" and sentence == (f"the hookable configuration's log-probs differ from yours (k3 {fmt(vs['k3_mean'])}, "
                                        f"max |diff| {fmt(vs['max_abs_diff'])}): the module search sees numbers near yours, not yours")
    lines = [line for _, line in M.culprit_lines(r)]
    assert not any("alone diverge" in line for line in lines)
    assert lines[-1] == f"your engine configuration: the module search sees numbers near yours (k3 {fmt(vs['k3_mean'])} apart), not yours"


def test_hookable_settings_run_everything_in_yours():
    """Settings hooks can run as they are (no child): one configuration, every part in it."""
    r = copy.deepcopy(read(EAGER))
    ec = r["engine_config"]
    ec.update(user=dict(ec["hookable"]), changed=[], child=False, parts={"tokens": "hookable", "units": "hookable", "search": "hookable"})
    for k in ("custom_ops", "seconds", "hookable_baseline", "hookable_vs_user"):
        del ec[k]
    del r["logprob_contract"]
    assert validate(r) == []
    ov = overview_text(r).plain
    assert "= your settings run with hooks as they are" in ov and "sees exactly your numbers" in ov
    assert "child process" not in ov and "hookable vs yours" not in ov and "≠ " not in ov


ODD = [None, 3, "x", [], {}, [1, {"a": None}], {"nested": [1, 2]}, float("nan"), True, "\x1b[31mred"]


@pytest.mark.parametrize("key", ["user", "file", "hookable", "changed", "child", "parts", "custom_ops", "seconds",
                                 "hookable_baseline", "hookable_vs_user"])
def test_any_value_of_any_key_draws_or_goes_missing_without_a_crash(key):
    """The readers take a section of any shape (the schema is checked before the app, not by
    them): every odd value of every key, and the key missing, draw the answer and the Overview."""
    from numbisect.common.textsafe import printable_tree
    from numbisect.report.summary import render
    from numbisect.report.tools import markdown

    for path in (EAGER, COMPILED):
        base = read(path)
        for value in ODD + ["missing"]:
            r = copy.deepcopy(base)
            if value == "missing":
                del r["engine_config"][key]
            else:
                r["engine_config"][key] = copy.deepcopy(value)
            r = printable_tree(r)
            M.culprit_lines(r)
            assert "Your engine configuration" in overview_text(r).plain
            render(r), markdown(r)
    for section in ODD:
        r = printable_tree(copy.deepcopy(read(COMPILED)) | {"engine_config": section})
        M.culprit_lines(r), overview_text(r), render(r), markdown(r)


@pytest.mark.asyncio
async def test_odd_but_schema_valid_engine_config_sections_still_open():
    r = copy.deepcopy(read(COMPILED))
    ec = r["engine_config"]
    ec["user"] = {"weird": {"nested": [1, 2]}, "enforce_eager": "sometimes"}
    ec["hookable"] = {}
    ec["changed"] = ["not_a_setting"]
    ec["parts"] = {"tokens": "user", "other": "hookable"}
    ec["custom_ops"] = {"enabled": [], "disabled": [], "extra": 1}
    ec["hookable_baseline"] = {"value": "nan"}
    ec["hookable_vs_user"] = {}
    ec["file"] = None
    ec["seconds"] = "inf"
    assert validate(r) == []
    app = app_for(r, COMPILED)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        assert app.failure is None
        ov = text(app.main.query_one(OverviewPanel))
        assert "Your engine configuration\n" in ov and "not compared with yours" in ov
        assert "  other " in ov and "≠ not_a_setting" in ov
        for key in ("2", "3", "4"):
            await pilot.press(key)
            await pilot.pause()
        assert app.failure is None


def test_a_report_whose_engine_config_breaks_the_schema_is_refused_in_one_line(tmp_path, capsys):
    from numbisect.cli import main

    r = read(COMPILED)
    r["engine_config"]["hookable_vs_user"] = "bitwise"
    p = tmp_path / "r.json"
    p.write_text(json.dumps(r))
    assert main(["tui", str(p)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"bisect: error: {p}"), err

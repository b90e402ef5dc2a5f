"""A `bisect conditions` report in the TUI: the answer bar names the guilty setting, the
Overview shows your settings against the known-good ones, each atom's result alone, both
configurations' RL cost against the reference and the localisation's units; the Trials tab
lists the condition trials (atoms reverted, k3 vs the known-good, RL cost vs the reference).

The fixture report is a real `bisect conditions` run (its command line is in the report);
expected texts are read from its numbers, not hard-coded."""

from __future__ import annotations

import copy
import json

import pytest
from textual.widgets import DataTable, Static

from numbisect.common.formatting import fmt, pct
from numbisect.report.document import validate
from numbisect.tui import model as M
from numbisect.tui.widgets.culprit import CulpritPanel
from numbisect.tui.widgets.overview import OverviewPanel
from numbisect.tui.widgets.trials import TrialsPanel
from numbisect.tui.widgets.unit_tree import UnitTree
from tui.support import read

COND = "fixtures/reports/qwen3_moe_conditions.json"
SIZE = (130, 50)


def app_for(report: dict, path: str = COND):
    from numbisect.tui.app import BisectApp, preflight

    preflight(report, path)
    return BisectApp(report=report, report_path=path)


def text(widget) -> str:
    return str(widget.render())


def test_the_fixture_is_a_conditions_report_with_a_localised_culprit():
    r = read(COND)
    assert r["kind"] == "conditions" and validate(r) == []
    c = r["conditions"]
    assert len(c["culprits"]) == 1 and c["localisation"]["done"] and c["localisation"]["units"]
    assert any(a["bitwise_invariant"] for a in c["atoms"])


@pytest.mark.asyncio
async def test_opens_on_the_guilty_setting():
    r = read(COND)
    c = r["conditions"]
    culprit = c["culprits"][0]
    alone = next(a["alone"] for a in c["atoms"] if a["atom"] == culprit)
    app = app_for(r)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        panel = text(app.main.query_one(CulpritPanel))
        assert "!! DIVERGED" in panel and "vs the known-good configuration" in panel
        assert f"{culprit}: with only it in your state, k3 vs the known-good configuration is {fmt(alone)}" in panel
        assert f"{c['search']['trials_used']} trials" in panel
        assert "units it changes: " + ", ".join(c["localisation"]["named"]) in panel
        rej = c["vs_reference"]["user"]["rl_cost"]["seq_frac_rejected"]
        assert f"yours vs the reference: {pct(rej)} of sequences rejected" in panel
        assert "no search in this report" not in panel


@pytest.mark.asyncio
async def test_overview_shows_settings_atoms_reference_cost_and_localisation_units():
    r = read(COND)
    c = r["conditions"]
    app = app_for(r)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        ov = text(app.main.query_one(OverviewPanel))
        lines = ov.splitlines()
        # settings: yours against the known-good, the ones that differ marked
        for k, v in c["user"].items():
            row = next(x for x in lines if x.strip(" ≠~").startswith(k + " "))
            assert json.dumps(v, sort_keys=True) in row or str(v).lower() in row.lower()
        cc = next(x for x in lines if "compilation_config" in x)
        assert cc.lstrip().startswith("≠") and "(not set)" in cc
        # every atom with its result alone: culprit, bitwise invariant, or changes log-probs
        for a in c["atoms"]:
            row = next(x for x in lines if x.strip().startswith(a["atom"][:31]))
            word = "CULPRIT" if a["culprit"] else "bitwise invariant here" if a["bitwise_invariant"] else "changes log-probs"
            assert word in row and fmt(a["alone"]) in row
            assert pct(a["vs_reference"]["rl_cost"]["seq_frac_rejected"]) in row
        # both configurations against the reference: k3 and the RL cost
        after = lines[next(i for i, x in enumerate(lines) if x.startswith("Against the reference")):]
        for side, label in (("user", "yours"), ("good", "known-good")):
            ref = c["vs_reference"][side]
            row = next(x for x in after if x.strip().startswith(label + " "))
            assert fmt(ref["groups"]["completion"]["k3_mean"]) in row and pct(ref["rl_cost"]["seq_frac_rejected"]) in row
        # the localisation: the named units, then every unit in the report's order
        loc = c["localisation"]
        assert f"Localisation under {loc['atom']}" in ov
        assert "units whose local output differs: " + ", ".join(loc["named"]) in ov
        unit_rows = [x.split()[0] for x in lines if x.strip() and x.split()[0] in {u["unit"] for u in loc["units"]}]
        assert unit_rows == [u["unit"] for u in loc["units"]]
        for u in loc["units"]:
            row = next(x for x in lines if x.split() and x.split()[0] == u["unit"])
            assert ("= equal" if u["bitwise_equal"] else "≠ differs") in row and fmt(u["rel_l2"]) in row


@pytest.mark.asyncio
async def test_trials_tab_lists_the_condition_trials_with_their_rl_cost():
    r = read(COND)
    trials = r["conditions"]["trials"]
    app = app_for(r)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("4")
        await pilot.pause()
        table = app.main.query_one("#trials-table", DataTable)
        assert table.row_count == len(trials)
        labels = [str(col.label) for col in table.columns.values()]
        assert labels == ["#", "role", "n", "k3 vs good", "", "rejected", "reverted to the known-good state"]
        for i, t in enumerate(trials):
            row = [str(x) for x in table.get_row_at(i)]
            assert row[1] == t["role"] and row[2] == str(len(t["swapped"])) and row[3] == fmt(t["value"])
            assert row[5] == pct(t["metrics"]["vs_reference"]["rl_cost"]["seq_frac_rejected"])
            assert row[4] == ("fixed" if t["value"] <= r["threshold"]["threshold"] else "")
        # a trial's detail: the atoms it reverted, and its run against the reference
        i = next(i for i, t in enumerate(trials) if t["swapped"])
        table.move_cursor(row=i)
        await pilot.pause()
        detail = text(app.main.query_one("#trial-detail", Static))
        t = trials[i]
        assert f"reverted to the known-good state ({len(t['swapped'])}):" in detail
        assert all(f"  {a}" in detail for a in t["swapped"])
        assert "against the reference" in detail
        assert pct(t["metrics"]["vs_reference"]["rl_cost"]["seq_frac_rejected"]) in detail
        assert "k3 vs the known-good" in text(app.main.query_one("#trials-caption", Static))


def compiled_localisation() -> dict:
    """The fixture report with its localisation made one under `compiled` (its units
    named as compiled alone, as condbisect.localise_compiled writes them)."""
    r = copy.deepcopy(read(COND))
    loc = r["conditions"]["localisation"]
    loc.update(atom="compiled", compiled_units=[u["unit"] for u in loc["units"]], custom_ops=["none"],
               compile_seconds=4.6, method="eager engine, each leaf unit eager vs compiled alone")
    return r


def units_chained(r: dict) -> dict:
    """`units_chained` as `condbisect.chained` computes it, on the fixture's own session (its
    trace and settings; no engine starts): the eager run's completion log-probs are the
    trace's rollout log-probs, the chained run's the same rounded to bf16 (a real rounding,
    so k3 is not 0), against the culprit's own k3 alone from the report."""
    import torch

    from numbisect.commands.conditions import CondSession, CondSpec, chained
    from numbisect.pipeline import measure as C

    c = r["conditions"]
    path = r["command"][r["command"].index("--engine") + 1]
    sess = CondSession(CondSpec(ref=r["command"][r["command"].index("--ref") + 1], engine=path,
                                trace=r["inputs"]["trace"]["path"]), C.Settings(), c["user"], c["good"])
    eager = [[0.0] * (len(s.prompt_ids) - 1) + list(s.rollout_logprobs) for s in sess.samples]  # one per position
    rounded = [torch.tensor(x).to(torch.bfloat16).float().tolist() for x in eager]
    alone = next(a["alone"] for a in c["atoms"] if a["atom"] == c["culprits"][0])
    return chained(sess, {"eager_logprobs": eager, "chained_logprobs": rounded}, alone)


@pytest.mark.asyncio
async def test_a_localisation_of_the_compiled_path_says_its_units_differ_compiled_alone():
    """Under a guilty `compiled` atom the named units are the ones whose code compiled alone
    gives other numbers than eager (condbisect.localise_compiled), not units fed another
    state's inputs: the Overview and the text summary say which of the two was measured."""
    from numbisect.report.sections.conditions import conditions_lines
    r = compiled_localisation()
    loc = r["conditions"]["localisation"]
    assert validate(r) == []
    app = app_for(r)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        ov = text(app.main.query_one(OverviewPanel))
        assert "Localisation under compiled" in ov
        assert "units whose code compiled alone differs: " + ", ".join(loc["named"]) in ov
        assert "whose local output differs" not in ov
    summary = "\n".join(conditions_lines(r["conditions"]))
    assert "under compiled: units whose code compiled alone differs: " + ", ".join(loc["named"]) in summary


@pytest.mark.asyncio
async def test_a_compiled_localisation_shows_how_much_of_the_compiled_path_its_units_reproduce():
    """`units_chained` (the named units compiled alone, chained on the engine's own inputs,
    against the compiled path's k3): the Overview shows the text summary's own line under
    the named units, not only inside the method's words."""
    from numbisect.report.sections.conditions import chained_line, conditions_lines

    r = compiled_localisation()
    loc = r["conditions"]["localisation"]
    loc["units_chained"] = units_chained(r)
    assert validate(r) == [] and loc["units_chained"]["k3"] > 0
    line = chained_line(loc["units_chained"])
    assert line and "the compiled path alone: k3 " + fmt(loc["units_chained"]["compiled_path_k3"]) in line
    assert f"  {line}" in conditions_lines(r["conditions"])
    app = app_for(r)
    async with app.run_test(size=(400, 60)) as pilot:  # wide: the line is not wrapped
        await pilot.pause()
        lines = text(app.main.query_one(OverviewPanel)).splitlines()
        named = next(i for i, x in enumerate(lines) if x.startswith("  units whose code compiled alone differs: "))
        assert lines[named + 1].rstrip() == f"  {line}"


@pytest.mark.asyncio
async def test_units_tab_says_where_the_localisation_is_and_a_run_report_after_it_gets_its_own_columns():
    app = app_for(read(COND))
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("2")
        assert "localisation's units are in the Overview" in app.main.query_one(UnitTree).root.label.plain
        from numbisect.report.document import load_report
        from tui.support import REPORT

        app.open_report(load_report(REPORT), REPORT)  # as the `o` dialog does
        await pilot.pause()
        labels = [str(col.label) for col in app.main.query_one("#trials-table", DataTable).columns.values()]
        assert labels[-1] == "swapped" and "rejected" not in labels
        assert not app.main.query_one(TrialsPanel).conditions


@pytest.mark.asyncio
async def test_odd_conditions_sections_still_open():
    """Odd sections still open in the TUI (it type-checks what it reads); since issue 29 the
    schema types vs_reference, custom_ops and a trial's metrics, so `report show` and
    `bisect tui FILE` refuse the mistyped ones in one line before the app starts."""
    r = copy.deepcopy(read(COND))
    c = r["conditions"]
    c["vs_reference"] = {"user": 3, "good": {"rl_cost": "x"}}
    c["custom_ops"] = {"user": "all", "good": {"rms_norm": "maybe"}}
    c["localisation"]["units"] = [1, {"unit": None, "bitwise_equal": "?"}, {}]
    c["localisation"]["named"] = []
    c["user"]["weird"] = {"nested": [1, 2]}
    c["trials"][0]["metrics"] = {"vs_reference": "none", "settings": [1]}
    c["atoms"][0].pop("description", None)
    c["atoms"][0]["alone"] = "nan"
    typed = ("conditions/vs_reference/user", "conditions/vs_reference/good/rl_cost", "conditions/custom_ops/user",
             "conditions/trials/0/metrics/vs_reference")
    assert sorted(e.split(":")[0] for e in validate(r)) == sorted(typed)
    app = app_for(r)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        assert app.failure is None
        assert "Localisation under" in text(app.main.query_one(OverviewPanel))
        await pilot.press("4")
        await pilot.pause()
        assert app.main.query_one("#trials-table", DataTable).row_count == len(c["trials"])


def test_settings_marks_tell_an_atom_from_a_default_written_out():
    cond = {"user": {"enforce_eager": True, "compilation_config": {"custom_ops": ["none"]}, "max_num_seqs": 8},
            "good": {"enforce_eager": True, "batch": 1, "max_num_seqs": 8},
            "atoms": [{"atom": "custom_op:rms_norm", "culprit": False}]}
    marks = {name: mark for mark, name, _, _ in M.settings_rows(cond)}
    assert marks == {"compilation_config": "≠", "batch": "~", "enforce_eager": " ", "max_num_seqs": " "}
    assert [name for _, name, _, _ in M.settings_rows(cond)][:2] == ["compilation_config", "batch"]

"""Live mode on a planted fault (hf engine, float32: fast, and exact enough that the
reference's own noise floor is 0): the trials table fills in while the search runs, the
culprit appears, swap trials run on the selected unit and its kind, and the exported
report equals what `bisect run` writes for the same run, apart from timestamps and
durations."""

from __future__ import annotations

import json
import time

import pytest
from textual.widgets import DataTable, Input

from numbisect.pipeline.measure import Settings
from numbisect.session.session import Spec
from numbisect.tui.app import BisectApp
from numbisect.tui.live import LiveConfig
from numbisect.tui.screens.dialogs import ErrorScreen, PathScreen
from numbisect.tui.widgets.culprit import CulpritPanel
from numbisect.tui.widgets.unit_detail import UnitDetail
from tui.support import read

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]

MODEL = "fixtures/models/qwen3_moe"
FAULT = "moe_combine_bf16@layers.2.moe"
ARGV = [
    "bisect", "run", "--ref", f"hf:{MODEL}", "--ref-dtype", "float32", "--engine", f"hf:{MODEL}",
    "--engine-dtype", "float32", "--trace", "fixtures/traces/qwen3_moe.jsonl",
    "--engine-fault", FAULT, "--threshold", "1e-10",
]
TIMING = {"created", "duration_s", "forward_s", "command"}


def live_config(**kw) -> LiveConfig:
    spec = Spec(ref=f"hf:{MODEL}", engine=f"hf:{MODEL}", trace="fixtures/traces/qwen3_moe.jsonl",
                ref_dtype="float32", engine_dtype="float32", faults=[FAULT])
    return LiveConfig(spec, Settings(threshold=1e-10), argv=list(ARGV), **kw)


def untimed(obj):
    if isinstance(obj, dict):
        return {k: untimed(v) for k, v in obj.items() if k not in TIMING}
    if isinstance(obj, list):
        return [untimed(v) for v in obj]
    return obj


async def wait_for(pilot, cond, timeout: float = 300.0, every: float = 0.05):
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("timed out waiting in the live test")
        if isinstance(pilot.app.screen, ErrorScreen):
            raise AssertionError(f"error screen: {pilot.app.screen.message}")
        await pilot.pause(every)


class WatchingApp(BisectApp):
    """Notes the trials table and the run's state as each trial message arrives."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.seen = []

    def on_trial_done(self, msg) -> None:  # Textual calls this, then BisectApp.on_trial_done
        self.seen.append((self.main.query_one("#trials-table", DataTable).row_count, self.final))


async def test_live_search_fills_the_trials_table_names_the_culprit_and_exports_the_cli_report(tmp_path):
    app = WatchingApp(live=live_config())
    async with app.run_test(size=(100, 32)) as pilot:
        table = app.main.query_one("#trials-table", DataTable)
        await wait_for(pilot, lambda: app.final)
        # the table filled in one row per trial while the search ran, not at the end
        n = table.row_count
        assert app.seen == [(i, False) for i in range(n)]
        assert table.row_count == len(app.report["trials"]) == app.report["search"]["trials_used"]
        assert [c["unit"] for c in app.report["culprits"]] == ["layers.2.moe.experts"]
        panel = str(app.main.query_one(CulpritPanel).render())
        assert "layers.2.moe.experts: swapping it alone takes mean k3 from" in panel
        assert app.selected == "layers.2.moe.experts"

        # s: swap the selected unit, one trial, before -> after
        await pilot.press("s")
        await wait_for(pilot, lambda: len(app.manual) == 1 and app.busy is None)
        res = app.manual[0]
        assert res["units"] == ["layers.2.moe.experts"] and res["fixed"] and res["after"] <= 1e-10
        assert res["before"] == app.report["baseline"]["value"]
        assert "manual swap trials" in str(app.main.query_one(UnitDetail).render())
        # S: the whole kind (every experts unit)
        await pilot.press("S")
        await wait_for(pilot, lambda: len(app.manual) == 2 and app.busy is None)
        assert app.manual[1]["units"] == [f"layers.{i}.moe.experts" for i in range(4)]
        assert app.manual[1]["label"] == "all 4 experts units"
        assert len(app.report["trials"]) == table.row_count  # manual trials stay out of the report

        # e: export
        out = tmp_path / "tui.json"
        await pilot.press("e")
        assert isinstance(app.screen, PathScreen)
        app.screen.query_one(Input).value = str(out)
        await pilot.press("enter")
        await pilot.pause()
        await pilot.press("q")

    from numbisect.cli import main

    cli_out = tmp_path / "cli.json"
    assert main(ARGV[1:] + ["--out", str(cli_out), "-q"]) == 1
    tui, cli = read(out), read(cli_out)
    # the command differs only by the CLI's output options, which do not change the run
    assert tui["command"] == ARGV and cli["command"] == ARGV + ["--out", str(cli_out), "-q"]
    assert untimed(tui) == untimed(cli)


async def test_live_mode_waits_for_r_when_autostart_is_off_and_reports_a_bad_group_on_an_error_screen():
    cfg = live_config(autostart=False)
    cfg.settings.group = "no-such-group"
    app = BisectApp(live=cfg)
    async with app.run_test(size=(100, 32)) as pilot:
        await pilot.pause()
        assert app.busy is None and app.report is None
        await pilot.press("e")  # nothing to export yet: a warning, no dialog
        assert not isinstance(app.screen, PathScreen)
        await pilot.press("r")
        await wait_for(pilot, lambda: isinstance(app.screen, ErrorScreen), timeout=60)
        assert "unknown group 'no-such-group'" in app.screen.message
        assert app.busy is None


@pytest.mark.vllm
async def test_live_run_with_engine_settings_hooks_run_in_shows_the_engine_config_section(tmp_path, monkeypatch):
    """`bisect tui ... --engine-config mine.json` with settings numbisect's engine runs with
    hooks as they are (eager, prefix caching off: the shared engine's): the live run ends with
    the report `bisect run --engine-config` writes, its `engine_config` section saying every
    part ran in your settings, and the Overview shows it. Two samples, at most 3 trials."""
    from conftest import hf, short_trace, vllm

    from numbisect.cli import main
    from numbisect.model import engine_config as E
    from numbisect.tui.widgets.overview import OverviewPanel

    fix = "qwen3_moe"
    mine = tmp_path / "mine.json"
    user = {"enforce_eager": True, "enable_prefix_caching": False}
    mine.write_text(json.dumps(user))
    apps = []
    monkeypatch.setattr(BisectApp, "run", lambda self, *a, **k: apps.append(self))
    argv = ["tui", "--ref", f"hf:{MODEL}", "--engine", f"vllm:{MODEL}", "--trace", short_trace(fix, 2),
            "--engine-config", str(mine), "--max-trials", "3"]
    assert main(argv) == 0
    (built,) = apps
    cfg = built.live
    cfg.backends = {"ref": hf(fix), "engine": vllm(fix)}  # the session's shared engines: no engine started here
    app = BisectApp(live=cfg)
    async with app.run_test(size=(130, 60)) as pilot:
        await wait_for(pilot, lambda: app.final)
        overview = str(app.main.query_one(OverviewPanel).render())
        await pilot.press("q")
    r = app.report
    print(f"live run, --engine-config: {r['verdict']}, value {r['baseline']['value']:.3g}, "
          f"{r['search']['trials_used']} trials, exit {app.last_code}")
    assert r["command"] == ["bisect", "run", *argv[1:]]
    assert r["engine_config"] == {"user": user, "file": str(mine), "hookable": E.hookable(user), "changed": [], "child": False,
                                  "mode": "prefill", "parts": {"tokens": "hookable", "units": "hookable", "search": "hookable"}}
    assert f"Your engine configuration ({mine})" in overview
    assert "your settings run with hooks as they are" in overview

"""The unit view of a router shows its layer's routing agreement, flips and replay."""

from __future__ import annotations

import pytest

from numbisect.cli import main
from numbisect.report.document import load_report
from numbisect.tui.widgets.unit_detail import UnitDetail
from numbisect.tui.widgets.unit_tree import UnitTree

pytestmark = pytest.mark.asyncio
D = "fixtures/models/qwen3_moe"


@pytest.fixture(scope="module")
def routed_report(tmp_path_factory):
    import os

    from tui.support import ROOT

    out = tmp_path_factory.mktemp("routing") / "r.json"
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        code = main(["compare", "--ref", f"hf:{D}", "--engine", f"hf:{D}", "--ref-dtype", "float32", "--engine-dtype",
                     "float32", "--trace", "fixtures/traces/qwen3_moe.jsonl", "--engine-fault", "output_noise=0.3@layers.1.moe.router",
                     "--replay-routing", "ref", "--out", str(out), "-q"])
    finally:
        os.chdir(cwd)
    assert code in (0, 1) and out.exists()
    return str(out)


async def test_selecting_a_router_shows_agreement_flips_and_replay(routed_report):
    from numbisect.tui.app import BisectApp

    r = load_report(routed_report)
    row = next(x for x in r["routing"]["layers"] if x["unit"] == "layers.1.moe.router")
    app = BisectApp(report=r, report_path=routed_report)
    async with app.run_test(size=(110, 40)) as pilot:
        await pilot.press("2")
        tree = app.main.query_one(UnitTree)
        tree.move_cursor(tree.node_for("layers.1.moe.router"))
        await pilot.pause()
        assert app.selected == "layers.1.moe.router"
        detail = str(app.main.query_one(UnitDetail).render())
        p = row["propagated"]
        assert f"propagated: {100 * p['agree_frac']:.1f}% agree, {p['flipped']} of {p['tokens']} tokens flipped" in detail
        f = p["flips"][0]
        assert f"flip sample {f['sample']} pos {f['position']}" in detail
        assert "replay (ref) here alone" in detail
        tree.move_cursor(tree.node_for("layers.1.attn"))
        await pilot.pause()
        assert "routing (top-k expert sets)" not in str(app.main.query_one(UnitDetail).render())

"""Linear attention's recurrent state (the report's `recurrent_state` section) in `bisect
report md` and in the TUI, on a real `bisect compare` report: Qwen3.5-MoE's fixture (Gated
DeltaNet in layers 0-2), the engine with weight noise planted in layers.1.attn, in decode
mode, on the fixture's first sample and one of 200 tokens (chunk boundaries at 64, 128, 192).

What a user relies on: the Markdown export has the section (per linear-attention layer its
state error after the sample, local, largest at a chunk boundary, after the decode steps and
largest after a step; the first layer above the unit tolerance); the TUI's unit detail of a
linear-attention layer shows the same figures, and the Overview names the first layer whose
state is above the tolerance. Expected texts are read from the report's own numbers.
"""

from __future__ import annotations

import json
import random

import pytest
from conftest import model_dir, trace_path

from numbisect.cli import main
from numbisect.common.formatting import fmt
from numbisect.report.document import load_report, validate

pytestmark = pytest.mark.usefixtures("one_thread")

NAME = "qwen3_5_moe"
FAULTY = "layers.1.attn"


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("recurrent_views")
    rng = random.Random(0)
    long = {"prompt_ids": [rng.randrange(256) for _ in range(80)], "completion_ids": [rng.randrange(256) for _ in range(120)]}
    trace = d / "t.jsonl"
    trace.write_text(open(trace_path(NAME)).readline().strip() + "\n" + json.dumps(long) + "\n")
    out = d / "r.json"
    code = main(["compare", "--ref", f"hf:{model_dir(NAME)}", "--engine", f"hf:{model_dir(NAME)}", "--trace", str(trace),
                 "--ref-dtype", "float32", "--engine-dtype", "float32", "--engine-fault", f"weight_noise=0.3@{FAULTY}",
                 "--engine-mode", "decode", "-q", "--out", str(out)])
    assert code in (0, 1) and validate(json.loads(out.read_text())) == []
    return str(out)


def _rows(path: str) -> dict:
    return {row["unit"]: row for row in load_report(path)["recurrent_state"]["layers"]}


def test_the_report_has_the_state_of_every_linear_layer_the_faulty_one_above_the_tolerance(report):
    rs = load_report(report)["recurrent_state"]
    assert list(_rows(report)) == ["layers.0.attn", "layers.1.attn", "layers.2.attn"]
    assert rs["first_above_tol"] == FAULTY and rs["first_above_tol_decode"] == FAULTY
    assert all(row["propagated"]["boundaries"] and row["decode"]["boundaries"] for row in rs["layers"])


def test_markdown_export_has_the_recurrent_state_section(report, capsys):
    assert main(["report", "md", report]) == 0
    md = capsys.readouterr().out
    lines = md.splitlines()
    head = next(i for i, x in enumerate(lines) if x.startswith("**Recurrent state (linear attention):**"))
    assert lines[head + 2].startswith("| linear layer | after the sample (propagated) | local |")
    assert "after decode steps" in lines[head + 2]  # decode rows: their columns
    for unit, row in _rows(report).items():
        cells = [c.strip() for c in next(x for x in lines if x.startswith(f"| `{unit}` |")).strip("|").split("|")]
        worst = max(row["propagated"]["boundaries"], key=lambda b: b["rel_l2"])
        worst_step = max(row["decode"]["boundaries"], key=lambda b: b["rel_l2"])
        assert cells == [f"`{unit}`", fmt(row["propagated"]["final"]["rel_l2"]), fmt(row["local"]["final"]["rel_l2"]),
                         f"{fmt(worst['rel_l2'])} at {worst['tokens']} tokens", fmt(row["decode"]["final"]["rel_l2"]),
                         f"{fmt(worst_step['rel_l2'])} at {worst_step['tokens']} tokens"]
    assert f"First layer whose state is above rel-L2 0.01: `{FAULTY}`; after decode steps: `{FAULTY}`." in md
    assert "not read" not in md  # every decode point was read


@pytest.mark.asyncio
async def test_the_tui_shows_a_linear_layers_state_in_its_unit_detail(report):
    from numbisect.tui.app import BisectApp, preflight
    from numbisect.tui.widgets.overview import OverviewPanel
    from numbisect.tui.widgets.unit_detail import UnitDetail
    from numbisect.tui.widgets.unit_tree import UnitTree

    r = load_report(report)
    preflight(r, report)
    row = _rows(report)[FAULTY]
    app = BisectApp(report=r, report_path=report)
    async with app.run_test(size=(130, 50)) as pilot:
        await pilot.pause()
        ov = str(app.main.query_one(OverviewPanel).render())
        assert (f"recurrent state: first state above rel-L2 0.01: {FAULTY}; first state above rel-L2 0.01 after decode "
                f"steps: {FAULTY}") in ov
        await pilot.press("2")
        tree = app.main.query_one(UnitTree)
        tree.move_cursor(tree.node_for(FAULTY))
        await pilot.pause()
        assert app.selected == FAULTY
        detail = str(app.main.query_one(UnitDetail).render())
        assert "recurrent state (rel-L2 against the reference's state after the same tokens)" in detail
        assert f"propagated (on its own inputs): after the sample {fmt(row['propagated']['final']['rel_l2'])}" in detail
        assert f"local (fed the reference's input): after the sample {fmt(row['local']['final']['rel_l2'])}" in detail
        assert f"decode (run as a rollout, one token per step): after the last step {fmt(row['decode']['final']['rel_l2'])}" in detail
        bounds = ", ".join(f"{b['tokens']}: {fmt(b['rel_l2'])}" for b in row["propagated"]["boundaries"])
        assert f"every chunk, by tokens: {bounds}" in detail
        assert "the first linear-attention layer whose state is above rel-L2 0.01\n" in detail
        assert "the first linear-attention layer whose state is above rel-L2 0.01 after decode steps" in detail
        tree.move_cursor(tree.node_for("layers.0.attn"))  # upstream of the fault: its state, not the first above
        await pilot.pause()
        detail = str(app.main.query_one(UnitDetail).render())
        assert "recurrent state" in detail and "the first linear-attention layer" not in detail
        tree.move_cursor(tree.node_for("layers.3.attn"))  # full attention: no state
        await pilot.pause()
        assert "recurrent state" not in str(app.main.query_one(UnitDetail).render())

"""A weight check's report (`bisect weights`, numbisect.live) shown by `bisect report show`,
`report md` and the TUI's Overview: the units whose engine weights differ, from the report
alone (no model)."""

from __future__ import annotations

import copy
import json

import pytest
from conftest import FIXTURES

from numbisect.report.document import validate

WEIGHTS = {
    "ok": False, "step": "check 2", "compared_with": ["attach", "check 1"], "seconds": 0.31, "functional": True,
    "functional_tol": 0.05, "counts": {"ok": 13, "unwritten": 1}, "unmapped": ["model.layers.0.extra.weight"],
    "units": [
        {"unit": "layers.0.attn", "status": "ok", "tensors_checked": 4, "tensors": [], "local_rel_l2": 0.004, "summary": ""},
        {"unit": "layers.2.mlp", "status": "unwritten", "tensors_checked": 3, "local_rel_l2": 0.21,
         "tensors": [{"tensor": "model.layers.2.mlp.down_proj.weight", "status": "unwritten", "how": "unwritten"}],
         "summary": "down_proj.weight still the weights of check 1"},
    ],
}


def weights_report(weights=WEIGHTS) -> dict:
    r = json.loads((FIXTURES / "reports" / "qwen3_moe_compare_vllm.json").read_text())
    r["kind"] = "weights"
    r["weights"] = copy.deepcopy(weights)
    return r


def test_show_md_and_the_tui_name_the_units_whose_weights_differ():
    from numbisect.report.summary import render
    from numbisect.report.tools import markdown
    from numbisect.tui.widgets.overview import overview_text

    r = weights_report()
    assert validate(r) == []
    text = render(r)
    assert "weights (check 2): 1 of 2 units differ, checked by digest and by local error (0.31 s)" in text
    assert "layers.2.mlp             unwritten       down_proj.weight still the weights of check 1 (local error 0.21)" in text
    assert "engine tensors no reference tensor names: model.layers.0.extra.weight" in text
    assert text.index("weights (check 2)") < text.index("tokens        count")  # the finding before the tokens it was run on
    assert "verdict: ~~ TOKENS ALIGNED, ENGINE WEIGHTS DIFFER" in text  # never a bare OK ALIGNED beside it
    md = markdown(r)
    assert "**Engine weights** (check 2): 1 of 2 units differ" in md and "**Verdict: tokens aligned, engine weights DIFFER.**" in md
    assert "| `layers.2.mlp` | unwritten | down_proj.weight still the weights of check 1 |" in md
    tui = overview_text(r).plain
    assert "weights (check 2): 1 of 2 units differ" in tui and "layers.2.mlp" in tui
    assert "~~ TOKENS ALIGNED, ENGINE WEIGHTS DIFFER" in tui
    from numbisect.tui.model import culprit_lines

    banner = " ".join(text for _, text in culprit_lines(r))  # the TUI's line under the verdict
    assert "nothing to bisect" not in banner and "compute with other weights" in banner
    ok = weights_report({**WEIGHTS, "ok": True, "unmapped": [], "units": WEIGHTS["units"][:1]})
    assert "weights (check 2): all ok, checked by digest and by local error" in render(ok)
    assert "verdict: OK ALIGNED" in render(ok)
    assert "layers.0.attn" not in render(ok).split("weights (check 2)")[1].split("\n\n")[0]  # ok units are not listed


def test_a_report_without_a_weight_check_shows_none():
    from numbisect.report.summary import render
    from numbisect.report.tools import markdown

    r = json.loads((FIXTURES / "reports" / "qwen3_moe_compare_vllm.json").read_text())
    assert "weights (" not in render(r) and "Engine weights" not in markdown(r)


@pytest.mark.parametrize("weights", [
    {"ok": "no", "units": [3, "x", {"status": 5}, {"unit": None, "status": None, "summary": ["a"], "local_rel_l2": True}],
     "seconds": "soon", "step": 7, "unmapped": [1, None], "functional": "yes"},
    {"ok": True, "units": []},
    {"units": "all"},
])
def test_a_strange_weights_section_is_shown_safely(weights):
    """Valid JSON that the schema refuses or that is odd: fewer lines, never an exception."""
    from numbisect.report.summary import render
    from numbisect.report.tools import markdown
    from numbisect.tui.widgets.overview import overview_text

    r = weights_report(weights)
    render(r), markdown(r), overview_text(r)

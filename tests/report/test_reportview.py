"""The report view every renderer reads, the one reader of report numbers, and the shared
command-line options (parsed and checked where they are declared, before anything loads)."""

from __future__ import annotations

import copy
import json
import math

import pytest
from conftest import ROOT, model_dir, trace_path

from numbisect.cli import main
from numbisect.common.formatting import num
from numbisect.report.sections.routing import routing_lines
from numbisect.report.summary import render
from numbisect.report.tools import diff, markdown, render_diff
from numbisect.report.view import ReportView, view

PLANTED = ROOT / "fixtures" / "reports" / "qwen3_moe_planted_fault.json"


def planted() -> dict:
    return json.loads(PLANTED.read_text())


@pytest.mark.parametrize("x, want", [
    (None, None), (True, None), ("x", None), ([1], None), ({"a": 1}, None),
    (3, 3.0), (1.5, 1.5), ("1e-3", 1e-3), ("inf", math.inf), ("-inf", -math.inf), (10**400, math.inf), (-(10**400), -math.inf),
])
def test_one_reader_of_report_numbers(x, want):
    assert num(x) == want


def test_nan_stored_as_a_string_reads_as_nan():
    assert math.isnan(num("nan"))


def test_a_huge_integer_in_the_routing_section_reads_as_infinite_as_everywhere_else():
    r = planted()
    r["routing_replay"] = {"direction": "ref", "metric": "k3-mean", "baseline": 10**400, "replayed": 1e-5, "from_flips": 0.0,
                           "from_drift": 1e-5, "layers": []}
    r["routing"] = {"spec": {"top_k": 2, "num_experts": 8, "scoring": "softmax"}, "layers": []}
    line = next(ln for ln in routing_lines(r) if ln.startswith("routing replay"))
    assert "k3-mean inf -> 1.00e-05" in line


def test_the_view_escapes_every_string_once_and_every_renderer_shows_the_escaped_name():
    r = planted()
    evil = "layers.2.moe.experts\x1b[31m"
    r["culprits"][0]["unit"] = evil
    v = view(r)
    assert v.named_culprits[0]["unit"] == "layers.2.moe.experts\\x1b[31m"
    assert r["culprits"][0]["unit"] == evil  # the report itself is left as read
    for text in (render(r), markdown(r), render_diff(diff(planted(), r))):
        assert "\x1b" not in text and "\\x1b[31m" in text


def test_the_view_is_reused_for_the_same_report_and_absent_sections_read_empty():
    r = planted()
    assert view(r) is view(r) and isinstance(view(r), ReportView) and view(view(r)) is view(r)
    for key in ("routing", "routing_replay", "engine_modes", "capture", "swap", "post_search_errors"):
        r.pop(key, None)
    v = view(copy.deepcopy(r))
    assert v.routing is None and v.routing_replay is None and v.engine_modes is None and v.swap is None
    assert v.post_search_errors == [] and v.swap_lines == []
    assert [u["name"] for u in v.units] == [u["name"] for u in r["units"]]


def _error(capsys, argv) -> tuple[int, list[str]]:
    code = main(argv)
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    return code, err


@pytest.mark.parametrize("cmd", ["compare", "run", "tui"])
@pytest.mark.parametrize("value, words", [
    ("floorxten", "floorxN needs a positive number N"), ("flor", "give a number, floor, or floorxN"), ("-1", "must be a number at or above 0"),
])
def test_threshold_is_parsed_where_declared_with_one_type_for_every_command(capsys, cmd, value, words):
    """compare, run and tui read --threshold alike (tui took only a float before); a bad
    one is refused while the arguments are parsed, before any model loads."""
    d = model_dir("qwen3")
    code, err = _error(capsys, [cmd, "--ref", f"hf:{d}", "--engine", f"hf:{d}", "--trace", trace_path("qwen3"), "--threshold", value])
    assert code == 2 and len(err) == 1 and err[0].startswith("bisect: error: bad --threshold") and words in err[0]


def test_threshold_floor_loads_nothing_while_parsing(capsys, monkeypatch):
    """`--threshold floor` is a marker until the command body resolves it: a later usage
    error is reported without calibrating."""
    import numbisect.commands.calibrate as C

    monkeypatch.setattr(C, "resolve_threshold", lambda *a, **k: pytest.fail("calibrated during argument checks"))
    d = model_dir("qwen3")
    code, err = _error(capsys, ["run", "--ref", f"hf:{d}", "--engine", f"hf:{d}", "--trace", trace_path("qwen3"),
                                "--threshold", "floor", "--capture", "full"])
    assert code == 2 and err == ["bisect: error: --capture full needs --capture-dir DIR"]


@pytest.mark.parametrize("argv, line", [
    (["run", "--prefix-cache-mb", "nan"], "--prefix-cache-mb must be a positive number of MB (got nan)"),
    (["compare", "--max-capture-mb", "0"], "--max-capture-mb must be a positive number of MB (got 0)"),
    (["run", "--max-trials", "0"], "--max-trials must be at least 1"),
    (["run", "--engine", "dump:/nowhere"], "--engine dump:DIR works with `bisect compare` only: a dump cannot run swap trials"),
])
def test_options_checked_once_where_parsed(capsys, argv, line):
    d = model_dir("qwen3")
    full = [*argv, "--ref", f"hf:{d}", "--trace", trace_path("qwen3")]
    if "--engine" not in argv:
        full += ["--engine", f"hf:{d}"]
    code, err = _error(capsys, full)
    assert code == 2 and err == [f"bisect: error: {line}"]

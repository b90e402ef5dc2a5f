"""Hostile and strange reports: everything that reads a report file survives them.

A report is a file anyone can hand you. `bisect report show|validate|diff|md FILE` and
`bisect tui FILE` must either refuse it (exit 2, exactly one "bisect: error:" line, nothing
on stdout), or show it: no traceback, no internal error, no raw control character on stdout
(a report's escape sequences cannot drive the terminal), Markdown whose tables keep their
columns, and no file changed (the report's bytes and mtime stay, nothing is left beside it).

The generated cases start from the bundled reports and mutate them: strings with control
characters, escape sequences, Rich markup, Markdown, huge lengths and odd Unicode (lone
surrogates, bidi overrides); numbers where strings are expected and the other way round;
NaN, Infinity and integers too large for a float; empty lists and objects; optional fields
deleted; unknown fields added; unit names renamed everywhere and unit parents that form a
cycle; deep nesting. Each case runs every report command in-process and the TUI's drawing
(`preflight`, every text the app draws); a sample also runs the app headless. The tests
print how many cases ran (`pytest -s`) and assert a floor on that number.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import re
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from numbisect.cli import main

ROOT = Path(__file__).resolve().parents[2]
BASES = {
    "run": ROOT / "fixtures" / "reports" / "qwen3_moe_planted_fault.json",
    "compare_vllm": ROOT / "fixtures" / "reports" / "qwen3_moe_compare_vllm.json",
    "compare_hf": ROOT / "tests" / "data" / "report_compare_hf.json",
    "conditions": ROOT / "fixtures" / "reports" / "qwen3_moe_conditions.json",
    "engine_config": ROOT / "fixtures" / "reports" / "qwen3_moe_engine_config.json",
    "engine_config_run": ROOT / "fixtures" / "reports" / "qwen3_moe_engine_config_compiled.json",
}
BASE = {k: json.loads(p.read_text()) for k, p in BASES.items()}


def _every_section() -> dict:
    """The run report with every optional section the tool writes (shapes copied from real
    runs of the qwen3_moe fixture: decode mode, routing with replay, a floor threshold, a
    precision what-if, a failed post-search step, --engine-config), so the generated cases reach their readers."""
    r = copy.deepcopy(BASE["run"])
    r["threshold"]["threshold_origin"] = {"source": "file", "file": "floor.json", "factor": 2.0, "floor": 0.0005, "variants": ["batch", "attn"]}
    r["culprits"][0]["precision"] = {"suggested": "accumulate the expert weighted sum in fp32", "whatifs": [
        {"whatif": "fp32 weighted sum", "fix": "accumulate in fp32", "metric": "k3-mean", "before": 0.005, "value": 1e-5, "k3_mean": 1e-5,
         "verdict": "fixes", "line": "k3-mean 5.08e-03 -> 1.00e-05: fixes", "replaced_faults": [], "faults_not_carried": [], "threshold": 0.001}]}
    r["post_search_errors"] = [{"step": "whatif", "unit": "layers.2.moe.experts", "error": "RuntimeError: out of memory"}]
    flip = {"sample": 2, "position": 6, "token_id": 141, "completion": False, "ref_experts": [3, 7], "engine_experts": [6, 7],
            "ref_margin": 0.0008, "engine_margin": 0.0043, "logit_max_abs": 0.0234}
    rpass = {"tokens": 690, "agree_frac": 0.97, "flipped": 19, "completion_tokens": 429, "completion_agree_frac": 0.98,
             "logit_error": {"rel_l2": 0.033, "max_abs": 0.14, "mean_abs": 0.016, "cosine": 0.9995}, "margin_p50_all": 0.023,
             "margin_p50_flipped": 0.0013, "flips": [flip]}
    r["routing"] = {"spec": {"top_k": 2, "num_experts": 8, "scoring": "softmax", "norm_topk": True}, "source": "hooked router",
                    "layers": [{"unit": f"layers.{i}.moe.router", "layer": i, "propagated": copy.deepcopy(rpass), "local": copy.deepcopy(rpass)}
                               for i in range(2)]}
    r["routing_replay"] = {"direction": "ref", "replayed_on": "engine", "weights": "own router", "metric": "k3-mean", "group": "completion",
                           "baseline": 3.6e-05, "replayed": 3.59e-05, "from_flips": -2.5e-07, "from_drift": 3.59e-05,
                           "groups_replayed": {"completion": 3.59e-05}, "groups_baseline": {"completion": 3.6e-05},
                           "tokens_replaced": {"layers.1.moe.router": 19},
                           "layers": [{"unit": f"layers.{i}.moe.router", "layer": i, "flips_before": 19, "flips_after": 0,
                                       "value_replayed_alone": 3.5e-05, "from_flips": 3.4e-07, "flips_after_alone": 0} for i in range(2)]}
    groups = {"completion": {"tokens": 429, "k3_mean": 1.2e-08, "k3_p99": 1.5e-07, "k3_max": 8.6e-07, "kl_mean": 4.9e-08, "top1_agree": 1.0}}
    r["engine_modes"] = {
        "mode": "decode",
        "prefill_vs_reference": {"value": 1.18e-08, "groups": copy.deepcopy(groups)},
        "decode_vs_reference": {"value": 1.19e-08, "groups": copy.deepcopy(groups)},
        "decode_vs_prefill": {"value": 5.6e-13, "groups": copy.deepcopy(groups),
                              "logprob_diff": {"tokens": 429, "max_abs": 5.4e-06, "mean_abs": 7.3e-07, "frac_equal": 0.11},
                              "first_unit": {"bitwise": "layers.0.attn", "above_tol": None},
                              "units_differing": [{"name": "layers.0.attn", "rel_l2": 2.2e-07, "max_abs": 6e-07}]},
        "not_swappable": {"units": ["layers.0.attn", "layers.0"], "kinds": ["attn", "layer"], "reason": "would need the engine's KV cache"},
    }
    r["inputs"]["engine"]["mode"] = "decode"
    r["logprob_contract"] = {"verdict": "processed", "positions": 480, "raw_error": 0.1437, "fit_error": 0.0039, "inconsistent_raw": 0,
                             "fitted": {"temperature": 0.7, "top_p": 0.9, "top_k": 0, "kept_mass": 0.972, "inconsistent": 0},
                             "advice": "the rollout's log-probs are processed (temperature 0.7, top-p 0.9)", "source": "engine_config"}
    r["engine_config"] = copy.deepcopy(BASE["engine_config_run"]["engine_config"])
    # decode mode with a child: the user's engine's decode run against its own prefill run
    r["engine_config"]["mode"] = "decode"
    r["engine_config"]["engine_modes"] = {k: copy.deepcopy(r["engine_modes"][k]) for k in ("mode", "prefill_vs_reference", "decode_vs_reference")}
    r["engine_config"]["engine_modes"]["decode_vs_prefill"] = {k: copy.deepcopy(r["engine_modes"]["decode_vs_prefill"][k])
                                                               for k in ("value", "groups", "logprob_diff")}
    r["routing_replay"]["configuration"] = "hookable"
    # linear attention's recurrent state, decode mode (shapes of a real qwen3_5_moe run)
    err = copy.deepcopy(next(u["propagated"] for u in r["units"] if u["propagated"] and not u["propagated"]["ulps"]["bitwise_equal"]))
    brief = {k: err[k] for k in ("rel_l2", "max_abs", "cosine")}
    state = {"final": err, "per_sample": [{"sample": 0, "tokens": 70, **brief}], "boundaries": [{"tokens": 64, "samples": 1, **brief}]}
    r["recurrent_state"] = {"chunk_size": 64, "max_boundaries": 8, "source": {"ref": "transformers", "engine": "vLLM mamba cache"},
                            "first_above_tol": None, "engine_mode": "decode", "decode_unread": ["layers.0.attn@66 (sample 0)"],
                            "layers": [{"unit": "layers.0.attn", "layer": 0, "state_shape": [4, 32, 32], "propagated": state,
                                        "local": copy.deepcopy(state), "decode": copy.deepcopy(state)}]}
    return r


def _swap_run() -> dict:
    """A `bisect run --swap moe` report (its search block is the swap's)."""
    r = copy.deepcopy(BASE["run"])
    r["swap"] = {"kinds": ["moe"], "units": ["layers.0.moe", "layers.1.moe"], "before": 0.005, "after": 4e-05, "fixed": True,
                 "lines": ["swapping 2 moe units: k3-mean 5.07e-03 -> 4.00e-05: the divergence is inside moe",
                           "  group completion   k3 mean 5.07e-03 -> 4.00e-05"]}
    r["search"].update(strategy="swap", verdict="culprits", stop_reason=r["swap"]["lines"][0], contributions={})
    r["culprits"] = []
    return r


def _diffuse_run() -> dict:
    r = copy.deepcopy(BASE["run"])
    r["search"].update(verdict="diffuse", contributions={f"layers.{i}": {"alone": 0.004, "complement": 0.002} for i in range(4)})
    r["search"]["diffuse_kinds"] = {"kinds": ["norm", "moe", "attn"], "units": 17, "layers": 4, "value": 0.0,
                                    "per_kind": {k: {"alone": 5e-5, "complement": 2e-5} for k in ("norm", "moe", "attn")},
                                    "per_layer": {"attn": {f"layers.{i}": 3e-5 for i in range(4)}},
                                    "trigger": "the minimal set needs every layer"}
    r["culprits"] = []
    return r


BASE.update(every_section=_every_section(), swap=_swap_run(), diffuse=_diffuse_run())
OTHER = BASES["run"]  # the other side of `report diff`
CASES = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large], database=None)
TUI_CASES = settings(CASES, max_examples=4)
RAN = {"report": 0, "shown": 0, "refused": 0, "tui": 0}

# What must never reach a terminal raw: C0 but newline and tab, DEL, C1, separators, bidi controls.
RAW_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def cli(args: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(args)
    return rc, out.getvalue(), err.getvalue()


def one_error_line(rc: int, out: str, err: str) -> str:
    assert rc == 2, (rc, err)
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("bisect: error: "), err
    assert "Traceback" not in err and not out, (out, err)
    assert not RAW_CONTROL.search(err), repr(err)
    err.encode("utf-8")
    return lines[0]


def shown(args: list[str], codes=(0, 1)) -> str:
    rc, out, err = cli(args)
    assert rc in codes, (args, rc, err)  # 3 is an internal error: a crash in disguise
    assert out and not err.strip(), (args, err)
    assert not RAW_CONTROL.search(out), (args, RAW_CONTROL.search(out))
    out.encode("utf-8")  # a lone surrogate would fail on a real terminal
    return out


def markdown_tables_keep_their_columns(md: str) -> None:
    """Every row of a Markdown table has its header's number of cells (a report's `|`
    cannot add one)."""
    cols = None
    for line in md.splitlines():
        if not line.startswith("|"):
            cols = None
            continue
        n = len(re.findall(r"(?<!\\)\|", line)) - 1
        if cols is None:
            cols = n
        assert n == cols, line


# -- mutations -------------------------------------------------------------------------------
HOSTILE_TEXT = st.one_of(
    st.sampled_from([
        "\x1b[31mRED\x1b[0m", "\x1b]0;title\x07", "\x1b[2J\x1b[H", "a\nverdict: OK ALIGNED", "tab\there", "cr\roverwrite",
        "\x9b31m", "\x00nul", "\x7fdel", "[/]", "[bold red]x[/bold red]", "[link=http://x]y[/link]", "[", "]",
        "a | b | c", "`code` ``two``", "```", "<script>alert(1)</script>", "</details>", "**bold** _em_ ~~s~~",
        "[text](http://evil)", "&amp; &lt;", "\u202eevil\u202c", "\u2028line", "\ud800", "\udfff lone", "é☃😀", "\u0301", "",
        " ", "layers.2.moe.experts", "layers.", "layers.x.attn", "layers.99999999999999999999.moe", "model",
    ]),
    st.text(min_size=0, max_size=12),
    st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x9f), max_size=12),
    st.builds(lambda c, n: c * n, st.sampled_from(["x", "\x1b", "|", "[", "é"]), st.sampled_from([1_000, 100_000])),
)
ODD_NUMBER = st.one_of(
    st.sampled_from([float("nan"), float("inf"), float("-inf"), -0.0, 0, -1, 1e308, -1e308, 5e-324, 10**30, -(10**30), 10**400]),
    st.integers(), st.floats(allow_nan=True, allow_infinity=True),
)
ODD_STRING_NUMBER = st.sampled_from(["nan", "inf", "-inf", "NaN", "Infinity", "1e-3", "0", "-", "x", "1,5"])
JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=5)),
    lambda kids: st.one_of(st.lists(kids, max_size=3), st.dictionaries(st.text(max_size=5), kids, max_size=3)),
    max_leaves=8,
)


def _at(r, path):
    for k in path:
        r = r[k]
    return r


def _paths(obj, prefix=()):
    """Every path into a report (the first 3 items of each list)."""
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:3]):
            yield from _paths(v, prefix + (i,))


def test_the_bases_are_valid_reports():
    from numbisect.report.document import validate

    for name, r in BASE.items():
        assert validate(r) == [], name


PATHS = {k: [p for p in _paths(r) if p] for k, r in BASE.items()}
STRING_PATHS = {k: [p for p in ps if isinstance(_at(BASE[k], p), str)] for k, ps in PATHS.items()}
NUMBER_PATHS = {k: [p for p in ps if isinstance(_at(BASE[k], p), (int, float)) and not isinstance(_at(BASE[k], p), bool)] for k, ps in PATHS.items()}
# Mutations that mostly keep a report schema-valid (so the readers get to see it), and
# those that mostly do not (so the refusal is tested); the first are drawn more often.
KEEPS_VALID = ["string", "string", "string", "odd_number", "odd_number", "odd_number", "delete", "extra", "rename", "rename", "parent", "deep_extra"]
BREAKS = ["swap_type", "empty", "deep", "replace"]


def _rename_unit(r: dict, old: str, new: str) -> None:
    """Rename a unit everywhere a report names it."""

    def walk(o):
        if isinstance(o, dict):
            for k in list(o):
                v = o.pop(k)
                o[new if k == old else k] = walk(v)
            return o
        if isinstance(o, list):
            return [walk(v) for v in o]
        return new if o == old else o

    for k in list(r):
        if k not in ("schema_version", "kind", "verdict"):
            r[k] = walk(r[k])


DEEP = "__DEEP__"


@st.composite
def mutation(draw, r: dict, base: str, kinds: list[str]) -> None:
    """Apply one mutation of one of `kinds` to report `r` in place."""
    kind = draw(st.sampled_from(kinds))
    paths = {"string": STRING_PATHS, "odd_number": NUMBER_PATHS}.get(kind, PATHS)[base]
    # a section first, then a path in it: small sections are reached as often as big ones
    sections = sorted({p[0] for p in paths})
    if sections and kind not in ("extra", "deep_extra"):
        top = draw(st.sampled_from(sections))
        paths = [p for p in paths if p[0] == top]
    if kind == "rename":
        names = [u["name"] for u in r.get("units") or [] if isinstance(u, dict) and isinstance(u.get("name"), str)]
        if names:
            _rename_unit(r, draw(st.sampled_from(names)), draw(HOSTILE_TEXT))
        return
    if kind == "parent":
        units = [u for u in r.get("units") or [] if isinstance(u, dict)]
        if len(units) >= 2:
            a, b = draw(st.sampled_from(units)), draw(st.sampled_from(units))
            a["parent"] = b.get("name") if isinstance(b.get("name"), str) else "model"  # may be itself: a cycle
            if draw(st.booleans()):
                b["parent"] = a.get("name") if isinstance(a.get("name"), str) else "model"
        return
    if kind in ("extra", "deep_extra"):  # an unknown field, which readers must ignore
        dicts = [p for p in [()] + paths if isinstance(_try_at(r, p), dict)]
        target = _try_at(r, draw(st.sampled_from(dicts)))
        if isinstance(target, dict):
            value = draw(JSON) if kind == "extra" else f"{DEEP}{draw(st.sampled_from([3, 20, 63, 70, 2_000, 100_000]))}"
            target[draw(st.one_of(HOSTILE_TEXT, st.text(max_size=5)))] = value
        return
    path = draw(st.sampled_from(paths))
    try:
        parent = _at(r, path[:-1])
        old = parent[path[-1]]
    except (KeyError, IndexError, TypeError):
        return  # an earlier mutation changed the shape
    if not isinstance(parent, (dict, list)):
        return
    key = path[-1]
    if kind == "delete":
        del parent[key]
        return
    if kind == "string":
        new = draw(HOSTILE_TEXT)
    elif kind == "swap_type":  # a number where a string is expected, and the other way round
        if isinstance(old, str):
            new = draw(st.one_of(ODD_NUMBER, st.booleans(), st.none()))
        elif isinstance(old, (int, float)) and not isinstance(old, bool):
            new = draw(st.one_of(ODD_STRING_NUMBER, st.builds(str, st.just(old))))
        else:
            new = draw(st.one_of(st.text(max_size=5), st.integers(), st.none()))
    elif kind == "odd_number":  # the report's own encoding of non-finite numbers included
        new = draw(st.one_of(ODD_NUMBER, st.sampled_from(["nan", "inf", "-inf"]))) if not isinstance(old, str) else draw(ODD_STRING_NUMBER)
    elif kind == "empty":
        new = [] if isinstance(old, list) else ({} if isinstance(old, dict) else draw(st.sampled_from(["", [], {}])))
    elif kind == "deep":
        new = f"{DEEP}{draw(st.sampled_from([3, 20, 70, 2_000, 100_000]))}"
    else:
        new = draw(JSON)
    parent[key] = new


def _try_at(r, path):
    try:
        return _at(r, path)
    except (KeyError, IndexError, TypeError):
        return None


def report_text(r: dict) -> str:
    """JSON text; NaN/Infinity as the literals json.loads reads; deep nesting spliced in."""
    text = json.dumps(r)
    return re.sub(f'"{DEEP}(\\d+)"', lambda m: "[" * int(m.group(1)) + "1" + "]" * int(m.group(1)), text)


@st.composite
def hostile_report(draw, kinds: list[str] = KEEPS_VALID + BREAKS) -> tuple[str, str]:
    base = draw(st.sampled_from(sorted(BASE)))
    r = copy.deepcopy(BASE[base])
    for _ in range(draw(st.integers(1, 3))):
        draw(mutation(r, base, kinds))
    return base, report_text(r)


# -- the checks ------------------------------------------------------------------------------
def check_report(path: Path) -> bool:
    """Refused by every command with the same one line, or shown by every one. True when shown."""
    rc, out, err = cli(["report", "validate", str(path)])
    if rc != 0:
        line = one_error_line(rc, out, err)
        for args in (["show", str(path)], ["md", str(path)], ["diff", str(OTHER), str(path)], ["diff", str(path), str(OTHER)]):
            assert one_error_line(*cli(["report", *args])) == line, args
        assert one_error_line(*cli(["tui", str(path)])) == line
        return False
    assert out.startswith(f"{path}: valid numbisect report"), out
    shown(["report", "show", str(path)])
    markdown_tables_keep_their_columns(shown(["report", "md", str(path)], codes=(0,)))
    shown(["report", "diff", str(OTHER), str(path)])
    shown(["report", "diff", str(path), str(OTHER)])
    json.loads(shown(["report", "diff", "--json", str(path), str(OTHER)]))
    from numbisect.report.document import load_report
    from numbisect.tui.app import preflight

    preflight(load_report(path), str(path))  # every text the TUI draws: raises InputError if it cannot
    return True


def files_of(d: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in d.iterdir()}


@pytest.mark.slow  # no model, but minutes of generated cases: the full run only
@CASES
@given(case=hostile_report())
def test_hostile_reports_are_refused_in_one_line_or_shown_safely(case):
    base, text = case
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "r.json"
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        before, other = files_of(Path(d)), OTHER.stat().st_mtime_ns
        ok = check_report(path)
        assert files_of(Path(d)) == before, "a report command changed or left a file"
        assert OTHER.stat().st_mtime_ns == other
    RAN["report"] += 1
    RAN["shown" if ok else "refused"] += 1


def test_hostile_report_case_count():
    """Runs after the generated cases above (file order): they really ran, both ways."""
    print(f"hostile report cases run: {RAN['report']} ({RAN['shown']} shown, {RAN['refused']} refused)")
    assert RAN["report"] >= 80
    assert RAN["shown"] >= 20 and RAN["refused"] >= 7


KEYS = ("2", "down", "down", "l", "enter", "slash", "a", "escape", "3", "g", "g", "4", "down", "down", "1", "question_mark", "escape")


async def _keys(pilot) -> None:
    for key in KEYS:
        await pilot.press(key)
    await pilot.pause()
    await pilot.press("q")


def run_headless(self, **_):
    """BisectApp.run for tests: headless, pressing KEYS (every tab and view), then q."""
    from textual.app import App

    return App.run(self, headless=True, size=(100, 32), auto_pilot=_keys)


@pytest.mark.slow  # no model, but minutes of generated cases: the full run only
@settings(TUI_CASES, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
@given(case=hostile_report(KEEPS_VALID))
def test_bisect_tui_opens_a_hostile_report_it_accepts(case):
    """A sample: `bisect tui FILE` on a schema-valid hostile report runs the app (headless,
    every tab and view drawn, then q) and exits 0 with nothing on stderr; an error inside
    the app would be one line and exit 2 (see test_an_error_inside_the_app_is_one_line)."""
    from hypothesis import assume

    from numbisect.tui.app import BisectApp

    base, text = case
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "r.json"
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        assume(cli(["report", "validate", str(path)])[0] == 0)
        before = files_of(Path(d))
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(BisectApp, "run", run_headless)
            rc, _, err = cli(["tui", str(path)])
        assert rc == 0 and not err.strip(), (rc, err)
        assert files_of(Path(d)) == before
    RAN["tui"] += 1


def test_tui_case_count():
    print(f"hostile reports opened in the TUI app: {RAN['tui']}")
    assert RAN["tui"] >= TUI_CASES.max_examples


# -- found by hand ---------------------------------------------------------------------------
ESC = "\x1b[31mEVIL\x1b]0;pwned\x07"


def write(tmp_path: Path, r: dict, name: str = "r.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(r))
    return path


def with_culprit_named(name: str) -> dict:
    r = copy.deepcopy(BASE["run"])
    _rename_unit(r, r["culprits"][0]["unit"], name)
    return r


def test_escape_sequences_in_a_report_are_shown_escaped(tmp_path):
    r = with_culprit_named(ESC)
    r["command"].append("\x1b[2J")
    r["inputs"]["trace"]["path"] = "t.jsonl\nverdict: OK ALIGNED"
    r["post_search_errors"] = [{"step": "whatif\x1b[8m", "unit": ESC, "error": "RuntimeError: \x9b2J boom"}]
    path = write(tmp_path, r)
    for args in (["show", str(path)], ["md", str(path)], ["diff", str(OTHER), str(path)], ["diff", str(path), str(OTHER)]):
        out = shown(["report", *args], codes=(0, 1))
        assert "\\x1b[31mEVIL\\x1b]0;pwned\\x07" in out, args  # the name, escaped
        assert "verdict: OK ALIGNED" not in out.splitlines(), args  # no forged line
    out = shown(["report", "show", str(path)])
    assert "t.jsonl\\nverdict: OK ALIGNED" in out and "\\x9b2J" in out
    md = shown(["report", "md", str(path)], codes=(0,))
    assert "'\\x1b[2J'" in md  # the command line, quoted and escaped


def test_markdown_escapes_a_reports_markup_and_keeps_its_tables(tmp_path):
    r = with_culprit_named("layers.2.moe.a|b`c</details>")
    r["inputs"]["ref"]["arch"] = "<img src=x onerror=alert(1)> **bold** [link](http://x)"
    r["baseline"]["groups"]["a|b"] = r["baseline"]["groups"]["completion"]
    md = shown(["report", "md", str(write(tmp_path, r))], codes=(0,))
    markdown_tables_keep_their_columns(md)
    assert "\\<img src=x onerror=alert(1)\\> \\*\\*bold\\*\\* \\[link\\](http://x)" in md
    assert "| a\\|b |" in md  # the group row: the name's | escaped
    assert "``layers.2.moe.a\\|b`c</details>``" in md  # in a table: a code span, | escaped
    assert md.count("</details>") == 1 + md.count("`c</details>``")


def test_schema_refuses_swap_lines_and_trial_groups_of_the_wrong_type(tmp_path):
    """Found by hand: `swap.lines` a number (report show: TypeError) and a trial's
    `metrics.groups` a string (the TUI crashed): fields the tool always writes with one type."""
    r = copy.deepcopy(BASE["run"])
    r["swap"] = {"lines": 5}
    line = one_error_line(*cli(["report", "show", str(write(tmp_path, r))]))
    assert "swap/lines: 5 is not of type 'array'" in line
    r = copy.deepcopy(BASE["run"])
    r["trials"][0]["metrics"]["groups"] = "abc"
    line = one_error_line(*cli(["tui", str(write(tmp_path, r))]))
    assert "trials/0/metrics/groups: 'abc' is not of type 'object'" in line


@pytest.mark.parametrize("depth, words", [(100_000, "JSON nested too deeply"), (70, "nested deeper than 64 levels")])
def test_deeply_nested_json_is_one_line_exit_2(tmp_path, depth, words):
    path = tmp_path / "deep.json"
    path.write_text('{"schema_version": 1, "x": ' + "[" * depth + "]" * depth + "}")
    for args in (["report", "show", str(path)], ["report", "validate", str(path)], ["tui", str(path)]):
        assert words in one_error_line(*cli(args))


def test_schema_validation_that_recurses_is_caught(tmp_path, monkeypatch):
    """Under the depth limit jsonschema cannot recurse too deep; with the limit lifted its
    RecursionError (repr of a deep value in a message) is still one line."""
    import numbisect.report.document as R

    monkeypatch.setattr(R, "MAX_DEPTH", 10**6)
    r = copy.deepcopy(BASE["compare_hf"])
    r["units"] = ["__DEEP__990"]
    path = tmp_path / "r.json"
    path.write_text(report_text(r))
    assert "JSON nested too deeply" in one_error_line(*cli(["report", "validate", str(path)]))


@pytest.mark.parametrize("what", ["/dev/zero", "fifo", "directory"])
def test_a_device_fifo_or_directory_given_as_a_report_is_refused_without_reading(tmp_path, what):
    path = {"/dev/zero": Path("/dev/zero"), "fifo": tmp_path / "fifo", "directory": tmp_path}[what]
    if what == "fifo":
        os.mkfifo(path)  # opening it would block: it must not be opened
    kind = {"/dev/zero": "a character device", "fifo": "a FIFO", "directory": "a directory"}[what]
    for args in (["report", "show", str(path)], ["report", "md", str(path)], ["tui", str(path)]):
        assert f"report {path} is {kind}, not a regular file" in one_error_line(*cli(args))


def test_a_report_path_with_control_characters_is_named_escaped(tmp_path):
    path = tmp_path / "r\x1b[31m\n.json"
    line = one_error_line(*cli(["report", "show", str(path)]))
    assert line == f"bisect: error: report not found: {tmp_path}/r\\x1b[31m\\n.json"


def test_rich_markup_in_unit_names_is_shown_as_text(tmp_path):
    """Found by hand: `[/]` in a unit name crashed the TUI (MarkupError, a Rich traceback
    and exit 0). The name is drawn as it is, in the answer bar, the tree and the trials."""
    from textual.widgets import DataTable

    from numbisect.report.document import load_report
    from numbisect.tui.app import BisectApp
    from numbisect.tui.widgets.culprit import CulpritPanel
    from numbisect.tui.widgets.unit_tree import UnitTree

    name = "layers.2.moe.[/][bold]x"
    path = write(tmp_path, with_culprit_named(name))
    seen = {}

    async def look(pilot) -> None:
        await pilot.pause()
        app = pilot.app
        seen["panel"] = str(app.main.query_one(CulpritPanel).render())
        seen["tree"] = app.main.query_one(UnitTree).node_for(name).label.plain
        await pilot.press("4")
        table = app.main.query_one("#trials-table", DataTable)
        seen["cells"] = [str(table.get_row_at(i)[5]) for i in range(table.row_count)]
        await pilot.press("q")

    app = BisectApp(report=load_report(path), report_path=str(path))
    from textual.app import App

    App.run(app, headless=True, size=(100, 32), auto_pilot=look)
    assert app.failure is None, app.failure
    assert f"{name}: swapping it alone takes mean k3" in seen["panel"]
    assert "[/][bold]x" in seen["tree"] and "CULPRIT" in seen["tree"]
    assert "moe.[/][bold]x[2]" in seen["cells"]


def test_the_tui_shows_escapes_but_exports_the_report_as_read(tmp_path):
    from numbisect.report.document import load_report
    from numbisect.tui.app import BisectApp

    r = with_culprit_named(ESC)
    path = write(tmp_path, r)
    app = BisectApp(report=load_report(path), report_path=str(path))
    assert app.report["culprits"][0]["unit"] == "\\x1b[31mEVIL\\x1b]0;pwned\\x07"
    out = tmp_path / "exported.json"

    async def export(pilot) -> None:
        await pilot.pause()
        pilot.app._export_to(str(out))
        await pilot.press("q")

    from textual.app import App

    App.run(app, headless=True, size=(100, 32), auto_pilot=export)
    assert app.failure is None, app.failure
    assert json.loads(out.read_text()) == json.loads(path.read_text())


def test_an_error_inside_the_app_is_one_line_exit_2(tmp_path, monkeypatch):
    """A failure the drawing check cannot foresee (here a widget made to fail) ends the app
    and is reported in one line, not Textual's traceback."""
    from numbisect.tui.app import BisectApp
    from numbisect.tui.widgets.unit_tree import UnitTree

    def broken(self, *a, **k):
        raise RuntimeError("widget \x1b[31mfailed")

    monkeypatch.setattr(UnitTree, "populate", broken)
    monkeypatch.setattr(BisectApp, "run", run_headless)
    line = one_error_line(*cli(["tui", str(BASES["run"])]))
    assert line == (f"bisect: error: {BASES['run']}: the TUI cannot show this report "
                    "(RuntimeError: widget \\x1b[31mfailed)")


def test_a_report_the_tui_cannot_draw_is_refused_before_the_app_starts(monkeypatch):
    from numbisect.tui import model as M
    from numbisect.tui.app import BisectApp

    started = []
    monkeypatch.setattr(BisectApp, "run", lambda self, **k: started.append(self))
    monkeypatch.setattr(M, "candidate_universe", lambda r: 1 / 0)
    line = one_error_line(*cli(["tui", str(BASES["run"])]))
    assert line == f"bisect: error: {BASES['run']}: the TUI cannot show this report (ZeroDivisionError: division by zero)"
    assert started == []


def test_unit_parents_that_form_a_cycle_do_not_hang_the_tree():
    from numbisect.tui import model as M

    r = copy.deepcopy(BASE["compare_hf"])
    units = {u["name"]: u for u in r["units"]}
    units["layers.0.attn"]["parent"] = "layers.0.mlp"
    units["layers.0.mlp"]["parent"] = "layers.0.attn"
    units["layers.1.attn"]["parent"] = "layers.1.attn"
    assert M.ancestors(r, "layers.0.attn") == ["layers.0.mlp"]
    assert M.ancestors(r, "layers.1.attn") == []
    names = [row.name for row in M.unit_rows(r)]
    assert len(names) == len(set(names))
    assert "layers.0.attn" not in names and "layers.1.attn" not in names  # not under the model
    assert "layers.0.input_norm" in names


def test_a_trace_the_tui_cannot_read_groups_from_is_a_note(tmp_path):
    """The TUI reads trace groups from the trace the report names (same sha256); a trace it
    cannot read them from (not UTF-8 JSONL, here) is a note, not a crash."""
    import hashlib

    from numbisect.tui import model as M

    trace = tmp_path / "t.parquet"
    trace.write_bytes(b"PAR1\xff\xfe\x00binary")
    r = copy.deepcopy(BASE["compare_hf"])
    r["inputs"]["trace"].update(path=str(trace), sha256=hashlib.sha256(trace.read_bytes()).hexdigest())
    td = M.token_data(r, None)
    assert td.trace_groups == {} and "not a JSONL trace with readable groups" in td.note


def _state(edit) -> dict:
    """The report with every section, its `recurrent_state` changed by `edit(rs)`."""
    r = copy.deepcopy(BASE["every_section"])
    edit(r["recurrent_state"])
    return r


def _set_state_numbers(value):
    def edit(rs):
        row = rs["layers"][0]
        for key in ("propagated", "local", "decode"):
            row[key]["final"]["rel_l2"] = value
            row[key]["boundaries"][0]["rel_l2"] = value
    return edit


def _two_layers(rs):
    second = copy.deepcopy(rs["layers"][0])
    second.update(unit="layers.1.attn", layer=1, propagated=None, local=None, decode=None)
    rs["layers"].append(second)
    rs["first_above_tol"] = "layers.1.attn"


STATE_CASES = {  # name: (edit, what the Markdown row or lines show)
    "nan-string": (_set_state_numbers("nan"), "| `layers.0.attn` | nan | nan | nan at 64 tokens | nan | nan at 64 tokens |"),
    "nan-literal": (_set_state_numbers(float("nan")), "| `layers.0.attn` | nan | nan | nan at 64 tokens | nan | nan at 64 tokens |"),
    "huge-int": (_set_state_numbers(10**400), "| `layers.0.attn` | inf | inf | inf at 64 tokens | inf | inf at 64 tokens |"),
    "negative": (_set_state_numbers(-1e308), "| `layers.0.attn` | -1.00e+308 | -1.00e+308 | -1.00e+308 at 64 tokens |"),
    "passes-null": (_two_layers, "| `layers.1.attn` | - | - | - | - | - |"),
    "no-points": (lambda rs: [rs["layers"][0][k].update(boundaries=[]) for k in ("propagated", "local", "decode")],
                  "| `layers.0.attn` | 1.70e-03 | 1.70e-03 | - | 1.70e-03 | - |"),
    "no-layers": (lambda rs: rs.update(layers=[], missing=["layers.0.attn", "a|b"]),
                  "No state in the dump (not measured): `layers.0.attn`, `a|b`."),
    "many-unread": (lambda rs: rs.update(decode_unread=[f"layers.0.attn@{i} (sample 0)" for i in range(20)]), "and 14 more."),
    "hostile-names": (lambda rs: rs.update(first_above_tol=ESC + "|`x`", first_above_tol_decode="[/]|",
                                           decode_unread=["</details>|`"]),
                      "First layer whose state is above rel-L2 0.01: `` \\x1b[31mEVIL\\x1b]0;pwned\\x07|`x` ``; after decode "
                      "steps: `[/]|`."),
    "unknown-fields": (lambda rs: rs.update(extra={"x": [1]}) or rs["layers"][0].update(more="y"), "| `layers.0.attn` | 1.70e-03 |"),
}


@pytest.mark.parametrize("case", list(STATE_CASES))
def test_strange_recurrent_state_values_are_shown_by_report_show_md_and_the_tui(case, tmp_path):
    """recurrent_state (linear attention) with NaN, non-finite and huge numbers, passes
    not measured, no points, no layers, many unread points, hostile names: `report show`,
    `report md` (its tables keep their columns) and the TUI's drawing show it."""
    from numbisect.report.document import load_report
    from numbisect.tui.app import preflight
    from numbisect.tui.widgets.unit_detail import detail_text

    edit, want = STATE_CASES[case]
    path = write(tmp_path, _state(edit))
    assert cli(["report", "validate", str(path)])[0] == 0  # a report the tool may be handed, not one it refuses
    assert "Recurrent state (linear attention)" in shown(["report", "show", str(path)])
    md = shown(["report", "md", str(path)], codes=(0,))
    markdown_tables_keep_their_columns(md)
    assert want in md, md[md.index("**Recurrent state"):]
    r = load_report(path)
    preflight(r, str(path))
    for row in r["recurrent_state"]["layers"]:
        assert "recurrent state (rel-L2" in detail_text(r, row["unit"], "propagated", [], []).plain


@pytest.mark.parametrize("field, value", [("layers", "x"), ("first_above_tol", 5), ("decode_unread", "abc"),
                                          ("layers/0/propagated/final/rel_l2", [1]), ("layers/0/decode/boundaries/0/tokens", "64")])
def test_recurrent_state_of_the_wrong_type_is_refused_in_one_line(field, value, tmp_path):
    r = copy.deepcopy(BASE["every_section"])
    *parents, last = ["recurrent_state", *field.split("/")]
    _at(r, [int(k) if k.isdigit() else k for k in parents])[last] = value
    assert check_report(write(tmp_path, r)) is False


# -- every field, one at a time ----------------------------------------------------------------
def _small(r: dict) -> dict:
    """A smaller copy (two samples of four tokens, nine units, the culprit among them):
    the same fields, checked faster."""
    r = copy.deepcopy(r)
    r["baseline"]["per_sample"] = [dict(p, k3=p["k3"][:4]) for p in r["baseline"]["per_sample"][:2]]
    keep = {c["unit"] for c in r.get("culprits") or []}
    r["units"] = [u for i, u in enumerate(r["units"]) if i < 8 or u["name"] in keep]
    return r


SMALL_RUN = _small(BASE["run"])


def _leaves(o, pre=()):
    """Paths to the leaves (first item of each list)."""
    if isinstance(o, dict):
        for k, v in o.items():
            yield from _leaves(v, pre + (k,))
    elif isinstance(o, list):
        if o:
            yield from _leaves(o[0], pre + (0,))
    else:
        yield pre


def _show_in_process(r: dict) -> None:
    """What `report show|md|diff` and the TUI draw, in-process (the CLI runs are above)."""
    from numbisect.report.summary import render
    from numbisect.report.tools import diff, markdown, render_diff
    from numbisect.tui.app import preflight

    other = SMALL_RUN
    md = markdown(r)
    markdown_tables_keep_their_columns(md)
    for out in (render(r), md, render_diff(diff(other, r)), render_diff(diff(r, other))):
        assert not RAW_CONTROL.search(out), RAW_CONTROL.search(out)
        out.encode("utf-8")
    preflight(r, None)


@pytest.mark.parametrize("value", ["nan", 10**400, None, "\x1b[31m[/]|`x`"], ids=["'nan'", "huge-int", "null", "hostile-string"])
def test_every_leaf_of_every_section_with_an_odd_value(value):
    """Each leaf of a report with every section, replaced in turn by `value`: where the
    schema accepts the result, every reader shows it. (Found here: decode-mode lines
    multiplied a "nan" string.)"""
    import jsonschema

    from numbisect.report.document import schema

    validator = jsonschema.Draft202012Validator(schema())
    base = _small(BASE["every_section"])
    shown_count = 0
    for path in _leaves(base):
        r = copy.deepcopy(base)
        _at(r, path[:-1])[path[-1]] = value
        if not validator.is_valid(r):
            continue
        try:
            _show_in_process(r)
        except Exception as e:
            raise AssertionError(f"{'/'.join(map(str, path))} = {value!r}: {type(e).__name__}: {e}") from e
        shown_count += 1
    print(f"{value!r}: {shown_count} leaves shown")
    assert shown_count >= 10


ANY_TEXT = st.text(alphabet=st.characters(codec=None, min_codepoint=0, max_codepoint=0x10FFFF), max_size=8)


@settings(max_examples=300, deadline=None, database=None)
@given(obj=st.recursive(st.one_of(st.none(), st.integers(), st.floats(), ANY_TEXT),
                        lambda kids: st.one_of(st.lists(kids, max_size=3), st.dictionaries(ANY_TEXT, kids, max_size=3)), max_leaves=10))
def test_printable_tree_fast_path_misses_nothing(obj):
    """printable_tree returns the object itself only when no string in it needs escaping
    (compared by repr: a NaN leaf is not equal to itself)."""
    from numbisect.common.textsafe import _printable_walk, printable_tree

    assert repr(printable_tree(obj)) == repr(_printable_walk(obj))

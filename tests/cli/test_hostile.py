"""Hostile and broken inputs, through the command line: never a traceback or a half-written file.

Every broken input must end with exit 2 (input) or 3 (load), exactly one line on stderr
starting with "bisect: error:", and no report (nor a temporary file) left where --out
pointed. `numbisect.cli.main` runs in-process: these inputs fail before a model runs
(a trace is read before any checkpoint; a config before its weights), so hundreds of
generated cases take a few seconds. The hypothesis tests print how many cases they ran
(`pytest -s` shows it) and assert a floor on that number.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from numbisect.cli import main

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "fixtures" / "models" / "qwen3_moe"
TRACE = ROOT / "fixtures" / "traces" / "qwen3_moe.jsonl"
REPORT = ROOT / "fixtures" / "reports" / "qwen3_moe_planted_fault.json"
VOCAB = 256
GOOD = json.loads(TRACE.read_text().splitlines()[0])
CASES = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test here (and every module fixture) runs with one torch thread."""



def cli(args: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(args)
    return rc, out.getvalue(), err.getvalue()


def assert_refused(rc: int, err: str, out_path: Path, codes=(2, 3)) -> str:
    """Exit 2 or 3, one 'bisect: error:' line, no traceback, nothing left at --out."""
    assert rc in codes, (rc, err)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("bisect: error: "), err
    assert "Traceback" not in err
    assert not out_path.exists()
    assert not [p.name for p in out_path.parent.glob(f".{out_path.name}.*")], "temporary report left behind"
    return lines[0]


def compare_args(ref: Path, trace: Path, out: Path, engine: str = "rollout") -> list[str]:
    return ["compare", "--ref", f"hf:{ref}", "--engine", engine, "--trace", str(trace), "--ref-dtype", "float32",
            "--engine-dtype", "float32", "--out", str(out), "-q"]


# -- traces -------------------------------------------------------------------------------------
NOT_IDS = st.one_of(
    st.none(), st.booleans(), st.text(max_size=5), st.floats(allow_nan=True), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.just([]),  # empty
    st.lists(st.one_of(st.text(max_size=3), st.floats(allow_nan=True), st.booleans(), st.none(), st.lists(st.integers(), max_size=2)), min_size=1, max_size=4),
    st.lists(st.integers(max_value=-1), min_size=1, max_size=3),  # negative ids
    st.lists(st.integers(min_value=VOCAB, max_value=10**40), min_size=1, max_size=3),  # huge ids
    st.just(["HUGE"]),  # becomes an integer of 5000 digits: more than Python parses by default
)
BAD_LOGPROB = st.one_of(st.just(math.nan), st.just(math.inf), st.just(-math.inf), st.floats(min_value=1e-3, max_value=1e300),
                        st.text(max_size=3), st.booleans(), st.none(), st.lists(st.floats(), max_size=2))
BAD_GROUPS = st.one_of(st.integers(), st.text(max_size=3), st.lists(st.integers(), max_size=2),
                       st.dictionaries(st.sampled_from(["completion", "prompt", "all", ""]), st.just([0]), min_size=1, max_size=1),
                       st.dictionaries(st.just("image"), st.lists(st.integers(min_value=2), min_size=1, max_size=3), min_size=1, max_size=1))


@st.composite
def bad_line(draw) -> str:
    """One trace line that must be refused, as text."""
    kind = draw(st.sampled_from(["ids", "drop", "logprob", "logprob_len", "groups", "not_object", "broken_json", "bom_inside"]))
    obj = copy.deepcopy(GOOD)
    if kind == "ids":
        obj[draw(st.sampled_from(["prompt_ids", "completion_ids"]))] = draw(NOT_IDS)
    elif kind == "drop":
        del obj[draw(st.sampled_from(["prompt_ids", "completion_ids"]))]
    elif kind == "logprob":
        lps = list(obj["rollout_logprobs"])
        lps[draw(st.integers(0, len(lps) - 1))] = draw(BAD_LOGPROB)
        obj["rollout_logprobs"] = lps
    elif kind == "logprob_len":
        n = len(obj["completion_ids"])
        obj["rollout_logprobs"] = [-0.5] * draw(st.integers(0, 2 * n).filter(lambda k: k != n))
    elif kind == "groups":
        obj["groups"] = draw(BAD_GROUPS)
    elif kind == "not_object":
        return json.dumps(draw(st.one_of(st.lists(st.integers(), max_size=3), st.integers(), st.text(max_size=5), st.none())))
    elif kind == "broken_json":
        text = json.dumps(obj)
        return text[: draw(st.integers(1, len(text) - 1))]
    else:
        return "\ufeff" + json.dumps(obj)
    # NaN / Infinity come out as the non-standard literals json.loads accepts
    return json.dumps(obj).replace('"HUGE"', "1" + "0" * 5000)


RAN = {"trace": 0, "report": 0}


@CASES
@given(line=bad_line(), before=st.integers(0, 3), bom=st.booleans(), crlf=st.booleans())
def test_hostile_trace_lines_are_refused_with_one_line(line, before, bom, crlf):
    """A bad line among good ones (with or without BOM and CRLF) names the file and line."""
    if line.startswith("\ufeff") and not bom:
        before = max(before, 1)  # a BOM at the very start of the file is allowed
    lines = [json.dumps(GOOD)] * before + [line] + [json.dumps(GOOD)]
    sep = "\r\n" if crlf else "\n"
    data = (b"\xef\xbb\xbf" if bom else b"") + sep.join(lines).encode("utf-8") + sep.encode()
    with tempfile.TemporaryDirectory() as d:
        trace, out = Path(d) / "t.jsonl", Path(d) / "r.json"
        trace.write_bytes(data)
        rc, _, err = cli(compare_args(MODEL, trace, out))
        msg = assert_refused(rc, err, out, codes=(2,))
        assert f"{trace}:{before + 1}" in msg, msg
    RAN["trace"] += 1


def test_hostile_trace_case_count():
    """Runs after the generated cases above (file order): they really ran."""
    print(f"hostile trace cases run: {RAN['trace']}")
    assert RAN["trace"] >= 100


@pytest.mark.parametrize(
    "data, problem",
    [
        (b"", "no samples"),
        (b"\xef\xbb\xbf\r\n\r\n", "no samples"),
        (json.dumps(GOOD).encode("utf-16"), "not valid UTF-8"),
        (b"\x00\x01\x02" * 10, "invalid JSON"),
        (b"[" * 100000, "nested too deeply"),
    ],
)
def test_trace_files_that_are_not_traces(tmp_path, data, problem):
    trace, out = tmp_path / "t.jsonl", tmp_path / "r.json"
    trace.write_bytes(data)
    rc, _, err = cli(compare_args(MODEL, trace, out))
    assert problem in assert_refused(rc, err, out, codes=(2,))


def test_trace_that_is_a_directory_or_missing(tmp_path):
    out = tmp_path / "r.json"
    for trace in (tmp_path, tmp_path / "nope.jsonl"):
        rc, _, err = cli(compare_args(MODEL, trace, out))
        assert_refused(rc, err, out, codes=(2,))


def test_bom_and_crlf_trace_is_read_like_the_original(tmp_path):
    """Not hostile after all: a Windows-saved trace gives the same report as the original."""
    from numbisect.model.trace import load_trace

    lines = TRACE.read_text().splitlines()[:3]
    plain, win = tmp_path / "plain.jsonl", tmp_path / "win.jsonl"
    plain.write_text("\n".join(lines) + "\n")
    win.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(lines).encode() + b"\r\n")
    a, b = load_trace(plain), load_trace(win)
    assert [(s.ids, s.rollout_logprobs, s.groups) for s in a.samples] == [(s.ids, s.rollout_logprobs, s.groups) for s in b.samples]
    out = tmp_path / "r.json"
    rc, _, err = cli(compare_args(MODEL, win, out))
    assert rc in (0, 1), err
    assert json.loads(out.read_text())["inputs"]["trace"]["samples"] == 3


# -- checkpoints --------------------------------------------------------------------------------
def _copy(tmp_path: Path, name: str) -> Path:
    d = tmp_path / name
    shutil.copytree(MODEL, d)
    return d


def _weights(d: Path) -> Path:
    return d / "model.safetensors"


def _config(d: Path, change) -> None:
    cfg = json.loads((d / "config.json").read_text())
    change(cfg)
    (d / "config.json").write_text(json.dumps(cfg))


BROKEN_CHECKPOINTS = {
    "truncated safetensors": lambda d: _weights(d).write_bytes(_weights(d).read_bytes()[: _weights(d).stat().st_size // 2]),
    "safetensors cut inside the header": lambda d: _weights(d).write_bytes(_weights(d).read_bytes()[:100]),
    "empty safetensors": lambda d: _weights(d).write_bytes(b""),
    "header length too large": lambda d: _weights(d).write_bytes((2**62).to_bytes(8, "little") + _weights(d).read_bytes()[8:]),
    "header not JSON": lambda d: _weights(d).write_bytes(_weights(d).read_bytes()[:8] + b"x" * 32 + _weights(d).read_bytes()[40:]),
    "random bytes": lambda d: _weights(d).write_bytes(os.urandom(4096)),
    "only a pickle": lambda d: (_weights(d).unlink(), (d / "pytorch_model.bin").write_bytes(b"\x80\x04\x95pickle")),
    "no config.json": lambda d: (d / "config.json").unlink(),
    "config.json not JSON": lambda d: (d / "config.json").write_text("{"),
    "config.json a list": lambda d: (d / "config.json").write_text("[]"),
    "no architectures": lambda d: _config(d, lambda c: c.pop("architectures")),
    "architectures an object": lambda d: _config(d, lambda c: c.update(architectures={"NotAModel": 1})),
    "unknown architecture": lambda d: _config(d, lambda c: c.update(architectures=["GPT2LMHeadModel"])),
    "no model_type": lambda d: _config(d, lambda c: c.pop("model_type")),
    "num_hidden_layers a string": lambda d: _config(d, lambda c: c.update(num_hidden_layers="four")),
    "no vocab_size": lambda d: _config(d, lambda c: c.pop("vocab_size")),
    "no hidden_size": lambda d: _config(d, lambda c: c.pop("hidden_size")),
    "not a directory": None,
}


@pytest.mark.parametrize("case", list(BROKEN_CHECKPOINTS))
def test_broken_reference_checkpoint(tmp_path, case):
    if BROKEN_CHECKPOINTS[case] is None:
        ref = tmp_path / "file"
        ref.write_text("x")
    else:
        ref = _copy(tmp_path, "ckpt")
        BROKEN_CHECKPOINTS[case](ref)
    out = tmp_path / "r.json"
    rc, _, err = cli(compare_args(ref, TRACE, out))
    msg = assert_refused(rc, err, out)
    assert str(ref) in msg or "architecture" in msg, msg
    if case == "only a pickle":
        assert rc == 2 and "pytorch_model.bin: pickled weights are never loaded" in msg


def test_broken_engine_checkpoint_after_a_good_reference(tmp_path):
    eng = _copy(tmp_path, "eng")
    _weights(eng).write_bytes(_weights(eng).read_bytes()[:-1000])
    out = tmp_path / "r.json"
    rc, _, err = cli(compare_args(MODEL, TRACE, out, engine=f"hf:{eng}"))
    assert str(eng) in assert_refused(rc, err, out)


def _tiny_trace(tmp_path: Path) -> Path:
    p = tmp_path / "tiny.jsonl"
    p.write_text(json.dumps({"prompt_ids": [1, 2, 3], "completion_ids": [4, 5], "rollout_logprobs": [-1.0, -1.0]}) + "\n")
    return p


MISMATCHED_CONFIGS = {
    # transformers' default (24 layers) builds 20 layers of random weights, silently
    "no num_hidden_layers": lambda c: c.pop("num_hidden_layers"),
    # half the checkpoint's weights are dropped, silently
    "fewer layers": lambda c: c.update(num_hidden_layers=2),
    # refused today, but as "You set `ignore_mismatched_sizes` to `False` ... look at the above report!" (not shown)
    "no vocab_size": lambda c: c.pop("vocab_size"),
}


@pytest.mark.parametrize("case", list(MISMATCHED_CONFIGS))
def test_config_that_does_not_match_the_weights_is_refused(tmp_path, case):
    ref = _copy(tmp_path, "ckpt")
    _config(ref, MISMATCHED_CONFIGS[case])
    out = tmp_path / "r.json"
    rc, _, err = cli(compare_args(ref, _tiny_trace(tmp_path), out))
    msg = assert_refused(rc, err, out)
    assert ("model." in msg or "lm_head" in msg) and "above report" not in msg, msg  # names a weight


CRASHING_CONFIGS = {
    "architectures a number": lambda c: c.update(architectures=42),  # TypeError: 'int' object is not iterable
    "architectures [1]": lambda c: c.update(architectures=[1]),  # TypeError in ", ".join(archs)
    "num_experts_per_tok 99": lambda c: c.update(num_experts_per_tok=99),  # RuntimeError in the hf forward (topk)
}


@pytest.mark.parametrize("case", list(CRASHING_CONFIGS))
def test_config_values_that_crash_today(tmp_path, case):
    ref = _copy(tmp_path, "ckpt")
    _config(ref, CRASHING_CONFIGS[case])
    out = tmp_path / "r.json"
    rc, _, err = cli(compare_args(ref, _tiny_trace(tmp_path), out))
    assert_refused(rc, err, out)


def test_architectures_as_a_string_is_named_whole(tmp_path):
    ref = _copy(tmp_path, "ckpt")
    _config(ref, lambda c: c.update(architectures="GPT2LMHeadModel"))
    out = tmp_path / "r.json"
    rc, _, err = cli(compare_args(ref, TRACE, out))
    assert "GPT2LMHeadModel" in assert_refused(rc, err, out)


def test_config_field_of_the_wrong_type_says_what_is_wrong(tmp_path):
    ref = _copy(tmp_path, "ckpt")
    _config(ref, lambda c: c.update(num_hidden_layers="four"))
    out = tmp_path / "r.json"
    rc, _, err = cli(compare_args(ref, TRACE, out))
    assert "expected int" in assert_refused(rc, err, out)


def test_engine_that_emits_nan_is_not_aligned(tmp_path):
    from safetensors.torch import load_file, save_file

    lines = TRACE.read_text().splitlines()[:2]
    samples = [json.loads(x) for x in lines]
    # a token that is an input (not the last id) only once, late in sample 1's completion
    ids0 = samples[0]["prompt_ids"] + samples[0]["completion_ids"]
    ids1 = samples[1]["prompt_ids"] + samples[1]["completion_ids"]
    tok = next(t for t in reversed(ids1[:-1]) if t not in ids0 and ids1[:-1].count(t) == 1)
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    eng = _copy(tmp_path, "eng")
    w = load_file(_weights(eng))
    w["model.embed_tokens.weight"][tok] = float("nan")
    save_file(w, _weights(eng), metadata={"format": "pt"})
    out = tmp_path / "r.json"
    rc, _, err = cli(compare_args(MODEL, trace, out, engine=f"hf:{eng}") + ["--no-local"])
    verdict = json.loads(out.read_text())["verdict"] if out.exists() else None
    assert rc in (1, 3) and verdict != "aligned", (rc, verdict, err)


# -- reports ------------------------------------------------------------------------------------
JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=5)),
    lambda kids: st.one_of(st.lists(kids, max_size=3), st.dictionaries(st.text(max_size=5), kids, max_size=3)),
    max_leaves=8,
)
BASE = json.loads(REPORT.read_text())


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:2]):
            yield from _paths(v, prefix + (i,))


# Schema-valid reports that `report show` still crashes on (KeyError in render.py): tested
# apart below (xfail until fixed) and kept out of the generated cases.
RENDER_CRASHES = [("baseline", "rl_cost", "thresholds", k) for k in ("tis_cap", "icepop_low", "icepop_high", "geo_low", "geo_high", "seq_k3_max")]
RENDER_CRASHES.append(("search", "baseline"))
PATHS = [p for p in _paths(BASE) if p and p not in RENDER_CRASHES]
REPORT_CASES = settings(CASES, max_examples=100)


@st.composite
def mutated_report(draw):
    """A real report with one value replaced, one key deleted, or not a report at all."""
    kind = draw(st.sampled_from(["replace", "delete", "whole"]))
    if kind == "whole":
        return draw(st.one_of(JSON, st.fixed_dictionaries({"schema_version": st.one_of(JSON, st.integers())})))
    r = copy.deepcopy(BASE)
    path = draw(st.sampled_from(PATHS))
    parent = r
    for k in path[:-1]:
        parent = parent[k]
    if kind == "delete":
        del parent[path[-1]]
    else:
        parent[path[-1]] = draw(JSON)
    return r


def _summarised(args: list[str]) -> None:
    rc, out, err = cli(["report", *args])
    assert rc in (0, 1), (args, rc, err)  # 3 would be "internal error": a crash in disguise
    assert out and not err.strip(), (args, err)


@pytest.mark.slow  # no model, but minutes of generated cases: the full run only
@REPORT_CASES
@given(report=mutated_report())
def test_hostile_reports_show_md_diff_validate(report):
    """Refused with one line (exit 2), or, where the schema accepts it, summarised without a crash."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "r.json"
        path.write_text(json.dumps(report))
        rc, out, err = cli(["report", "show", str(path)])
        if rc == 2:
            lines = err.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("bisect: error: "), err
            assert "Traceback" not in err and not out
            rc_v, _, err_v = cli(["report", "validate", str(path)])
            assert rc_v == 2 and err_v == err  # the same single line from every subcommand
        else:
            assert rc in (0, 1) and out and not err.strip(), (rc, err)
            for args in (["md", str(path)], ["validate", str(path)], ["diff", str(REPORT), str(path)], ["diff", str(path), str(REPORT)]):
                _summarised(args)
    RAN["report"] += 1


@pytest.mark.parametrize("path", RENDER_CRASHES, ids=["/".join(p) for p in RENDER_CRASHES])
def test_schema_valid_report_missing_a_field_render_needs(tmp_path, path):
    r = copy.deepcopy(BASE)
    parent = r
    for k in path[:-1]:
        parent = parent[k]
    del parent[path[-1]]
    f = tmp_path / "r.json"
    f.write_text(json.dumps(r))
    rc, out, err = cli(["report", "show", str(f)])
    assert rc == 2 or (rc == 1 and out and not err), (rc, err)


@pytest.mark.parametrize("value", [None, [1], "x", {"k3_mean": [0.1]}])
def test_trial_group_metrics_of_any_shape_do_not_crash_the_summary(tmp_path, value):
    """Found by the generated cases: the per-group evidence line read a trial's
    metrics.groups entries as dicts of numbers (AttributeError / TypeError, exit 3)."""
    r = copy.deepcopy(BASE)
    unit = r["culprits"][0]["unit"]
    alone = next(t for t in r["trials"] if t["swapped"] == [unit])
    alone["metrics"]["groups"]["completion"] = value
    f = tmp_path / "r.json"
    f.write_text(json.dumps(r))
    for args in (["show", str(f)], ["md", str(f)], ["diff", str(REPORT), str(f)]):
        rc, out, err = cli(["report", *args])
        assert rc in (0, 1) and out and not err.strip(), (args, rc, err)


def test_hostile_report_case_count():
    print(f"hostile report cases run: {RAN['report']}")
    assert RAN["report"] >= 80


@pytest.mark.parametrize(
    "text, problem",
    [
        ("", "not valid JSON"),
        ("[1, 2]", "no schema_version"),
        ('{"schema_version": 2}', "schema version 2 is not supported"),
        ('{"schema_version": "1"}', "schema version '1' is not supported"),
        ('{"schema_version": true}', "schema version True is not supported"),
        ('{"schema_version": 1}', "not a valid v1 report"),
        ("\ufeff" + json.dumps(BASE), None),  # a BOM is fine
    ],
)
def test_report_files_of_the_wrong_shape(tmp_path, text, problem):
    path = tmp_path / "r.json"
    path.write_text(text, encoding="utf-8")
    for sub in ("show", "md", "validate"):
        rc, _, err = cli(["report", sub, str(path)])
        if problem is None:
            assert rc in (0, 1) and not err
        else:
            assert rc == 2 and err.count("\n") == 1 and err.startswith("bisect: error: ") and problem in err, err

"""Every path option against every hostile kind of path: one line, exit 2, nothing touched.

Options: --trace, --floor, --resume (read); --out, --log, --capture-dir (written).
Kinds: a FIFO (reading it would hang), /dev/zero (never ends), a directory, a missing
file, a read-only place (/sys refuses even root), a file where a directory is needed, and
another option's input. Each case must be refused before any model loads, with exactly
one "bisect: error:" line, and leave every file of the case as it was (bytes and mtime).
"""

from __future__ import annotations

import contextlib
import io
import itertools
import os
from pathlib import Path

import pytest
from conftest import model_dir, trace_path

from numbisect.cli import main

MODEL = model_dir("qwen3_moe")


@pytest.fixture(autouse=True)
def no_model_loads(monkeypatch):
    from numbisect.backends import hf

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the path was checked")

    monkeypatch.setattr(hf.HFBackend, "__init__", refuse)


def kinds(d: Path, trace: Path) -> dict[str, str]:
    fifo = d / "fifo"
    os.mkfifo(fifo)
    (d / "subdir").mkdir()
    return {
        "fifo": str(fifo),
        "dev_zero": "/dev/zero",
        "directory": str(d / "subdir"),
        "missing": str(d / "nope" / "x.json"),
        "read_only": "/sys/numbisect-x",
        "the_trace": str(trace),
    }


READ = ("--trace", "--floor", "--resume")
WRITE = ("--out", "--log", "--capture-dir")
# kinds that are fine for an option: a directory to write into, one that can be made,
# a device that takes writes (as /dev/null does), a FIFO some process may read (`--out >(jq .)`)
ALLOWED = {("--capture-dir", "directory"), ("--capture-dir", "missing"), ("--out", "dev_zero"), ("--out", "fifo")}


def args_for(opt: str, path: str, trace: str) -> list[str]:
    base = ["--ref", f"hf:{MODEL}", "--engine", f"hf:{MODEL}", "-q"]
    t = path if opt == "--trace" else trace
    if opt == "--floor":
        return ["compare", *base, "--trace", t, "--threshold", "floor", "--floor", path]
    if opt in ("--resume", "--log"):
        return ["run", *base, "--trace", t, opt, path]
    if opt == "--capture-dir":
        return ["compare", *base, "--trace", t, "--capture", "full", "--capture-dir", path]
    return ["compare", *base, "--trace", t, *(["--out", path] if opt == "--out" else [])]


def snapshot(d: Path) -> dict:
    return {p: (p.read_bytes() if p.is_file() else None, p.stat().st_mtime_ns) for p in d.rglob("*") if not p.is_fifo()}


CASES = [(o, k) for o, k in itertools.product(READ + WRITE, ["fifo", "dev_zero", "directory", "missing", "read_only", "the_trace"])
         if (o, k) not in ALLOWED and not (o == "--trace" and k == "the_trace")]


@pytest.mark.parametrize("opt, kind", CASES)
def test_hostile_path(tmp_path, opt, kind):
    trace = tmp_path / "t.jsonl"
    trace.write_bytes(Path(trace_path("qwen3_moe")).read_bytes())
    path = kinds(tmp_path, trace)[kind]
    if kind == "missing" and opt in ("--out", "--log"):
        path = str(tmp_path / "nope" / "x.json")  # its directory is missing
    before = snapshot(tmp_path)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(args_for(opt, path, str(trace)))
    lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
    assert rc == 2, err.getvalue()
    assert len(lines) == 1 and lines[0].startswith("bisect: error: "), err.getvalue()
    assert out.getvalue() == ""
    assert snapshot(tmp_path) == before, "a file the user did not name as output changed"


@pytest.mark.parametrize("opt, value", [
    ("--max-capture-mb", "nan"), ("--max-capture-mb", "inf"), ("--max-capture-mb", "-1"), ("--threads", "0"),
])
def test_bad_numbers_for_path_options(tmp_path, opt, value):
    args = ["compare", "--ref", f"hf:{MODEL}", "--engine", f"hf:{MODEL}", "--trace", trace_path("qwen3_moe"), "-q",
            "--capture", "full", "--capture-dir", str(tmp_path / "c"), opt, value]
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        rc = main(args)
    lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("bisect: error: "), err.getvalue()
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("value", ["0", "1", "-3"])
def test_calibrate_batch_size_under_two_is_refused_before_the_reference_loads(value):
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        rc = main(["calibrate", "--ref", f"hf:{MODEL}", "--trace", trace_path("qwen3_moe"), "-q", "--batch-size", value])
    lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
    assert rc == 2 and lines == ["bisect: error: --batch-size must be at least 2 (the reference runs one sample at a time)"]


@pytest.mark.parametrize("name", ["a\x1b[31mred\x1b[0m.jsonl", "two\nlines.jsonl", "bell\x07.jsonl", "rtl\u202e.jsonl"])
def test_error_lines_escape_what_a_path_smuggles_in(tmp_path, name):
    """A path is the user's, but it may come from a script or a file: an error line that
    names it must stay one line and never send an escape sequence to the terminal."""
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        rc = main(["compare", "--ref", f"hf:{MODEL}", "--engine", f"hf:{MODEL}", "--trace", str(tmp_path / name), "-q"])
    text = err.getvalue()
    assert rc == 2 and text.count("\n") == 1 and text.startswith("bisect: error: "), text
    assert not any(c in text[:-1] for c in "\x1b\x07\n\u202e"), repr(text)


def _copy_model(d: Path) -> Path:
    m = d / "model"
    m.mkdir()
    for f in Path(MODEL).iterdir():
        if f.is_file():
            (m / f.name).write_bytes(f.read_bytes())
    return m


@pytest.mark.parametrize("opt, target", [("--out", "config.json"), ("--log", "model.safetensors"), ("--out", "model.safetensors")])
def test_an_output_that_is_a_file_of_the_model_is_refused(tmp_path, opt, target):
    """`--out` pointed (by a slip of the shell) at the checkpoint's config.json or weights
    would leave a model that no later run can load; refused before anything is written."""
    m = _copy_model(tmp_path)
    assert (m / target).is_file()
    before = snapshot(tmp_path)
    err = io.StringIO()
    verb = "run" if opt == "--log" else "compare"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        rc = main([verb, "--ref", f"hf:{m}", "--engine", f"hf:{MODEL}", "--trace", trace_path("qwen3_moe"), "-q",
                   opt, str(m / target)])
    lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1, err.getvalue()
    assert lines[0].startswith(f"bisect: error: {opt} ") and "is a file of the --ref model" in lines[0]
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("opt", ["--out", "--log"])
@pytest.mark.parametrize("config_opt", ["--engine-config", "--good-config"])
def test_conditions_outputs_never_overwrite_a_settings_file(tmp_path, opt, config_opt):
    cfg = tmp_path / "mine.json"
    cfg.write_text('{"enforce_eager": true}\n')
    before = snapshot(tmp_path)
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        rc = main(["conditions", "--ref", f"hf:{MODEL}", "--engine", f"vllm:{MODEL}", "--trace", trace_path("qwen3_moe"),
                   "-q", config_opt, str(cfg), opt, str(cfg)])
    lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1, err.getvalue()
    assert f"is the {config_opt} input; it would be overwritten" in lines[0]
    assert snapshot(tmp_path) == before


def test_an_output_that_is_a_file_of_a_dump_is_refused(tmp_path):
    d = tmp_path / "dump"
    d.mkdir()
    (d / "manifest.json").write_text("{}")
    before = snapshot(tmp_path)
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        rc = main(["compare", "--ref", f"hf:{MODEL}", "--engine", f"dump:{d}", "--trace", trace_path("qwen3_moe"), "-q",
                   "--out", str(d / "manifest.json")])
    lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and "is a file of the --engine dump" in lines[0], err.getvalue()
    assert snapshot(tmp_path) == before

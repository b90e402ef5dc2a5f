"""The trial log is never lost, and outputs never clobber what they must not.

A real `bisect run` (hf fp32 engine with a planted fault, `--strategy linear`, two
samples) writes its log; the tests then damage, lock, reuse and resume it as users and
crashes do, and check that every log still holds complete records, that no trial is
repeated and that the values are those of an uninterrupted run. Output paths: devices
and links are not replaced, inputs are not overwritten, and an output that cannot be
written is refused before any model loads.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import stat
from pathlib import Path

import pytest
from conftest import model_dir, short_trace, vllm

from numbisect.cli import main

MODEL = model_dir("qwen3_moe")
FAULT = "moe_combine_bf16@layers.2.moe"


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test here runs with one torch thread (the log records it)."""


@pytest.fixture(scope="module")
def trace():
    return short_trace("qwen3_moe", 2)


def cli(args: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(args)
    return rc, out.getvalue(), err.getvalue()


def run_args(trace: str, *extra: str) -> list[str]:
    return ["run", "--ref", f"hf:{MODEL}", "--engine", f"hf:{MODEL}", "--ref-dtype", "float32", "--engine-dtype", "float32",
            "--trace", trace, "--engine-fault", FAULT, "--threshold", "1e-10", "--strategy", "linear", "--no-whatif", "-q",
            *extra]


def compare_args(trace: str, *extra: str) -> list[str]:
    return ["compare", "--ref", f"hf:{MODEL}", "--engine", f"hf:{MODEL}", "--ref-dtype", "float32",
            "--engine-dtype", "float32", "--trace", trace, "--no-local", "-q", *extra]


def records(path: Path) -> tuple[dict, list[dict]]:
    """Header and trials; fails unless every line is complete JSON ending in a newline."""
    text = path.read_text()
    assert text.endswith("\n"), "the log's last record has no newline"
    lines = [json.loads(x) for x in text.splitlines()]
    assert "numbisect_trial_log" in lines[0]
    assert sum("numbisect_trial_log" in x for x in lines) == 1, "more than one header"
    return lines[0], lines[1:]


def one_error_line(rc: int, err: str, code: int = 2) -> str:
    assert rc == code, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("bisect: error: "), err
    return lines[0]


@pytest.fixture(scope="module")
def uninterrupted(trace, tmp_path_factory):
    """The whole linear search, never interrupted: what every resumed log must equal."""
    d = tmp_path_factory.mktemp("full")
    log = d / "L.jsonl"
    rc, _, err = cli(run_args(trace, "--log", str(log)))
    assert rc == 1, err
    _, trials = records(log)
    assert len(trials) >= 8
    return trials


def partial(trace: str, path: Path, n: int) -> list[dict]:
    rc, _, err = cli(run_args(trace, "--log", str(path), "--max-trials", str(n)))
    assert rc == 4, err
    return records(path)[1]


def same_trials(got: list[dict], want: list[dict]) -> None:
    assert [t["swapped"] for t in got] == [t["swapped"] for t in want]
    assert [t["value"] for t in got] == [t["value"] for t in want]  # bit for bit (JSON floats round-trip)


def test_an_existing_log_is_never_truncated(trace, tmp_path):
    log = tmp_path / "L.jsonl"
    partial(trace, log, 3)
    before = log.read_bytes()
    rc, _, err = cli(run_args(trace, "--log", str(log)))
    line = one_error_line(rc, err)
    assert "already holds trials" in line and f"--resume {log}" in line
    assert log.read_bytes() == before


def test_a_header_alone_may_be_reused(trace, tmp_path, uninterrupted):
    """A run that ended before its first trial leaves only a header: nothing to lose."""
    log = tmp_path / "L.jsonl"
    partial(trace, log, 2)
    log.write_text(log.read_text().splitlines()[0] + "\n")
    rc, _, err = cli(run_args(trace, "--log", str(log)))
    assert rc == 1, err
    same_trials(records(log)[1], uninterrupted)


def test_a_record_cut_mid_write_is_dropped_and_the_log_resumes_twice(trace, tmp_path, uninterrupted):
    """kill -9 mid-write leaves a fragment: the next record must not land on it, and the
    log must still resume after that (before: `corrupt trial record`)."""
    log = tmp_path / "L.jsonl"
    first = partial(trace, log, 3)
    with open(log, "a") as fh:
        fh.write(json.dumps(uninterrupted[3])[:40])  # cut mid-record, no newline
    rc, _, err = cli(run_args(trace, "--resume", str(log), "--max-trials", "5"))
    assert rc == 4, err
    _, trials = records(log)
    assert trials[:3] == first and len(trials) == 5
    rc, _, err = cli(run_args(trace, "--resume", str(log)))
    assert rc == 1, err
    same_trials(records(log)[1], uninterrupted)


def test_a_complete_last_record_without_its_newline_is_kept(trace, tmp_path, uninterrupted):
    log = tmp_path / "L.jsonl"
    partial(trace, log, 3)
    log.write_bytes(log.read_bytes().rstrip(b"\n"))
    rc, out, err = cli(run_args(trace, "--resume", str(log), "--json"))
    assert rc == 1, err
    assert sum(t["resumed"] for t in json.loads(out)["trials"]) == 3
    same_trials(records(log)[1], uninterrupted)


def test_a_log_damaged_by_an_older_numbisect_is_salvaged(trace, tmp_path, uninterrupted):
    """Older versions appended the next record onto a cut one: that record is still read."""
    log = tmp_path / "L.jsonl"
    partial(trace, log, 3)
    lines = log.read_text().splitlines()
    cut = json.dumps(uninterrupted[2])[:30]
    log.write_text("\n".join([*lines[:3], cut + lines[3]]) + "\n")
    rc, out, err = cli(run_args(trace, "--resume", str(log), "--json"))
    assert rc == 1, err
    assert sum(t["resumed"] for t in json.loads(out)["trials"]) == 3  # the damaged line's trial was not rerun


def test_resume_into_another_log_makes_that_log_complete(trace, tmp_path, uninterrupted):
    a, b = tmp_path / "A.jsonl", tmp_path / "B.jsonl"
    partial(trace, a, 3)
    a_bytes = a.read_bytes()
    rc, _, err = cli(run_args(trace, "--resume", str(a), "--log", str(b), "--max-trials", "5"))
    assert rc == 4, err
    assert a.read_bytes() == a_bytes  # the source is left as it was
    assert len(records(b)[1]) == 5
    rc, out, err = cli(run_args(trace, "--resume", str(b), "--json"))  # B alone resumes the run: nothing repeated
    assert rc == 1, err
    assert sum(t["resumed"] for t in json.loads(out)["trials"]) == 5
    same_trials(records(b)[1], uninterrupted)


def test_resume_into_a_log_that_holds_trials_is_refused(trace, tmp_path):
    a, b = tmp_path / "A.jsonl", tmp_path / "B.jsonl"
    partial(trace, a, 2)
    partial(trace, b, 2)
    before = b.read_bytes()
    rc, _, err = cli(run_args(trace, "--resume", str(a), "--log", str(b)))
    assert "already holds trials" in one_error_line(rc, err)
    assert b.read_bytes() == before


def test_a_log_another_run_holds_is_refused(trace, tmp_path):
    log = tmp_path / "L.jsonl"
    partial(trace, log, 2)
    before = log.read_bytes()
    with open(log, "rb") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # what a running `bisect run --log L` holds
        rc, _, err = cli(run_args(trace, "--resume", str(log)))
    assert "in use by another bisect run" in one_error_line(rc, err)
    assert log.read_bytes() == before


def test_a_log_made_under_another_thread_count_is_refused(trace, tmp_path):
    """Trial values depend on the thread count: mixing them would contradict the report."""
    log = tmp_path / "L.jsonl"
    partial(trace, log, 2)
    lines = log.read_text().splitlines()
    header = json.loads(lines[0])
    assert header["conditions"]["threads"] == 1
    header["conditions"]["threads"] = 7
    log.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    before = log.read_bytes()
    rc, _, err = cli(run_args(trace, "--resume", str(log)))
    line = one_error_line(rc, err)
    assert "other conditions" in line and "threads: 7 in the log, 1 now" in line and "--threads 7" in line
    assert log.read_bytes() == before


@pytest.mark.parametrize("where, value, named", [
    (("versions", "torch"), "1.0.0", "versions.torch"),
    (("engine", "opts"), {"attn_implementation": "eager"}, "engine.opts"),
    (("device",), "cuda", "device"),
])
def test_a_log_made_under_other_conditions_names_the_difference(trace, tmp_path, where, value, named):
    log = tmp_path / "L.jsonl"
    partial(trace, log, 2)
    lines = log.read_text().splitlines()
    header = json.loads(lines[0])
    node = header["conditions"]
    for k in where[:-1]:
        node = node[k]
    node[where[-1]] = value
    log.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    rc, _, err = cli(run_args(trace, "--resume", str(log)))
    assert named in one_error_line(rc, err)


def test_a_version_1_log_is_refused(trace, tmp_path):
    log = tmp_path / "L.jsonl"
    partial(trace, log, 2)
    lines = log.read_text().splitlines()
    header = json.loads(lines[0])
    header["numbisect_trial_log"] = 1
    del header["conditions"]
    log.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    rc, _, err = cli(run_args(trace, "--resume", str(log)))
    assert "version 1" in one_error_line(rc, err)


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any model load fails the test: the refusals below come before it."""
    from numbisect.backends import hf

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the output was checked")

    monkeypatch.setattr(hf.HFBackend, "__init__", refuse)


@pytest.mark.parametrize("opt", ["--log", "--out"])
def test_an_output_that_is_the_trace_is_refused(trace, tmp_path, opt, no_model_loads):
    t = tmp_path / "t.jsonl"
    t.write_bytes(Path(trace).read_bytes())
    before = t.read_bytes()
    rc, _, err = cli(run_args(str(t), opt, str(t)))
    assert "--trace input" in one_error_line(rc, err)
    assert t.read_bytes() == before


def test_out_equal_to_the_resume_log_is_refused(trace, tmp_path, no_model_loads):
    log = tmp_path / "L.jsonl"
    log.write_text('{"numbisect_trial_log": 2}\n')
    rc, _, err = cli(run_args(trace, "--resume", str(log), "--out", str(log)))
    assert "--resume input" in one_error_line(rc, err)


@pytest.mark.parametrize("make, says", [
    (lambda d: d, "it is a directory"),
    (lambda d: d / "missing" / "r.json", "does not exist"),
    (lambda d: Path("/sys/numbisect-report.json"), "not writable"),  # read-only even for root
])
def test_an_output_that_cannot_be_written_is_refused_before_any_model_loads(trace, tmp_path, make, says, no_model_loads):
    rc, _, err = cli(compare_args(trace, "--out", str(make(tmp_path))))
    assert says in one_error_line(rc, err)


def test_a_full_disk_is_refused_before_any_model_loads(trace, tmp_path, monkeypatch, no_model_loads):
    real = os.statvfs

    class Full:
        def __init__(self, path):
            r = real(path)
            self.f_frsize, self.f_bavail = r.f_frsize, 0

    monkeypatch.setattr(os, "statvfs", Full)
    rc, _, err = cli(compare_args(trace, "--out", str(tmp_path / "r.json")))
    assert "disk" in one_error_line(rc, err) and "full" in err
    assert not list(tmp_path.iterdir())


def test_a_log_that_is_a_device_is_refused(trace, no_model_loads):
    rc, _, err = cli(run_args(trace, "--log", "/dev/null"))
    assert "regular file" in one_error_line(rc, err)
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_swap_of_no_kind_is_refused(trace, no_model_loads):
    rc, _, err = cli(run_args(trace, "--swap", ""))
    assert "--swap needs at least one unit kind" in one_error_line(rc, err)
    rc, _, err = cli(run_args(trace, "--swap", " , "))
    assert "--swap needs at least one unit kind" in one_error_line(rc, err)


def test_out_dev_null_stays_a_device_and_a_link_stays_a_link(trace, tmp_path):
    rc, _, err = cli(compare_args(trace, "--out", "/dev/null"))
    assert rc in (0, 1), err
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    target = tmp_path / "real.json"
    target.write_text("old\n")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    rc, _, err = cli(compare_args(trace, "--out", str(link)))
    assert rc in (0, 1), err
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert json.loads(target.read_text())["kind"] == "compare"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "real.json"]  # no temporary file left


def test_a_write_that_fails_at_the_end_is_one_line(trace):
    """/dev/full: every write fails with ENOSPC (a disk that filled up during the run)."""
    rc, _, err = cli(compare_args(trace, "--out", "/dev/full"))
    assert "No space left" in one_error_line(rc, err)


@pytest.mark.vllm
def test_threads_stay_pinned_after_a_vllm_engine_started():
    """vLLM's CPU worker makes torch.set_num_threads a no-op in its process; the fp32
    values of every later hf forward then depend on whatever count was left."""
    import torch

    from numbisect.session.environment import set_threads

    vllm("qwen3_moe")
    before = torch.get_num_threads()
    try:
        for n in (1, 2):
            set_threads(n)
            assert torch.get_num_threads() == n
    finally:
        set_threads(before)


def test_out_to_a_fifo_is_written_when_read_and_refused_when_not(trace, tmp_path):
    """`--out >(jq .)` is a pipe some process reads; a FIFO nobody reads must not hang the run."""
    import threading

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got = {}

    def reader():
        with open(fifo) as fh:
            got["text"] = fh.read()

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    rc, _, err = cli(compare_args(trace, "--out", str(fifo)))
    t.join(timeout=60)
    assert rc in (0, 1), err
    assert json.loads(got["text"])["kind"] == "compare"
    rc, _, err = cli(compare_args(trace, "--out", str(fifo)))  # nobody reads it now
    assert "no process is reading" in one_error_line(rc, err)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_a_cut_after_bytes_that_are_not_utf8_is_cut_at_the_right_byte(trace, tmp_path, uninterrupted):
    """The log is cut back by byte offsets: a damaged byte earlier in it must not shift them."""
    log = tmp_path / "L.jsonl"
    partial(trace, log, 3)
    lines = log.read_bytes().split(b"\n")
    lines[2] = lines[2].replace(b'"role": "', b'"role": "\xff', 1)  # a stray byte inside a kept record
    log.write_bytes(b"\n".join(lines) + json.dumps(uninterrupted[3])[:40].encode())
    rc, _, err = cli(run_args(trace, "--resume", str(log), "--max-trials", "5"))
    assert rc == 4, err
    kept = log.read_bytes().split(b"\n")
    assert kept[:4] == lines[:4] and all(json.loads(x) for x in kept[4:] if x)

"""Ctrl-C during `bisect run`: exit 130, no report, a complete trial log; then --resume finishes it.

1. A real `bisect run` process (hf fp32 engine with a planted fault, `--strategy linear`,
   about 30 trials) gets SIGINT once its log holds a few trials.
2. It must exit 130 with "bisect: interrupted" and no traceback, leave no report (nor a
   temporary one), and every line of the log must be complete JSON.
3. `--resume LOG` (in-process) completes the search without repeating a trial, with the
   same culprits and the same trials as an uninterrupted run.
"""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import child_env, sigint_as_from_a_terminal

from numbisect.cli import main

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "fixtures" / "models" / "qwen3_moe"
TRACE = ROOT / "fixtures" / "traces" / "qwen3_moe.jsonl"
FAULT = "moe_combine_bf16@layers.2.moe"
WAIT_FOR_TRIALS = 3


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test here (and every module fixture) runs with one torch thread."""




def run_args(trace: Path, out: Path, *extra: str) -> list[str]:
    return ["run", "--ref", f"hf:{MODEL}", "--engine", f"hf:{MODEL}", "--ref-dtype", "float32", "--engine-dtype", "float32",
            "--trace", str(trace), "--engine-fault", FAULT, "--threshold", "1e-10", "--strategy", "linear",
            "--out", str(out), "-q", *extra]


def log_lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def trials_of(path: Path) -> list[dict]:
    lines = log_lines(path)
    assert "numbisect_trial_log" in json.loads(lines[0])
    return [json.loads(x) for x in lines[1:]]


def interrupt(trace: Path, out: Path, log: Path, sig: int, trials: int) -> dict:
    """A real `bisect run --log` process, sent `sig` once its log holds `trials` trials."""
    p = subprocess.Popen([sys.executable, "-m", "numbisect", *run_args(trace, out, "--log", str(log))],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=child_env(),
                         preexec_fn=sigint_as_from_a_terminal)
    try:
        deadline = time.monotonic() + 240
        while len(log_lines(log)) < 1 + trials and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert p.poll() is None, f"the run ended before it could be interrupted: {p.communicate()[1][-2000:]}"
        seen = len(log_lines(log)) - 1
        p.send_signal(sig)
        stdout, stderr = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return {"rc": p.returncode, "stdout": stdout, "stderr": stderr, "seen": seen}


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    d = tmp_path_factory.mktemp("intr")
    trace = d / "t.jsonl"
    trace.write_text("\n".join(TRACE.read_text().splitlines()[:8]) + "\n")
    log, out = d / "L.jsonl", d / "R.json"
    return {"dir": d, "trace": trace, "log": log, "out": out, **interrupt(trace, out, log, signal.SIGINT, WAIT_FOR_TRIALS)}


def test_sigint_exits_130_without_a_report(interrupted):
    i = interrupted
    assert i["rc"] == 130, i["stderr"][-2000:]
    assert "Traceback" not in i["stderr"]
    assert i["stderr"].strip().splitlines()[-1] == "bisect: interrupted"
    assert not i["out"].exists()
    assert not [p.name for p in i["dir"].iterdir() if p.name.startswith(".R.json")]
    assert i["stdout"] == ""


def test_log_is_complete_up_to_the_last_finished_trial(interrupted):
    text = interrupted["log"].read_text()
    assert text.endswith("\n")
    trials = trials_of(interrupted["log"])
    assert len(trials) >= interrupted["seen"] >= WAIT_FOR_TRIALS
    assert [t["index"] for t in trials] == list(range(len(trials)))
    assert len(trials) < 25  # interrupted well before the ~30 trials of the whole search


def test_resume_completes_like_an_uninterrupted_run(interrupted, capsys):
    i = interrupted
    before = trials_of(i["log"])
    resumed_out = i["dir"] / "R2.json"
    assert main(run_args(i["trace"], resumed_out, "--resume", str(i["log"]))) == 1
    fresh_log, fresh_out = i["dir"] / "L3.jsonl", i["dir"] / "R3.json"
    assert main(run_args(i["trace"], fresh_out, "--log", str(fresh_log))) == 1
    capsys.readouterr()

    resumed, fresh = json.loads(resumed_out.read_text()), json.loads(fresh_out.read_text())
    assert [c["unit"] for c in resumed["culprits"]] == [c["unit"] for c in fresh["culprits"]]
    assert "layers.2" in resumed["culprits"][0]["unit"]
    # No trial repeated: every swapped set appears once in the log, the interrupted ones first.
    after = trials_of(i["log"])
    sets = [tuple(t["swapped"]) for t in after]
    assert len(sets) == len(set(sets))
    assert after[: len(before)] == before
    assert sum(t["resumed"] for t in resumed["trials"]) == len(before)
    # ...and the same trials, with the same values, as the uninterrupted run.
    ref = trials_of(fresh_log)
    assert sets == [tuple(t["swapped"]) for t in ref]
    assert [t["value"] for t in after] == [t["value"] for t in ref]
    assert len(resumed["trials"]) == len(fresh["trials"]) >= 20


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_are_an_interruption_too(sig, tmp_path):
    """A scheduler's SIGTERM or a closed terminal's SIGHUP: exit 130 with one line naming
    the signal, no report, and a log complete up to the last finished trial (before:
    exit 143 / 129 with nothing said)."""
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(TRACE.read_text().splitlines()[:4]) + "\n")
    log, out = tmp_path / "L.jsonl", tmp_path / "R.json"
    r = interrupt(trace, out, log, sig, 1)
    stdout, stderr = r["stdout"], r["stderr"]
    assert r["rc"] == 130, stderr[-2000:]
    assert stderr.strip().splitlines()[-1] == f"bisect: interrupted ({sig.name})"
    assert "Traceback" not in stderr and stdout == ""
    assert not out.exists() and not [q for q in tmp_path.iterdir() if q.name.startswith(".R.json")]
    assert log.read_text().endswith("\n")
    trials = trials_of(log)
    assert [t["index"] for t in trials] == list(range(len(trials))) and trials

"""The fork server under `run_child`: each vLLM child is forked from a process that imported
vLLM once. A user relies on three things: a child's answer is the one a new Python gives (no
engine, compilation config or thread pool outlives its job), a child that runs too long or a
numbisect that is stopped (Ctrl-C, SIGKILL) leaves no process behind, and a broken server
never costs a job (a new Python runs it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import ROOT, model_dir, pythonpath, sigint_as_from_a_terminal

from numbisect.backends.vllm import forkserver
from numbisect.backends.vllm.child import run_child
from numbisect.common.errors import BackendError

FAM = "deepseek_v3"  # its rotary custom op is the vLLM-CPU bug: on and off give other log-probs
SAMPLES = [[3, 17, 5, 99, 42, 7, 11, 64, 23, 8, 150, 31], [9, 4, 77, 120, 6, 2, 88, 15, 33, 71]]


def _job(custom_ops: list[str]) -> dict:
    return {"job": "logprobs", "model": model_dir(FAM), "dtype": "bfloat16", "max_model_len": 64,
            "settings": {"enforce_eager": True, "enable_prefix_caching": False,
                         "compilation_config": {"custom_ops": custom_ops}},
            "samples": SAMPLES, "prompt_lens": [4, 4]}


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait(cond, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


@pytest.mark.vllm
def test_a_forked_child_answers_what_a_new_python_answers_and_leaves_nothing_to_the_next(monkeypatch):
    """The rotary op off, then on, in two children of one server, then on in a new Python:
    the second child's log-probs and enabled ops are the new Python's bit for bit, and not
    the first's (its engine, compilation config and parallel groups died with its process)."""
    monkeypatch.setenv("NUMBISECT_FORKSERVER", "1")
    off = run_child(_job(["none"]), "rope off")  # in this worker's server, started here if none runs
    server = forkserver._server
    on = run_child(_job(["none", "+rotary_embedding"]), "rope on")
    assert server is not None and forkserver._server is server and server.alive()  # one server, two jobs
    monkeypatch.setenv("NUMBISECT_FORKSERVER", "0")
    fresh = run_child(_job(["none", "+rotary_embedding"]), "rope on, a new Python")
    assert on["logprobs"] == fresh["logprobs"] and on["custom_ops"] == fresh["custom_ops"]
    assert "rotary_embedding" in on["custom_ops"]["enabled"] and "rotary_embedding" not in off["custom_ops"]["enabled"]
    assert on["logprobs"] != off["logprobs"]


@pytest.mark.vllm
def test_a_child_past_its_timeout_is_killed_and_the_server_runs_the_next(monkeypatch, tmp_path):
    import tempfile

    monkeypatch.setenv("NUMBISECT_FORKSERVER", "1")
    monkeypatch.delenv("NUMBISECT_DEBUG", raising=False)
    refused = {"job": "no-such-job"}  # the child fails at once: no engine starts
    with pytest.raises(BackendError, match="child process failed"):
        run_child(refused, "warm-up")  # a server runs (started here if none): its import is not the job's time
    server = forkserver._server
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    before = set(_children(server.proc.pid))
    with pytest.raises(BackendError, match="ran past 0.3 s"):
        run_child(_job(["none"]), "a trial", timeout=0.3)  # an engine takes seconds to start
    assert list(tmp_path.iterdir()) == []
    assert _wait(lambda: set(_children(server.proc.pid)) == before, 5)  # the child is gone
    assert forkserver._server is server and server.alive()
    with pytest.raises(BackendError, match="child process failed"):
        run_child(refused, "the next trial")
    assert forkserver._server is server and server.alive()  # the same server ran it


def test_a_server_that_cannot_start_costs_no_job(monkeypatch, tmp_path):
    """A server that dies before it is ready (here: a Python that cannot start at all): the
    job runs in a new Python, whose own error reaches the job's stderr file, and the server is
    not tried again for the same environment."""
    monkeypatch.setenv("NUMBISECT_FORKSERVER", "1")
    forkserver.shutdown()
    monkeypatch.setattr(forkserver, "_failed", None)
    err = tmp_path / "err"
    env = {**os.environ, "PYTHONHOME": str(tmp_path / "nowhere")}
    rc = forkserver.run("json.tool", [str(tmp_path / "in.json")], str(err), env, None)
    assert rc != 0 and "PYTHONHOME" in err.read_text()  # the new Python's own words
    assert forkserver._server is None and forkserver._failed == forkserver._key(env)
    monkeypatch.setattr(forkserver, "Server", None)  # a second job tries no server
    assert forkserver.run("json.tool", [str(tmp_path / "in.json")], str(err), env, None) == rc


@pytest.mark.slow  # two servers start (vLLM imported twice)
def test_a_server_that_learned_a_thread_is_replaced_by_one_that_learns_nothing(monkeypatch, tmp_path):
    """A child imports a module that starts a thread when imported; the server imports it in
    turn (it learns its children's modules), so it now has a thread it did not have when it
    was ready, and would fork with it: it says so and ends, and the job runs in a new server
    that learns nothing."""
    (tmp_path / "starts_a_thread.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(3600,), daemon=True).start()\n")
    (tmp_path / "job.py").write_text("import starts_a_thread  # noqa: F401\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), pythonpath()]), "NUMBISECT_FORKSERVER": "1"}
    monkeypatch.setenv("NUMBISECT_FORKSERVER", "1")
    monkeypatch.setattr(forkserver, "_learn", True)
    forkserver.shutdown()
    err = str(tmp_path / "err")
    assert forkserver.run("job", [], err, env, 60) == 0
    first = forkserver._server
    assert forkserver.run("job", [], err, env, 60) == 0  # the first server said "stale": a second ran it
    second = forkserver._server
    assert second is not first and not first.alive() and second.alive() and forkserver._learn is False
    assert forkserver.run("job", [], err, env, 60) == 0 and forkserver._server is second  # no longer learns: stays
    forkserver.shutdown()


PARENT = textwrap.dedent("""
    import json, sys
    from numbisect.backends.vllm.child import run_child
    run_child(json.loads(sys.argv[1]), "a trial")
""")


@pytest.mark.vllm
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_numbisect_stopped_mid_child_leaves_no_process(sig):
    """Ctrl-C in numbisect kills its child and its server; SIGKILL, which numbisect cannot
    handle, kills them too (they die with their parent)."""
    job = _job(["none"]) | {"samples": SAMPLES * 8, "prompt_lens": [4] * 16}
    p = subprocess.Popen([sys.executable, "-c", PARENT, json.dumps(job)], cwd=ROOT, stderr=subprocess.PIPE,
                         preexec_fn=sigint_as_from_a_terminal,
                         env={**os.environ, "NUMBISECT_FORKSERVER": "1", "PYTHONPATH": pythonpath()})
    try:
        assert _wait(lambda: any(_children(s) for s in _children(p.pid)), 120), "no child started"
        server = _children(p.pid)[0]
        child = _children(server)[0]
        os.kill(p.pid, sig)
        p.wait(timeout=30)
        assert _wait(lambda: not _alive(server) and not _alive(child), 10), "left behind"
        if sig == signal.SIGINT:
            assert "KeyboardInterrupt" in p.stderr.read().decode()
    finally:
        if p.poll() is None:
            p.kill()

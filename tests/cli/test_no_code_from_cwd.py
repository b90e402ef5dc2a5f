"""No code from the working directory or a checkpoint directory (#36 item 1).

Modules named like ones numbisect, torch and vLLM import late (`ctypes`, `multiprocessing`,
`json`, ...) are planted in the directory a command runs from (a copy of a checkpoint, the
checkpoint itself); each writes a marker file when imported. `python -m numbisect` (which puts
the working directory first on `sys.path`) runs from there; no marker may appear, from
numbisect's own process or any process it starts (torch inductor's `python -c` CPU probes,
vLLM's engine, ...). `VLLM_ENABLE_V1_MULTIPROCESSING=1` (vLLM's engine in another process,
spawned) is refused in one line before anything loads.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from conftest import FIXTURES, model_dir, no_cwd_env as env, plant, short_trace

from numbisect.cli import main

def test_python_m_numbisect_imports_nothing_from_the_working_directory(tmp_path):
    """No model: `report show` imports the CLI (json, click, ...) right after `python -m` put the
    directory first on sys.path."""
    markers, cwd = tmp_path / "markers", tmp_path / "work"
    markers.mkdir()
    cwd.mkdir()
    plant(cwd, markers)
    report = FIXTURES / "reports" / "qwen3_moe_planted_fault.json"
    r = subprocess.run([sys.executable, "-m", "numbisect", "report", "show", str(report)], cwd=cwd, env=env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode in (0, 1), r.stderr[-2000:]
    assert sorted(os.listdir(markers)) == []


def test_its_children_import_nothing_from_the_working_directory(tmp_path):
    """What numbisect sets in its own process reaches what it starts: PYTHONSAFEPATH=1, and
    sys.path (which inductor hands its probes as PYTHONPATH) without the working directory."""
    markers, cwd = tmp_path / "markers", tmp_path / "work"
    markers.mkdir()
    cwd.mkdir()
    plant(cwd, markers)
    code = ("import numbisect.common.procenv as p, os, sys\n"
            "p.no_code_from_cwd(entry=True)\n"
            "import subprocess\n"
            "assert os.environ['PYTHONSAFEPATH'] == '1' and '' not in sys.path and os.getcwd() not in sys.path, sys.path\n"
            "env = {**os.environ, 'PYTHONPATH': os.pathsep.join(sys.path)}\n"  # what inductor's probes get
            "subprocess.run([sys.executable, '-c', 'import ctypes, json, multiprocessing'], env=env, check=True)\n")
    # `-c` puts "" first: the planted subprocess.py would shadow the standard library's, so
    # the script itself imports it only after no_code_from_cwd (os and sys are loaded at start-up).
    r = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert sorted(os.listdir(markers)) == []


def test_vllm_multiprocessing_is_refused_in_one_line_before_anything_loads(monkeypatch, capsys):
    from numbisect import backends

    def loads(self):
        raise AssertionError("a model started loading")

    monkeypatch.setattr(backends.Registered, "loader", loads)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    code = main(["compare", "--ref", f"hf:{model_dir('qwen3')}", "--engine", f"vllm:{model_dir('qwen3')}",
                 "--trace", short_trace("qwen3", 2), "-q"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "VLLM_ENABLE_V1_MULTIPROCESSING='1'" in err[0] and "unset it" in err[0], err


@pytest.mark.vllm
@pytest.mark.parametrize("command", ["weights", "conditions", "run", "selftest"])
def test_commands_that_start_processes_from_a_checkpoint_holding_planted_modules_run_none(tmp_path, command):
    """The repro of #36 and every command that starts processes, from a checkpoint copy holding
    the planted modules (`cd` there, `hf:.`, `vllm:.`; torch inductor probes the CPU with
    `python -c` processes, and 10 of them imported a planted ctypes.py before): `run` (the
    comparison `compare` makes, then a planted fault searched for on vLLM: trials, what-ifs),
    `weights` (an in-process engine, its reference and its functional pass), `conditions` (each
    configuration in a child forked from numbisect's fork server, one custom op to localise),
    and `selftest` (one fault planted in a vLLM engine and searched for). `replay` and the TRL
    example run from such a directory in tests/live/test_bundle.py and tests/live/test_trl.py;
    `calibrate` starts no process (the reference in numbisect's own, which the first test
    here covers)."""
    import json

    markers, ckpt = tmp_path / "markers", tmp_path / "ckpt"
    markers.mkdir()
    shutil.copytree(model_dir("qwen3"), ckpt)
    plant(ckpt, markers)
    trace = short_trace("qwen3", 2)
    both = ["--ref", "hf:.", "--engine", "vllm:.", "--trace", trace, "-q"]
    args = {"weights": ["weights", *both],
            "conditions": ["conditions", *both, "--engine-config", str(tmp_path / "user.json"),
                           "-o", str(tmp_path / "c.json")],
            "run": ["run", *both, "--engine-fault", "output_noise=1@layers.1.mlp", "--out", str(tmp_path / "r.json")],
            "selftest": ["selftest", *both, "--fault", "output_noise=1@layers.2.mlp"]}[command]
    (tmp_path / "user.json").write_text(json.dumps({"enforce_eager": True, "enable_prefix_caching": False,
                                                    "compilation_config": {"custom_ops": ["none", "+rms_norm"]}}))
    r = subprocess.run([sys.executable, "-m", "numbisect", *args], cwd=ckpt, env=env(), capture_output=True, text=True,
                       timeout=600)
    print(r.stdout[-600:], r.stderr[-1500:])
    assert r.returncode in {"run": (1,), "selftest": (0,)}.get(command, (0, 1, 4, 5)), r.stderr[-2000:]
    assert sorted(os.listdir(markers)) == []

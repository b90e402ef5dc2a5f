"""The same command on the same inputs gives the same report, apart from `created` and durations.

Two fresh `bisect compare` processes (hf reference bf16, hf engine fp32 with a planted
fault, so every metric is non-zero) must write reports that are equal field for field,
floats bit for bit. Seeds and thread settings are recorded in `environment`.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import child_env

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "fixtures" / "models" / "qwen3_moe"
TRACE = ROOT / "fixtures" / "traces" / "qwen3_moe.jsonl"


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test here (and every module fixture) runs with one torch thread."""




def volatile_free(r: dict) -> dict:
    """The report without the fields allowed to change between runs."""
    r = json.loads(json.dumps(r))
    r.pop("created")
    r["environment"].pop("env", None)  # how each process was started (OMP_NUM_THREADS in the child)
    for t in r.get("trials") or []:
        t.pop("duration_s", None)
        (t.get("metrics") or {}).pop("forward_s", None)
    return r


def differences(a, b, path="") -> list[str]:
    if type(a) is not type(b):
        return [f"{path}: {a!r} vs {b!r}"]
    if isinstance(a, dict):
        out = [f"{path}/{k}: only in one" for k in set(a) ^ set(b)]
        for k in a.keys() & b.keys():
            out += differences(a[k], b[k], f"{path}/{k}")
        return out
    if isinstance(a, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} vs {len(b)} items"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}/{i}")]
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


@pytest.fixture(scope="module")
def two_reports(tmp_path_factory):
    """The same command run twice, each in a fresh process (another hash seed each time).

    Not in this process: a vLLM engine started earlier in the test session changes
    process-wide torch settings, and so the reference's last bits (seen here)."""

    d = tmp_path_factory.mktemp("det")
    trace = d / "t.jsonl"
    trace.write_text("\n".join(TRACE.read_text().splitlines()[:6]) + "\n")
    out = d / "r.json"
    argv = ["compare", "--ref", f"hf:{MODEL}", "--engine", f"hf:{MODEL}", "--engine-dtype", "float32",
            "--engine-fault", "moe_combine_bf16@layers.2.moe", "--trace", str(trace), "--out", str(out), "-q"]
    p = subprocess.run([sys.executable, "-m", "numbisect", *argv], capture_output=True, text=True, timeout=300, cwd=ROOT, env=child_env())
    assert p.returncode in (0, 1), p.stderr
    first = json.loads(out.read_text())
    out.unlink()
    p = subprocess.run([sys.executable, "-m", "numbisect", *argv], capture_output=True, text=True, timeout=300, cwd=ROOT, env=child_env())
    assert p.returncode in (0, 1), p.stderr
    return first, json.loads(out.read_text()), argv


def test_compare_twice_gives_the_same_report(two_reports):
    a, b, argv = two_reports
    assert a["baseline"]["value"] > 0  # a real divergence, not two zeros
    assert a["command"] == ["bisect", *argv]
    a, b = volatile_free(a), volatile_free(b)
    assert differences(a, b) == []


def test_seeds_and_threads_are_recorded(two_reports):
    env = dict(two_reports[0]["environment"])
    assert env.pop("env")["OMP_NUM_THREADS"] == "1"  # the child's thread setting is recorded
    other = dict(two_reports[1]["environment"])
    other.pop("env")
    assert env == other
    assert isinstance(env["threads"], int) and env["threads"] >= 1
    assert set(env["seeds"]) >= {"torch"} and all(isinstance(v, int) for v in env["seeds"].values())


def test_volatile_fields_are_only_those():
    """The stripping helper removes exactly created and the duration fields."""
    r = {"created": "x", "a": 1, "trials": [{"duration_s": 1.0, "value": 2.0, "metrics": {"forward_s": 0.1, "k": 1}}]}
    r["environment"] = {"env": {}, "threads": 1}
    assert volatile_free(r) == {"a": 1, "environment": {"threads": 1}, "trials": [{"value": 2.0, "metrics": {"k": 1}}]}
    assert differences({"a": [1.0, 2.0]}, {"a": [1.0, 2.0000001]}) == ["/a/1: 2.0 vs 2.0000001"]


def test_in_process_run_records_the_argv_it_was_given(tmp_path):
    from numbisect.cli import main

    out = tmp_path / "r.json"
    argv = ["compare", "--ref", f"hf:{MODEL}", "--engine", "rollout", "--trace", str(TRACE), "--out", str(out), "-q"]
    assert main(argv) in (0, 1)
    assert json.loads(out.read_text())["command"] == ["bisect", *argv]

"""What a vLLM child costs: a new Python per job against a child forked from the fork server.

Every vLLM child numbisect starts (a `bisect conditions` trial or localisation capture, the
user's engine configuration, the live check's cold engine) goes through
`child.run_child`. With NUMBISECT_FORKSERVER=0 each is a new Python that imports
torch and vLLM; by default each is forked from one process that imported them once
(`numbisect.backends.vllm.forkserver`). Measured in this run, the two alternated:

- one child: a prompt log-probs job (an engine started, eager, and the fixture's samples
  run), medians of --repeats per mode; the server's own start (its first job) apart;
- whether the two give the same log-probs and enabled custom ops, bit for bit, for each
  configuration (the rotary op on and off, and --dtype);
- with --conditions, `bisect conditions` end to end on DeepSeek-V3 with the rotary and
  RMSNorm custom ops on (the case of docs/how-to/engine-conditions.md), a new process per
  mode: wall time, trials, and whether the two reports' findings are the same.

Prints a table and, with --json FILE, the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _setup import quiet_env  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = [[3, 17, 5, 99, 42, 7, 11, 64, 23, 8, 150, 31, 12, 90], [9, 4, 77, 120, 6, 2, 88, 15, 33, 71, 18, 5]]
OPS = {"rope on": ["none", "+rotary_embedding", "+rms_norm"], "rope off": ["none", "+rms_norm"]}


def job(model: str, dtype: str, ops: list[str]) -> dict:
    return {"job": "logprobs", "model": model, "dtype": dtype, "max_model_len": 64,
            "settings": {"enforce_eager": True, "enable_prefix_caching": False, "compilation_config": {"custom_ops": ops}},
            "samples": SAMPLES, "prompt_lens": [4, 4]}


def timed_child(job_: dict, server: bool) -> tuple[float, dict]:
    from numbisect.backends.vllm.child import run_child

    os.environ["NUMBISECT_FORKSERVER"] = "1" if server else "0"
    t = time.perf_counter()
    out = run_child(job_, "benchmark")
    return time.perf_counter() - t, out


def conditions(server: bool, tmp: Path) -> dict:
    fam = "deepseek_v3"
    model = str(ROOT / "fixtures" / "models" / fam)
    user = tmp / "user.json"
    user.write_text(json.dumps({"enforce_eager": True, "enable_prefix_caching": False,
                                "compilation_config": {"custom_ops": OPS["rope on"]}}))
    out = tmp / f"r{int(server)}.json"
    env = {**os.environ, "NUMBISECT_FORKSERVER": "1" if server else "0", "PYTHONPATH": str(ROOT)}
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "numbisect", "conditions", "-q", "--ref", f"hf:{model}", "--engine",
                        f"vllm:{model}", "--trace", str(ROOT / "fixtures" / "traces" / f"{fam}.jsonl"),
                        "--engine-config", str(user), "-o", str(out)], capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - t
    if p.returncode not in (0, 1):
        sys.exit(f"bisect conditions failed ({p.returncode}): {p.stderr.strip().splitlines()[-1:]}")
    c = json.loads(out.read_text())["conditions"]
    return {"wall_s": wall, "trials": len(c["trials"]), "culprits": c["culprits"],
            "named": c.get("localisation", {}).get("named"), "values": [t["value"] for t in c["trials"]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("family", nargs="?", default="deepseek_v3")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--conditions", action="store_true", help="also `bisect conditions` end to end in each mode")
    ap.add_argument("--json", metavar="FILE")
    a = ap.parse_args()
    quiet_env()
    model = str(ROOT / "fixtures" / "models" / a.family)
    figs: dict = {"family": a.family, "dtype": a.dtype, "threads": os.environ.get("OMP_NUM_THREADS", "default")}
    first, _ = timed_child(job(model, a.dtype, OPS["rope off"]), server=True)  # the server starts
    figs["server_first_job_s"] = first
    times: dict = {True: [], False: []}
    same = True
    for _ in range(a.repeats):
        for ops in OPS.values():
            answers = {}
            for server in (False, True):
                s, out = timed_child(job(model, a.dtype, ops), server)
                times[server].append(s)
                answers[server] = (out["logprobs"], out["custom_ops"])
            same &= answers[True] == answers[False]
    figs["new_python_s"] = statistics.median(times[False])
    figs["forked_s"] = statistics.median(times[True])
    figs["ratio_new_over_forked"] = figs["new_python_s"] / figs["forked_s"]
    figs["same_answers"] = same
    print(f"{a.family} {a.dtype}, threads {figs['threads']}, {a.repeats} x {len(OPS)} configurations per mode")
    print(f"  server's start with its first job   {first:7.2f} s")
    print(f"  child, a new Python (median)        {figs['new_python_s']:7.2f} s")
    print(f"  child, forked (median)              {figs['forked_s']:7.2f} s   ({figs['ratio_new_over_forked']:.2f}x faster)")
    print(f"  same log-probs and custom ops       {same}")
    if a.conditions:
        with tempfile.TemporaryDirectory() as d:
            new, forked = conditions(False, Path(d)), conditions(True, Path(d))
        figs["conditions"] = {"new_python": new, "forked": forked}
        agree = {k: new[k] == forked[k] for k in ("trials", "culprits", "named", "values")}
        print(f"  bisect conditions, a new Python     {new['wall_s']:7.2f} s   {new['trials']} trials, {new['culprits']}")
        print(f"  bisect conditions, forked           {forked['wall_s']:7.2f} s   ({new['wall_s'] / forked['wall_s']:.2f}x faster)")
        print(f"  same trials, culprits, localisation {all(agree.values())}")
    if a.json:
        Path(a.json).write_text(json.dumps(figs, indent=2))


if __name__ == "__main__":
    main()

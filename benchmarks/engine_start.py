"""What starting one of numbisect's vLLM engines costs in a new Python, with and without the
cuts of numbisect.backends.vllm.startup (token ranks counted eagerly, the imported heap frozen
for the start, vLLM's collections at shutdown deferred to one).

Each run is a new Python (as each `bisect` command and each new-Python child is): torch,
transformers and vLLM imported, then `VLLMBackend(fixture)` started (its 16-token warm-up
forward included, the first request asking for log-probs), the fixture's samples run once,
and the engine closed. The baseline replaces `startup.own_engine` and `startup.collections_deferred`
by contexts that do nothing, so vLLM compiles its rank count and collects the whole heap as
it would, starting and shutting down. The two
modes are alternated --repeats times; printed: the median start, forward and close of each,
the ratios, and whether the two gave the same log-probs bit for bit.

    .venv/bin/python benchmarks/engine_start.py                       # qwen3_moe, 3 repeats
    .venv/bin/python benchmarks/engine_start.py --fixture deepseek_v3 --repeats 5

`--compiled`: a compiled engine (`enforce_eager=False`, prefix caching off, as `bisect conditions`
starts the user's settings in a child: start, warm-up and the samples timed together) instead, the
two modes vLLM's AOT compile path (`VLLM_USE_AOT_COMPILE=1`, vLLM's default with torch >=
2.10) and numbisect's (=0, startup.py 4.). Each mode gets compile caches of its own, empty at
first, and a copy of the fixture: printed, its first start, the median of the starts after it,
and a start of another copy in a new directory (vLLM keys its cache by the checkpoint's path,
so this is what a new clone of the checkpoint costs).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _setup import quiet_env  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import contextlib, json, sys, time
mode, model, trace, opts = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
from numbisect.backends.vllm import VLLMBackend, runner
from numbisect.model.trace import load_trace
if mode == "vllm":
    runner.own_engine = runner.collections_deferred = contextlib.nullcontext
import torch, transformers, vllm  # noqa: F401  imported before the clock starts, in both modes
samples = load_trace(trace).samples[:4]
if opts:  # --compiled: the user's settings as `bisect conditions` runs them (a child's job: start, warm-up, the samples)
    from numbisect.backends.vllm.condition_worker import logprobs_job
    ans = logprobs_job({"job": "logprobs", "settings": opts, "model": model, "dtype": "bfloat16",
                        "samples": [s.prompt_ids + s.completion_ids for s in samples],
                        "prompt_lens": [len(s.prompt_ids) for s in samples], "max_model_len": 512})
    print(json.dumps({"start": ans["seconds"], "logprobs": ans["logprobs"]}))
    sys.exit(0)
t0 = time.perf_counter()
eng = VLLMBackend(model, "bfloat16", **opts)
t1 = time.perf_counter()
res = eng.forward(samples)
t2 = time.perf_counter()
eng.close()
t3 = time.perf_counter()
lp = [[float(x) for x in s] for s in res.token_logprobs]
print(json.dumps({"start": t1 - t0, "forward": t2 - t1, "close": t3 - t2, "logprobs": lp}))
"""


COMPILED = {"enforce_eager": False, "enable_prefix_caching": False}


def one(mode: str, model: str, trace: str, opts: dict | None = None, env: dict | None = None) -> dict:
    p = subprocess.run([sys.executable, "-c", CHILD, mode, model, trace, json.dumps(opts or {})], cwd=ROOT,
                       capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})
    if p.returncode != 0:
        sys.exit(f"{mode}: the child failed: {p.stderr.strip().splitlines()[-1:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fixture", default="qwen3_moe")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compiled", action="store_true", help="a compiled engine: vLLM's AOT compile path against numbisect's")
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args()
    quiet_env()  # the children inherit it
    model = str(ROOT / "fixtures" / "models" / a.fixture)
    trace = str(ROOT / "fixtures" / "traces" / f"{a.fixture}.jsonl")
    if a.compiled:
        return compiled(a, model, trace)
    runs: dict = {"vllm": [], "numbisect": []}
    for _ in range(a.repeats):
        for mode in runs:
            runs[mode].append(one(mode, model, trace))
    med = {m: {k: statistics.median(r[k] for r in rs) for k in ("start", "forward", "close")} for m, rs in runs.items()}
    same = all(r["logprobs"] == runs["vllm"][0]["logprobs"] for rs in runs.values() for r in rs)
    print(f"{a.fixture}, a new Python per run, {a.repeats} runs per mode alternated (medians, s)")
    print(f"{'mode':<40}{'start':>8}{'forward':>9}{'close':>8}")
    names = {"vllm": "vLLM's own (compiled ranks, full GCs)", "numbisect": "numbisect's (startup)"}
    for m in runs:
        print(f"{names[m]:<40}{med[m]['start']:>8.2f}{med[m]['forward']:>9.2f}{med[m]['close']:>8.2f}")
    for k in ("start", "close"):
        print(f"{k}, numbisect's / vLLM's own: {med['numbisect'][k] / med['vllm'][k]:.2f}x")
    print(f"log-probs bit for bit the same in every run: {same}")
    if a.json:
        Path(a.json).write_text(json.dumps({"fixture": a.fixture, "repeats": a.repeats, "medians": med,
                                            "same_logprobs": same}, indent=1))


def compiled(a, model: str, trace: str) -> None:
    """--compiled: per mode, its own empty compile caches (vLLM's and inductor's) and its own copy
    of the fixture: the first start, --repeats starts after it (alternated between the modes),
    then one start of another copy in a new directory (as a new clone of the checkpoint)."""
    modes = {"aot": "vLLM's AOT compile path (its default)", "numbisect": "numbisect's (VLLM_USE_AOT_COMPILE=0)"}
    runs: dict = {m: [] for m in modes}
    moved: dict = {}
    with tempfile.TemporaryDirectory(prefix="numbisect-bench-") as tmp:
        env = {m: {"VLLM_USE_AOT_COMPILE": "1" if m == "aot" else "0", "VLLM_CACHE_ROOT": os.path.join(tmp, m, "vllm"),
                   "TORCHINDUCTOR_CACHE_DIR": os.path.join(tmp, m, "inductor")} for m in modes}
        paths = {m: shutil.copytree(model, os.path.join(tmp, m, "a", a.fixture)) for m in modes}
        for _ in range(a.repeats + 1):
            for m in modes:
                runs[m].append(one("numbisect", paths[m], trace, COMPILED, env[m]))
        for m in modes:
            moved[m] = one("numbisect", shutil.copytree(model, os.path.join(tmp, m, "b", a.fixture)), trace, COMPILED, env[m])
    first = {m: rs[0]["start"] for m, rs in runs.items()}
    again = {m: statistics.median(r["start"] for r in rs[1:]) for m, rs in runs.items()}
    new_dir = {m: r["start"] for m, r in moved.items()}
    same = all(r["logprobs"] == runs["aot"][0]["logprobs"] for rs in [*runs.values(), list(moved.values())] for r in rs)
    print(f"{a.fixture}, a compiled engine, a new Python per run: the first start with empty compile caches, "
          f"{a.repeats} more per mode alternated (median), one of a copy in a new directory (s; start, warm-up and 4 samples)")
    print(f"{'mode':<44}{'first':>8}{'again':>8}{'new dir':>9}")
    for m in modes:
        print(f"{modes[m]:<44}{first[m]:>8.2f}{again[m]:>8.2f}{new_dir[m]:>9.2f}")
    print(f"numbisect's / the AOT path's: first {first['numbisect'] / first['aot']:.2f}x, "
          f"again {again['numbisect'] / again['aot']:.2f}x, new dir {new_dir['numbisect'] / new_dir['aot']:.2f}x")
    print(f"log-probs bit for bit the same in every run: {same}")
    if a.json:
        Path(a.json).write_text(json.dumps({"fixture": a.fixture, "compiled": True, "repeats": a.repeats, "first": first,
                                            "again": again, "new_dir": new_dir, "same_logprobs": same}, indent=1))


if __name__ == "__main__":
    main()

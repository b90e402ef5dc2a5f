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
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _setup import quiet_env  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import contextlib, json, sys, time
mode, model, trace = sys.argv[1:4]
from numbisect.backends.vllm import VLLMBackend, runner
from numbisect.model.trace import load_trace
if mode == "vllm":
    runner.own_engine = runner.collections_deferred = contextlib.nullcontext
import torch, transformers, vllm  # noqa: F401  imported before the clock starts, in both modes
samples = load_trace(trace).samples[:4]
t0 = time.perf_counter()
eng = VLLMBackend(model, "bfloat16")
t1 = time.perf_counter()
res = eng.forward(samples)
t2 = time.perf_counter()
eng.close()
t3 = time.perf_counter()
lp = [[float(x) for x in s] for s in res.token_logprobs]
print(json.dumps({"start": t1 - t0, "forward": t2 - t1, "close": t3 - t2, "logprobs": lp}))
"""


def one(mode: str, model: str, trace: str) -> dict:
    p = subprocess.run([sys.executable, "-c", CHILD, mode, model, trace], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    if p.returncode != 0:
        sys.exit(f"{mode}: the child failed: {p.stderr.strip().splitlines()[-1:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fixture", default="qwen3_moe")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args()
    quiet_env()  # the children inherit it
    model = str(ROOT / "fixtures" / "models" / a.fixture)
    trace = str(ROOT / "fixtures" / "traces" / f"{a.fixture}.jsonl")
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


if __name__ == "__main__":
    main()

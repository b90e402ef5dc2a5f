"""Decode mode against prefill mode on one engine: what it costs, and how far apart they are.

For each fixture, one process loads the engine, warms up, then alternates a prefill
forward and a decode forward (`--engine-mode decode`: prompt prefilled, then one forced
token per step) over the fixture's trace `--repeats` times. Printed: the median time
of each and their ratio (decode / prefill), and, from the last pair, the mean k3 of
decode against prefill over completion tokens, the largest log-prob difference and the
fraction of completion tokens whose log-probs are identical.

    .venv/bin/python benchmarks/decode_vs_prefill.py                  # vLLM-CPU bf16, all fixtures
    .venv/bin/python benchmarks/decode_vs_prefill.py --engine hf      # transformers with its KV cache
    .venv/bin/python benchmarks/decode_vs_prefill.py qwen3_moe --dtype float32
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FIXTURES = ("qwen3_moe", "qwen3", "glm4_moe", "mixtral")


def measure(kind: str, name: str, dtype: str, repeats: int) -> dict:
    import torch

    from numbisect.backends import open_backend
    from numbisect.model.trace import load_trace
    from numbisect.pipeline import metrics as M

    engine = open_backend(kind, str(ROOT / "fixtures" / "models" / name), dtype, {})
    samples = load_trace(str(ROOT / "fixtures" / "traces" / f"{name}.jsonl")).samples
    try:
        engine.forward(samples[:2])
        engine.forward(samples[:2], mode="decode")
        times = {"prefill": [], "decode": []}
        out = {}
        for _ in range(repeats):
            for mode in ("prefill", "decode"):
                t0 = time.perf_counter()
                out[mode] = engine.forward(samples, mode=mode)
                times[mode].append(time.perf_counter() - t0)
    finally:
        engine.close()
    k3, diff = [], []
    for s, a, b in zip(samples, out["prefill"].token_logprobs, out["decode"].token_logprobs):
        m = s.position_mask("completion")
        k3.append(M.token_metrics(a[m], b[m])["k3"])
        diff.append((a[m].double() - b[m].double()).abs())
    k3, diff = torch.cat(k3), torch.cat(diff)
    pre, dec = statistics.median(times["prefill"]), statistics.median(times["decode"])
    return {
        "fixture": name, "engine": kind, "dtype": dtype, "samples": len(samples), "completion_tokens": int(diff.numel()),
        "prefill_s": pre, "decode_s": dec, "ratio": dec / pre,
        "k3_mean": float(k3.double().mean()), "max_abs_logprob_diff": float(diff.max()),
        "frac_identical": float((diff == 0).double().mean()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("fixtures", nargs="*", default=list(FIXTURES))
    ap.add_argument("--engine", choices=["vllm", "hf"], default="vllm")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", help="Write the figures here.")
    args = ap.parse_args()
    from _setup import quiet_env

    quiet_env()
    import torch

    torch.set_num_threads(args.threads)
    rows = []
    print(f"{'fixture':<11}{'tokens':>7}{'prefill s':>11}{'decode s':>10}{'ratio':>7}{'k3 dec|pre':>12}{'max |dlogp|':>13}{'identical':>11}")
    for name in args.fixtures:
        r = measure(args.engine, name, args.dtype, args.repeats)
        rows.append(r)
        print(f"{name:<11}{r['completion_tokens']:>7}{r['prefill_s']:>11.3f}{r['decode_s']:>10.3f}{r['ratio']:>7.1f}"
              f"{r['k3_mean']:>12.2e}{r['max_abs_logprob_diff']:>13.2e}{100 * r['frac_identical']:>10.1f}%", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""What capture costs: a plain engine forward against one with every unit captured.

Capture as it exists today is `full`: `backend.forward(samples, capture=<every unit>)`
keeps every unit's output for every sample in memory (what `compare` and the local
error use). The streaming `stats` mode and the `--capture-dir` spill of issue 6 do not
exist yet, so this measures `full` only; rerun it when they do.

1. Time: one process per fixture loads the engine, warms up, then alternates a plain
   forward and a full-capture forward over the fixture's trace `--repeats` times.
   Medians and their ratio (capture / plain).
2. Memory: each mode runs in a fresh child process (load, then `--repeats` forwards in
   that mode only). Reported: the peak RSS of the forwards (the kernel's VmHWM, reset
   after loading through /proc/self/clear_refs, so the load's own peak does not count;
   `ru_maxrss` where that is not possible), that peak over the RSS right after loading,
   and the bytes of the captured tensors (exact). The torch allocator bypasses
   `tracemalloc`, so RSS is the memory figure that counts.

    .venv/bin/python benchmarks/capture_overhead.py                 # hf float32, all fixtures
    .venv/bin/python benchmarks/capture_overhead.py --engine vllm   # vLLM-CPU bf16
    .venv/bin/python benchmarks/capture_overhead.py qwen3_moe --scale 10   # 10x the tokens: memory shows
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FIXTURES = ("qwen3_moe", "qwen3", "glm4_moe", "mixtral")


def _env() -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    warnings.filterwarnings("ignore")


def open_engine(kind: str, name: str, dtype: str, scale: int = 1):
    from numbisect.compare import open_backend
    from numbisect.trace import load_trace

    engine = open_backend(kind, str(ROOT / "fixtures" / "models" / name), dtype, {})
    trace = load_trace(str(ROOT / "fixtures" / "traces" / f"{name}.jsonl"))
    return engine, list(trace.samples) * scale


def rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def reset_peak() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) so loading does not count; Linux >= 4.0."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def peak_mb() -> float:
    """Peak RSS since `reset_peak` (VmHWM), else since the process started (ru_maxrss)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def captured_bytes(res) -> int:
    return sum(t.numel() * t.element_size() for ts in res.captures.values() for t in ts)


def child(kind: str, name: str, dtype: str, mode: str, repeats: int, scale: int) -> dict:
    """Memory of one mode, measured alone in this (fresh) process."""
    engine, samples = open_engine(kind, name, dtype, scale)
    names = [u.name for u in engine.units] if mode == "capture" else []
    gc.collect()
    after_load = rss_mb()
    reset = reset_peak()
    nbytes = 0
    for _ in range(repeats):
        res = engine.forward(samples, capture=names)
        nbytes = captured_bytes(res)
        del res
    peak = peak_mb()
    engine.close()
    return {"rss_after_load_mb": after_load, "peak_rss_mb": peak, "peak_over_load_mb": peak - after_load,
            "peak_since": "load" if reset else "process start", "captured_mb": nbytes / 2**20}


def timing(kind: str, name: str, dtype: str, repeats: int, scale: int) -> dict:
    engine, samples = open_engine(kind, name, dtype, scale)
    names = [u.name for u in engine.units]
    try:
        engine.forward(samples)  # warm-up
        engine.forward(samples, capture=names)
        plain, cap = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            engine.forward(samples)
            plain.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            res = engine.forward(samples, capture=names)
            cap.append(time.perf_counter() - t0)
        return {"units": len(names), "samples": len(samples), "tokens": sum(len(s.ids) for s in samples),
                "plain_s": statistics.median(plain), "capture_s": statistics.median(cap),
                "ratio": statistics.median(cap) / statistics.median(plain),
                "plain_all_s": plain, "capture_all_s": cap, "captured_mb": captured_bytes(res) / 2**20}
    finally:
        engine.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("fixtures", nargs="*", default=list(FIXTURES))
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: on a loaded 2-core machine "
                    "spin-waiting OpenMP threads made tiny forwards up to 50x slower)")
    ap.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    ap.add_argument("--dtype", default=None, help="default: float32 for hf, bfloat16 for vllm")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--scale", type=int, default=1, help="run the trace this many times over (more tokens)")
    ap.add_argument("--no-memory", action="store_true", help="skip the child processes that measure peak RSS")
    ap.add_argument("--json", help="also write every measurement here")
    ap.add_argument("--child", nargs=2, metavar=("FIXTURE", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    _env()
    import torch

    torch.set_num_threads(args.threads)
    dtype = args.dtype or ("float32" if args.engine == "hf" else "bfloat16")
    if args.child:
        print(json.dumps(child(args.engine, args.child[0], dtype, args.child[1], args.repeats, args.scale)))
        return 0
    print(f"engine {args.engine} ({dtype}), trace x{args.scale}, {args.repeats} repeat(s), torch threads {torch.get_num_threads()}; "
          "capture = every unit's output kept in memory (full mode; stats mode does not exist yet)")
    head = (f"{'fixture':<10} {'units':>5} {'tokens':>6} {'plain':>7} {'capture':>8} {'ratio':>6}  "
            f"{'captured':>9} {'peak RSS plain':>15} {'peak RSS capture':>17}")
    print(head)
    print("-" * len(head))
    out = []
    for name in args.fixtures:
        row = {"fixture": name, **timing(args.engine, name, dtype, args.repeats, args.scale)}
        if not args.no_memory:
            for mode in ("plain", "capture"):
                cmd = [sys.executable, __file__, "--engine", args.engine, "--dtype", dtype, "--threads", str(args.threads), "--scale", str(args.scale),
                       "--repeats", str(args.repeats), "--child", name, mode]
                done = subprocess.run(cmd, capture_output=True, text=True, check=True)
                row[mode + "_memory"] = json.loads(done.stdout.strip().splitlines()[-1])
        out.append(row)

        def mem(mode, row=row):
            m = row.get(mode + "_memory")
            return f"{m['peak_rss_mb']:.0f} (+{m['peak_over_load_mb']:.0f}) MB" if m else "-"

        print(f"{name:<10} {row['units']:>5} {row['tokens']:>6} {row['plain_s']:>6.3f}s {row['capture_s']:>7.3f}s "
              f"{row['ratio']:>6.2f}  {row['captured_mb']:>6.2f} MB {mem('plain'):>15} {mem('capture'):>17}", flush=True)
    if out:
        print(f"\nmedian capture/plain ratio: {statistics.median(r['ratio'] for r in out):.2f} "
              "(issue 6 target for stats capture: <= 1.3)")
    if args.json:
        Path(args.json).write_text(json.dumps({"engine": args.engine, "dtype": dtype, "rows": out}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

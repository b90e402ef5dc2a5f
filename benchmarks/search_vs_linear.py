"""The hierarchical search against `--strategy linear`: trials and wall time, same run.

1. For each fixture, open one session (the reference runs once; its result is cached).
2. Pick a few units (seeded) and a fault for each from the selftest profile of the
   engine kind (`numbisect.commands.selftest.PROFILES`), so every fault stands well above the
   pair's noise floor.
3. For each planted fault, run both strategies on the same session, each with a fresh
   trial runner (no trial shared), alternating H, L, H, L ... `--repeats` times. Trials
   are deterministic; wall time is the median of the repeats (this machine is noisy).
4. Print one row per fault with both counts, both times and the ratios linear /
   hierarchical, then the medians per fixture and overall (with the median time of
   one trial of each: a hierarchical trial swaps many units, a linear one a single
   unit), against issue 6's target (at least 3x fewer trials, and faster).

    .venv/bin/python benchmarks/search_vs_linear.py                      # hf float32 engine
    .venv/bin/python benchmarks/search_vs_linear.py --engine vllm --repeats 3
    .venv/bin/python benchmarks/search_vs_linear.py qwen3_moe --faults-per-fixture 5 --json out.json

Wall time is the search alone (its trials and bookkeeping); no local-error ranking is
computed (`--local-rank` adds it to the hierarchical search, and its cost to its time).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FIXTURES = ("qwen3_moe", "qwen3", "glm4_moe", "mixtral")


def planted_faults(engine, profile, n: int, rng: random.Random) -> list[str]:
    """n fault specs at distinct units, cycling through the profile's fault kinds."""
    from numbisect.commands import selftest as ST

    out, used = [], set()
    kinds = [p for p in profile.faults if ST.units_for(engine, ST.fault_kind(p.template), p.unit_kinds)]
    i = 0
    while len(out) < n and kinds:
        p = kinds[i % len(kinds)]
        units = [u for u in ST.units_for(engine, ST.fault_kind(p.template), p.unit_kinds) if u not in used]
        if not units:  # this kind has been planted at every unit it applies to
            kinds.remove(p)
            continue
        unit = rng.choice(units)
        used.add(unit)
        out.append(f"{p.template}@{unit}")
        i += 1
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("fixtures", nargs="*", default=list(FIXTURES))
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: on a loaded 2-core machine "
                    "spin-waiting OpenMP threads made tiny forwards up to 50x slower)")
    ap.add_argument("--engine", choices=("hf", "vllm"), default="hf", help="hf: float32 pair (default); vllm: bf16 pair")
    ap.add_argument("--faults-per-fixture", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each strategy per fault (median wall time)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--local-rank", action="store_true", help="order the hierarchical search by local error")
    ap.add_argument("--json", help="also write every measurement here")
    args = ap.parse_args(argv)
    from _setup import quiet_env

    quiet_env()
    import torch

    torch.set_num_threads(args.threads)
    from numbisect.commands import selftest as ST

    profile = ST.PROFILES[args.engine]
    rng = random.Random(args.seed)
    print(f"engine {args.engine} ({profile.dtype}) vs hf ({profile.dtype}), threshold {profile.threshold:g}, "
          f"{args.repeats} repeat(s), torch threads {torch.get_num_threads()}")
    head = (f"{'fixture':<10} {'fault':<44} {'n':>3} {'H trials':>8} {'L trials':>8} {'L/H':>5}  "
            f"{'H time':>7} {'L time':>7} {'L/H':>5}  found H/L")
    print(head)
    print("-" * len(head))
    rows = []
    for name in args.fixtures:
        model = ROOT / "fixtures" / "models" / name
        session = ST.open_session(f"hf:{model}", f"{args.engine}:{model}",
                                  str(ROOT / "fixtures" / "traces" / f"{name}.jsonl"), profile)
        try:
            session.reference()  # cached: not part of either search's time
            n, bound = ST.trial_bound(session.engine)
            for spec in planted_faults(session.engine, profile, args.faults_per_fixture, rng):
                ST.plant(session, [spec])
                unit = spec.partition("@")[2]
                times = {"hierarchical": [], "linear": []}
                trials, found, per_trial = {}, {}, {"hierarchical": [], "linear": []}
                for _ in range(args.repeats):
                    for strategy in ("hierarchical", "linear"):
                        res, runner, wall = ST.search_once(session, strategy, args.local_rank and strategy == "hierarchical")
                        times[strategy].append(wall)
                        per_trial[strategy] += [t.duration_s for t in runner.trials]
                        trials[strategy] = res.trials_used
                        culprits = [c.unit for c in res.culprits]
                        found[strategy] = ST.match(session.engine, unit, culprits) is not None
                ST.plant(session, [])
                h, lin = statistics.median(times["hierarchical"]), statistics.median(times["linear"])
                row = {
                    "fixture": name, "fault": spec, "n_units": n, "bound": bound,
                    "trials_hierarchical": trials["hierarchical"], "trials_linear": trials["linear"],
                    "trial_ratio": trials["linear"] / trials["hierarchical"],
                    "wall_hierarchical_s": h, "wall_linear_s": lin, "wall_ratio": lin / h,
                    "walls_hierarchical_s": times["hierarchical"], "walls_linear_s": times["linear"],
                    "found_hierarchical": found["hierarchical"], "found_linear": found["linear"],
                    "trial_s_hierarchical": statistics.median(per_trial["hierarchical"]),
                    "trial_s_linear": statistics.median(per_trial["linear"]),
                }
                rows.append(row)
                print(f"{name:<10} {spec:<44} {n:>3} {row['trials_hierarchical']:>8} {row['trials_linear']:>8} "
                      f"{row['trial_ratio']:>5.2f}  {h:>6.2f}s {lin:>6.2f}s {row['wall_ratio']:>5.2f}  "
                      f"{'yes' if found['hierarchical'] else 'NO'}/{'yes' if found['linear'] else 'NO'}", flush=True)
        finally:
            session.close()
    print()
    print(f"{'medians':<10} {'trials L/H':>10} {'time L/H':>9} {'trial H':>8} {'trial L':>8}")
    for name in args.fixtures + ["all"]:
        sel = [r for r in rows if name == "all" or r["fixture"] == name]
        if sel:
            tr = statistics.median(r["trial_ratio"] for r in sel)
            wr = statistics.median(r["wall_ratio"] for r in sel)
            th = statistics.median(r["trial_s_hierarchical"] for r in sel)
            tl = statistics.median(r["trial_s_linear"] for r in sel)
            print(f"{name:<10} {tr:>10.2f} {wr:>9.2f} {th:>7.3f}s {tl:>7.3f}s")
    if rows:
        tr = min(r["trial_ratio"] for r in rows)
        wr = min(r["wall_ratio"] for r in rows)
        ok = tr >= 3 and wr > 1
        print(f"\ntarget (issue 6): >= 3x fewer trials and faster; worst case {tr:.2f}x trials, {wr:.2f}x time: "
              + ("met" if ok else "NOT met"))
    if args.json:
        Path(args.json).write_text(json.dumps({"engine": args.engine, "threshold": profile.threshold,
                                                "repeats": args.repeats, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""How strong is each planted fault, at every unit it can be planted at?

For each fixture and each fault spec, plant it at every unit of a kind it applies to
and run two trials on one session: nothing swapped (the fault's strength: mean k3 of
completion tokens) and the faulty unit swapped back (should fall to the noise floor).
This is what `numbisect.commands.selftest`'s fault profiles were chosen from.

    .venv/bin/python benchmarks/fault_strength.py                    # hf fp32 engine, all fixtures
    .venv/bin/python benchmarks/fault_strength.py --engine vllm qwen3_moe
    .venv/bin/python benchmarks/fault_strength.py --fault output_noise=1 --fault weight_noise=1e-1

Output: one line per (fixture, fault, unit): k3 with the fault, k3 with the unit swapped,
and a mark: `weak` when the fault is under 10x the threshold, `TOO WEAK` when it is at or
under the threshold, `NOT REMOVED` when swapping the unit does not bring k3 back under it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FIXTURES = ("qwen3_moe", "qwen3", "glm4_moe", "mixtral")
# The fault templates measured by default: the selftest profile's and the ones it leaves out.
DEFAULT_FAULTS = {
    "hf": [
        "weight_noise=1e-2", "weight_noise=1e-1", "output_noise=1e-2", "output_noise=1e-1",
        "moe_combine_bf16", "router_logits_fp16", "router_logits_bf16", "router_logits_fp8", "rmsnorm_no_upcast",
    ],
    "vllm": [
        "weight_noise=1", "weight_noise=3", "output_noise=1", "output_noise=10",
        "moe_combine_bf16", "moe_combine_fp8", "router_logits_fp8", "rmsnorm_no_upcast",
    ],
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("fixtures", nargs="*", default=list(FIXTURES))
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: on a loaded 2-core machine "
                    "spin-waiting OpenMP threads made tiny forwards up to 50x slower)")
    ap.add_argument("--engine", choices=("hf", "vllm"), default="hf", help="hf: float32 pair; vllm: bf16 pair")
    ap.add_argument("--fault", action="append", help="fault template (NAME[=VALUE], no unit); repeatable")
    ap.add_argument("--threshold", type=float, default=None, help="default: the selftest profile's")
    ap.add_argument("--unit-kind", action="append", help="only units of this kind (repeatable)")
    args = ap.parse_args(argv)
    from _setup import quiet_env

    quiet_env()
    import torch

    torch.set_num_threads(args.threads)
    from numbisect.commands import selftest as ST

    profile = ST.PROFILES[args.engine]
    thr = args.threshold if args.threshold is not None else profile.threshold
    templates = args.fault or DEFAULT_FAULTS[args.engine]
    print(f"engine {args.engine} ({profile.dtype}), threshold {thr:g}")
    print(f"{'fixture':<10} {'fault':<24} {'unit':<26} {'k3 fault':>10} {'k3 swapped':>10}  note")
    rows = []
    for name in args.fixtures:
        session = ST.open_session(f"hf:{ROOT}/fixtures/models/{name}", f"{args.engine}:{ROOT}/fixtures/models/{name}",
                                  str(ROOT / "fixtures" / "traces" / f"{name}.jsonl"), profile, thr)
        try:
            session.faults = []
            floor, _ = session.trial(())
            print(f"{name:<10} {'(none)':<24} {'':<26} {floor:>10.3g} {'':>10}  noise floor")
            for tpl in templates:
                units = ST.units_for(session.engine, ST.fault_kind(tpl), tuple(args.unit_kind) if args.unit_kind else None)
                if not units:
                    print(f"{name:<10} {tpl:<24} {'(no unit of its kind)':<26}")
                for unit in units:
                    t0 = time.perf_counter()
                    session.faults = [ST.parse_fault(f"{tpl}@{unit}")]
                    k3, _ = session.trial(())
                    k3s, _ = session.trial([unit])
                    rows.append((tpl, session.engine.unit(unit).kind, k3, k3s, f"{name} {unit}"))
                    note = "TOO WEAK" if k3 <= thr else ("weak" if k3 < 10 * thr else "")
                    if k3s > thr:
                        note = (note + " NOT REMOVED").strip()
                    print(f"{name:<10} {tpl:<24} {unit:<26} {k3:>10.3g} {k3s:>10.3g}  {note}"
                          f"  ({time.perf_counter() - t0:.1f}s)", flush=True)
        finally:
            session.faults = []
            session.close()
    print(f"\nsummary over {', '.join(args.fixtures)}: weakest and strongest per fault and unit kind")
    print(f"{'fault':<24} {'unit kind':<14} {'units':>5} {'weakest':>9} {'strongest':>9} {'max swapped':>11}  weakest at")
    groups: dict = {}
    for tpl, kind, k3, k3s, where in rows:
        groups.setdefault((tpl, kind), []).append((k3, k3s, where))
    for (tpl, kind), v in groups.items():
        lo, hi = min(v), max(v)
        print(f"{tpl:<24} {kind:<14} {len(v):>5} {lo[0]:>9.2g} {hi[0]:>9.2g} {max(x[1] for x in v):>11.2g}  {lo[2]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

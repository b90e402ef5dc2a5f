"""The cost of finding vLLM-CPU's MoE prepacking order (numbisect.backends.vllm.model.pack_order)
for a real-sized experts tensor: per expert (one expert's order, applied to each expert in
turn: what the weight check does) against the order over the whole tensor as it was found
before (int64, every element, `--whole`).

Each run is a fresh child process: vLLM's ops imported first, then the peak RSS is reset
(VmHWM through /proc/self/clear_refs) and the order is found for a [experts, rows, cols]
bf16 tensor packed with `cpu_prepack_moe_weight(x, isa)`. Reported: the time to find it,
the peak RSS over the RSS before (the order's temporaries included), the bytes of the order
kept, and whether unpacking a packed random tensor by it gives the tensor back.

    .venv/bin/python benchmarks/pack_order.py                        # 128 x 1536 x 2048 per expert; 8 and 16 experts both ways
    .venv/bin/python benchmarks/pack_order.py --shape 8x1536x2048 --whole
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def rss_mb(field: str) -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def whole_order(shape: tuple, dtype, pack):
    """The order as numbisect found it before per-expert orders: int64, over the whole tensor."""
    import torch

    n = math.prod(shape)
    idx = torch.arange(n)
    order = torch.zeros(n, dtype=torch.long)
    for d in range(max(1, math.ceil(math.log(n, 256)))):
        digit = ((idx >> (8 * d)) & 255).to(dtype).view(shape)
        order += pack(digit).reshape(-1).to(torch.long) << (8 * d)
    return order if torch.equal(order.sort().values, idx) else None


def child(shape: tuple, isa: str, whole: bool) -> dict:
    import torch
    from vllm._custom_ops import cpu_prepack_moe_weight

    from numbisect.backends.vllm.model import pack_order, unpack

    torch.set_num_threads(1)
    pack = lambda x: cpu_prepack_moe_weight(x, isa)  # noqa: E731
    before = rss_mb("VmRSS")
    reset_peak()
    t0 = time.perf_counter()
    order = whole_order(shape, torch.bfloat16, pack) if whole else pack_order(("moe", isa), shape, torch.bfloat16, pack,
                                                                               block=1)
    seconds = time.perf_counter() - t0
    peak = rss_mb("VmHWM") - before
    e = min(shape[0], 2)  # unpacking checked on two experts' worth (the order applies to each in turn)
    x = torch.randn((e, *shape[1:]), generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    back = unpack(pack(x), order if not whole else order[: x.numel()], tuple(x.shape))
    return {"shape": list(shape), "isa": isa, "way": "whole, int64 (before)" if whole else "per expert",
            "seconds": round(seconds, 3), "peak_mb": round(peak, 1),
            "order_mb": round(order.numel() * order.element_size() / 2**20, 1), "order_dtype": str(order.dtype),
            "unpacks": bool(back is not None and torch.equal(back, x))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", action="append", help="EXPERTSxROWSxCOLS (repeatable; default: the runs in the doc)")
    ap.add_argument("--isa", default="amx", choices=["amx", "vec"])
    ap.add_argument("--whole", action="store_true", help="the order over the whole tensor (before), not per expert")
    ap.add_argument("--json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        shape, isa, whole = json.loads(a.child)
        print(json.dumps(child(tuple(shape), isa, whole)))
        return
    runs = [(tuple(int(x) for x in s.split("x")), a.whole) for s in a.shape] if a.shape else \
        [((8, 1536, 2048), True), ((8, 1536, 2048), False), ((16, 1536, 2048), True), ((16, 1536, 2048), False),
         ((128, 1536, 2048), False)]
    rows = []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for shape, whole in runs:
        out = subprocess.run([sys.executable, __file__, "--child", json.dumps([shape, a.isa, whole])], env=env,
                             capture_output=True, text=True, cwd=ROOT)
        if out.returncode:
            sys.exit(f"pack_order.py: the child for {shape} failed: {out.stderr.strip().splitlines()[-1:]}")
        row = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(f"{'x'.join(map(str, shape)):>14} {row['isa']:>4} {row['way']:<22} {row['seconds']:8.3f} s "
              f"peak +{row['peak_mb']:8.1f} MB  order {row['order_mb']:7.1f} MB ({row['order_dtype']})  "
              f"unpacks: {row['unpacks']}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

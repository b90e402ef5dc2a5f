"""warm_vs_cold on an FSDP2 trainer with an engine on each rank (colocated), on the dense
qwen3 fixture: the engines' settings and samples agree, so one cold child (rank 0's)
serves both ranks, each comparing its own engine with it. The suite runs the same on
qwen3_moe (tests/live/fsdp_scenarios.py, scenario 8); this one times it on its own (two
engines and a cold child: about 1.5 min here); its figures are in
docs/how-to/training-loop.md.

    PYTHONPATH=. torchrun --nproc-per-node 2 benchmarks/colocated_cold.py

Two ranks (gloo, CPU), the qwen3 fixture sharded per layer, an engine on each rank
(tests/live/fsdp_scenarios.py's `start_engine`), each fed the gathered weights;
`warm_vs_cold(functional=True)` on both ranks, then rank 1's sync pushes layer 3's
up_proj scaled by 1.5 into its engine only and the cold load is reused. Prints each rank's
figures (JSON). The code is under `main()`: vLLM's engine core is spawned, and a spawned
child imports the script that started it again.
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "live"))


def main():
    import fsdp_scenarios as S
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from numbisect.live.sharded import attach_sharded
    from numbisect.live.sync import push

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = AutoModelForCausalLM.from_pretrained(S.MODEL, dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    t0 = time.perf_counter()
    llm = S.start_engine()
    start = time.perf_counter() - t0

    def sync(bad=False):
        full = {n: t.full_tensor().detach() for n, t in model.state_dict().items()}
        push(llm, [(n, t * 1.5 if bad and n == "model.layers.3.mlp.up_proj.weight" else t) for n, t in full.items()])

    sync()
    probe = attach_sharded(model, engine=llm)
    t0 = time.perf_counter()
    wc = probe.warm_vs_cold(functional=True)
    a = time.perf_counter() - t0
    sync(bad=rank == 1)
    t0 = time.perf_counter()
    wb = probe.warm_vs_cold(functional=True, cold=wc.cold)
    b = time.perf_counter() - t0
    mine = {"engine_start_s": start, "cold_s": a, "child_s": wc.cold.seconds, "ran_child": probe._probe._ran_child,
            "ok": wc.lines(), "reused_s": b, "bug": wb.lines()}
    every = [None, None]
    dist.all_gather_object(every, mine)
    if rank == 0:
        print(json.dumps(every, indent=1))
    probe.close()
    llm.llm_engine.engine_core.shutdown()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""The sharded-trainer scenarios of tests/live/test_sharded.py, run once under torchrun:

    torchrun --nproc-per-node 2 tests/live/fsdp_scenarios.py OUT.json

Two ranks (gloo, CPU) train the qwen3 fixture sharded with FSDP2 (`fully_shard`, real
AdamW steps); rank 0 holds a vLLM-CPU engine (its engine core in a process of its own: a
vLLM in the trainer's process would join the trainer's process group) and pushes the
weights with vLLM's reload; rank 1 only takes part in the gathers. After each sync every
rank calls `ShardedProbe.check_weights()` (and rank 0 `check_local()`); rank 0 writes what
each check said to OUT.json. Scenarios, in order (the last leaves the probe's group out of
step):

1. correct: every rank gathers every tensor in the same order, rank 0 pushes them all;
2. one shard: rank 0 pushes its own rows only (the other rows keep the last sync's);
3. rank order: the ranks gather two same-shaped tensors (layer 1's q_proj, k_proj) in a
   rank-dependent order (each gets the other's rows), rank 0 pushes what it got;
4. poison: `check_sync` around a sync that skips layer 2's MLP, then around a correct one;
5. skip: rank 1 does not call the check; rank 0's call must fail in one line within the
   probe's timeout (a probe of its own, attached with timeout=5).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, "fixtures", "models", "qwen3")
TIMEOUT = 5.0  # the skip scenario's probe: its bound on a wait, seconds


def start_engine():
    """vLLM-CPU in an engine-core process of its own (spawned: a fresh torch.distributed)."""
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    saved = {k: os.environ.get(k) for k in keys}
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_WORKER_MULTIPROC_METHOD="spawn",
                      VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    try:
        import vllm

        return vllm.LLM(model=MODEL, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", max_model_len=128,
                        seed=0)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def main(out_path: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from numbisect.live.sharded import ShardedError, attach_sharded
    from numbisect.live.sync import push

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    llm = start_engine() if rank == 0 else None
    dist.barrier()
    results: dict = {"world": world}

    def train_step() -> float:
        t0 = time.perf_counter()
        ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(len(results)))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t0

    def gathered(order=None) -> dict:
        sd = model.state_dict()
        names = order or list(sd)
        return {n: sd[n].full_tensor().detach() for n in names}

    pushed: dict = {}

    def send(tensors: dict) -> float:
        t0 = time.perf_counter()
        if rank == 0:
            push(llm, list(tensors.items()))
            pushed.update({n: t.clone() for n, t in tensors.items()})
        return time.perf_counter() - t0

    def record(name: str, probe, extra: dict | None = None) -> None:
        t0 = time.perf_counter()
        before = probe.gathers
        c = probe.check_weights(step=name)
        row = {"seconds": time.perf_counter() - t0, "ok": c.ok, "lines": c.lines(), "weights": c.to_dict(),
               "layers_gathered": probe.gathers - before, "layers": len(probe.groups), **(extra or {})}
        local = probe.check_local(step=name)
        if local is not None:
            row["local"] = local.to_dict()
        results[name] = row

    from numbisect.live import LiveError, attach

    try:  # the whole-model API on a sharded model: one line naming attach_sharded (before any engine is opened)
        attach(reference=model, engine=MODEL)
        results["attach"] = None
    except LiveError as e:
        results["attach"] = str(e)
    t0 = time.perf_counter()
    send(gathered())
    results["first_sync_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    probe = attach_sharded(model, engine=llm)
    results["attach_s"] = time.perf_counter() - t0

    # 1. correct
    step_s = train_step()
    t0 = time.perf_counter()
    full = gathered()
    gather_s = time.perf_counter() - t0
    sync_s = send(full)
    record("correct", probe, {"train_step_s": step_s, "gather_s": gather_s, "sync_s": sync_s})

    # 2. one shard: rank 0's own rows pushed into the last sync's tensors
    train_step()
    sd = model.state_dict()
    mine = {}
    for n, t in sd.items():
        local = t.to_local().detach()
        if rank == 0:
            whole = pushed[n].clone()
            whole.narrow(0, 0, local.shape[0]).copy_(local)
            mine[n] = whole
    send(mine)
    record("one_shard", probe)

    # 3. rank order: layer 1's q_proj and k_proj gathered in a rank-dependent order
    train_step()
    q, k = "model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"
    order = list(model.state_dict())
    if rank == 1:
        i, j = order.index(q), order.index(k)
        order[i], order[j] = order[j], order[i]
    send(gathered(order))
    record("rank_order", probe)

    # 4. poison control: a sync that skips layer 2's MLP (every rank gathers the rest)
    train_step()
    t0 = time.perf_counter()
    c = probe.check_sync(lambda: send({n: t for n, t in gathered().items() if ".layers.2.mlp." not in n}), step="poison")
    results["poison"] = {"seconds": time.perf_counter() - t0, "ok": c.ok, "lines": c.lines(), "weights": c.to_dict(),
                         "poison": getattr(c, "poison", None)}
    t0 = time.perf_counter()
    c = probe.check_sync(lambda: send(gathered()), step="poison_correct")
    results["poison_correct"] = {"seconds": time.perf_counter() - t0, "ok": c.ok, "lines": c.lines(),
                                 "poison": getattr(c, "poison", None)}

    # 5. skip: rank 1 does not enter the check (a probe of its own, with a short timeout)
    train_step()
    send(gathered())
    short = attach_sharded(model, engine=llm, timeout=TIMEOUT)
    if rank == 0:
        t0 = time.perf_counter()
        try:
            short.check_weights(step="skip")
            results["skip"] = {"raised": None}
        except ShardedError as e:
            results["skip"] = {"raised": str(e), "seconds": time.perf_counter() - t0}
    dist.barrier()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1, default=str)
        llm.llm_engine.engine_core.shutdown()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])

"""live_cost.py --fsdp / --transfer: what the check costs on the trainer shapes of
numbisect.live.sharded and numbisect.live.transfer (medians of --repeats).

--fsdp: two ranks under torchrun (gloo, CPU), the fixture sharded with FSDP2, AdamW; rank
0's vLLM-CPU engine in an engine-core process of its own (tests/live/fsdp_scenarios.py
says why), pushed the gathered weights with vLLM's reload. Per step: the training step,
the sync (every rank gathers every tensor, rank 0 pushes), `ShardedProbe.check_weights()`
on every rank (and the layers it gathered: the goal is the model once), `check_local()`;
the same check with the functional pass (4 sequences of 32 tokens, the sharded model's
forwards on every rank), a poison-control cycle (`check_sync`) against rank 0's engine
forward plus the sync, and the warm-vs-cold oracle (the cold engine's child once, then
the cold load reused).

--transfer: an in-process engine with numbisect's in-process transport: a push through
vLLM's weight-transfer API (start, 2 chunks, finish, version) against vLLM's reload of the
same tensors, and the weight check with the push ledger (`transfer.watch`) against without.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def fsdp(args, model_dir: str) -> dict:
    """Run this module under torchrun (2 ranks); rank 0's figures."""
    import tempfile

    out = Path(tempfile.mkdtemp(prefix="numbisect-fsdp-")) / "fig.json"
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests' / 'live'}"}
    subprocess.run([torchrun, "--nproc-per-node", "2", __file__, model_dir, str(out), str(args.repeats)], env=env,
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL if not args.verbose else None)
    fig = json.loads(out.read_text())
    rows = [("training step (2 ranks, AdamW)", f"{fig['train_step_s'] * 1e3:.0f} ms"),
            ("sync: gather every tensor + push", f"{fig['sync_s'] * 1e3:.0f} ms"),
            ("check_weights, every rank", f"{fig['check_s'] * 1e3:.0f} ms ({fig['check_vs_step']:.2f}x a training step; "
                                          f"{fig['layers_gathered']} of {fig['layers']} layers gathered)"),
            ("check_local, rank 0", f"{fig['local_s'] * 1e3:.0f} ms"),
            ("rank 0's engine forward (prompt log-probs)", f"{fig['forward_s'] * 1e3:.0f} ms"),
            ("check_weights(functional=True), every rank", f"{fig['functional_s'] * 1e3:.0f} ms "
                                                          f"({fig['functional_vs_step']:.2f}x a training step)"),
            ("check_sync: a poison-control cycle", f"{fig['poison_cycle_s'] * 1e3:.0f} ms "
                                                   f"({fig['poison_vs_forward_plus_sync']:.2f}x forward + sync)"),
            ("warm_vs_cold, the cold engine started",
             f"{fig['warm_cold_s']:.1f} s (once; the child {fig['cold_child_s']:.1f} s)"),
            ("warm_vs_cold, the cold load reused", f"{fig['warm_cold_reused_s'] * 1e3:.0f} ms")]
    _table(f"FSDP2 on {Path(model_dir).name}, 2 ranks, medians of {args.repeats}", rows)
    return fig


def _table(title: str, rows: list) -> None:
    w = max(len(a) for a, _ in rows)
    print(title)
    for a, b in rows:
        print(f"  {a:<{w}}  {b}")


def _worker(model_dir: str, out: str, repeats: int) -> None:
    import torch
    import torch.distributed as dist
    import fsdp_scenarios  # tests/live: rank 0's engine in an engine-core process of its own
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from numbisect.live.sharded import attach_sharded
    from numbisect.live.sync import push

    fsdp_scenarios.MODEL = model_dir
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    llm = fsdp_scenarios.start_engine() if rank == 0 else None
    dist.barrier()

    def sync():
        full = {n: t.full_tensor().detach() for n, t in model.state_dict().items()}
        if rank == 0:
            push(llm, list(full.items()))

    sync()
    probe = attach_sharded(model, engine=llm)
    times: dict[str, list] = {"train_step_s": [], "sync_s": [], "check_s": [], "local_s": [], "forward_s": [],
                              "functional_s": [], "poison_cycle_s": []}
    prompts = [list(range(3 + 7 * i, 35 + 7 * i)) for i in range(4)]  # 4 sequences of 32 tokens
    gathered = []
    for i in range(repeats):
        t0 = time.perf_counter()
        ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(i))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        times["train_step_s"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        sync()
        times["sync_s"].append(time.perf_counter() - t0)
        dist.barrier()
        t0, before = time.perf_counter(), probe.gathers
        c = probe.check_weights()
        times["check_s"].append(time.perf_counter() - t0)
        gathered.append(probe.gathers - before)
        assert c.ok, c.lines()
        t0 = time.perf_counter()
        probe.check_local()
        times["local_s"].append(time.perf_counter() - t0)
        if rank == 0:
            t0 = time.perf_counter()
            fsdp_scenarios.engine_logprobs(llm, prompts)
            times["forward_s"].append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        c = probe.check_weights(functional=True, samples=prompts)
        times["functional_s"].append(time.perf_counter() - t0)
        assert c.ok, c.lines()
        t0 = time.perf_counter()
        c = probe.check_sync(sync)
        times["poison_cycle_s"].append(time.perf_counter() - t0)
        assert c.ok, c.lines()
    t0 = time.perf_counter()
    wc = probe.warm_vs_cold()
    warm_cold_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    probe.warm_vs_cold(cold=wc.cold)
    warm_cold_reused_s = time.perf_counter() - t0
    assert wc.ok, wc.lines()
    probe.close()
    times = {k: v for k, v in times.items() if v}  # rank 0's engine forward: timed on rank 0 only
    fig = {k: statistics.median(v) for k, v in times.items()}
    fig.update(layers_gathered=max(gathered), layers=len(probe.groups), check_vs_step=fig["check_s"] / fig["train_step_s"],
               functional_vs_step=fig["functional_s"] / fig["train_step_s"], warm_cold_s=warm_cold_s,
               cold_child_s=wc.cold.seconds, warm_cold_reused_s=warm_cold_reused_s)
    if "forward_s" in fig:
        fig["poison_vs_forward_plus_sync"] = fig["poison_cycle_s"] / (fig["forward_s"] + fig["sync_s"])
    if rank == 0:
        Path(out).write_text(json.dumps(fig, indent=1))
        llm.llm_engine.engine_core.shutdown()
    dist.barrier()
    dist.destroy_process_group()


def transfer(args, model_dir: str) -> dict:
    import torch
    import vllm
    from transformers import AutoModelForCausalLM

    from numbisect.live import attach
    from numbisect.live import transfer as T
    from numbisect.live.sync import push, trainer_tensors

    llm = vllm.LLM(model=model_dir, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", max_model_len=256,
                   seed=0, enable_prefix_caching=False, weight_transfer_config={"backend": T.register()})
    llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": {}})
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    probe = attach(reference=model, engine=llm)
    items = trainer_tensors(model)
    med = statistics.median
    fig = {}
    fig["reload_s"] = med(_times(lambda: push(llm, items), args.repeats))
    fig["api_push_s"] = med(_times(lambda: T.push(llm, items, version="v", chunks=2), args.repeats))
    fig["check_s"] = med(_times(lambda: probe.check_weights(functional=False), args.repeats))
    T.watch(llm)
    T.push(llm, items, version="v", chunks=2)
    fig["check_watched_s"] = med(_times(lambda: probe.check_weights(functional=False), args.repeats))
    c = probe.check_weights(functional=False)
    assert c.ok and c.push["state"] == "finished", c.lines()
    rows = [("vLLM's reload of every tensor", f"{fig['reload_s'] * 1e3:.1f} ms"),
            ("a push through the weight-transfer API", f"{fig['api_push_s'] * 1e3:.1f} ms (2 chunks)"),
            ("weight check (per tensor)", f"{fig['check_s'] * 1e3:.1f} ms"),
            ("the same, push ledger read too", f"{fig['check_watched_s'] * 1e3:.1f} ms")]
    _table(f"vLLM's weight-transfer API on {Path(model_dir).name}, in-process transport, medians of {args.repeats}", rows)
    probe.close()
    llm.llm_engine.engine_core.shutdown()
    return fig


def _times(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], int(sys.argv[3]))

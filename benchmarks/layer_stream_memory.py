"""Peak memory of the layer-streamed reference against loading the whole model.

A synthetic checkpoint (the qwen3 fixture's architecture, random weights, `--hidden`
and `--layers` chosen so the weights dominate) is written to a temporary directory.
Each mode runs in a fresh child process: imports and the trace first, then the peak
RSS is reset (VmHWM through /proc/self/clear_refs) and the mode runs:

- `full`: `HFBackend` loads the whole model and runs the trace (what `hf:DIR` does);
- `stream`: `LayerStreamRef` runs the same trace one layer's weights at a time.

Reported: the weights' bytes, each mode's peak RSS over the RSS before it ran, the
largest weights the stream held at once, and whether both gave the same log-probs.

    .venv/bin/python benchmarks/layer_stream_memory.py --hidden 1024 --layers 8
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def make_checkpoint(out: str, hidden: int, layers: int, dtype: str = "bfloat16", vocab: int | None = None) -> int:
    """Random-weight qwen3 checkpoint in `out` (the fixture's vocabulary of 256 unless
    `vocab`); returns the bytes of its weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = json.loads((ROOT / "fixtures/models/qwen3/config.json").read_text())
    heads = max(2, hidden // 64)
    cfg.update(hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers, num_attention_heads=heads,
               num_key_value_heads=max(1, heads // 2), head_dim=64, torch_dtype=dtype, dtype=dtype)
    if vocab:
        cfg["vocab_size"] = vocab
    cfg.pop("layer_types", None)
    cfg.pop("max_window_layers", None)
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "config.json").write_text(json.dumps(cfg))
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(out)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    model.save_pretrained(out, safe_serialization=True)
    return sum(p.numel() * p.element_size() for p in model.parameters())


CHILD = r"""
import json, os, sys, torch
torch.set_num_threads(1)
sys.path.insert(0, {root!r})
from numbisect.model.trace import load_trace
from numbisect.backends.hf import HFBackend
from numbisect.pipeline.layerstream import LayerStreamRef
import transformers
samples = load_trace({trace!r}).samples[:{n}]
import transformers.models.qwen3.modeling_qwen3  # imported code is not the model's memory
with torch.device('meta'):
    transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained({ckpt!r}))
import gc; gc.collect()
def rss():
    return int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE')
def hwm():
    for line in open('/proc/self/status'):
        if line.startswith('VmHWM:'):
            return int(line.split()[1]) * 1024
before = rss()
open('/proc/self/clear_refs', 'w').write('5')
held = None
if {mode!r} == 'full':
    ref = HFBackend({ckpt!r}, 'bfloat16')
    lp = ref.forward(samples).token_logprobs
else:
    ref = LayerStreamRef({ckpt!r}, 'bfloat16')
    lp = ref.stream(samples)[0]
    held = ref.peak_loaded_bytes
print(json.dumps({{"peak_over_before": hwm() - before, "held": held, "logprobs": [x.tolist() for x in lp]}}))
"""


def measure(ckpt: str, mode: str, samples: int = 4) -> dict:
    code = CHILD.format(root=str(ROOT), trace=str(ROOT / "fixtures/traces/qwen3.jsonl"), n=samples, mode=mode, ckpt=ckpt)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--json", help="also write the measurements here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="numbisect-ls-") as d:
        weights = make_checkpoint(d, args.hidden, args.layers)
        full, stream = measure(d, "full", args.samples), measure(d, "stream", args.samples)
    same = full["logprobs"] == stream["logprobs"]
    mb = 2**20
    print(f"synthetic qwen3, hidden {args.hidden}, {args.layers} layers, bf16: weights {weights / mb:.1f} MB, {args.samples} samples")
    print(f"full load     peak RSS over start {full['peak_over_before'] / mb:8.1f} MB")
    print(f"layer stream  peak RSS over start {stream['peak_over_before'] / mb:8.1f} MB (largest weights held at once "
          f"{stream['held'] / mb:.1f} MB); ratio stream/full {stream['peak_over_before'] / full['peak_over_before']:.2f}")
    print(f"log-probs bitwise equal: {same}")
    if args.json:
        Path(args.json).write_text(json.dumps({"weights": weights, "full": full["peak_over_before"],
                                               "stream": stream["peak_over_before"], "held": stream["held"], "same": same}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What the vocabulary costs a search: trials with and without full logits, and a compare's memory.

Real vocabularies are 32k to 256k entries, so a sample's full log-probs (tokens x vocab
floats) are far larger than any hidden-size activation. A search judged on k3 needs only
each token's log-prob; the full-vocabulary KL needs both sides' full log-probs.

1. A random-weight qwen3 (`layer_stream_memory.make_checkpoint`) of `--hidden`,
   `--layers` and `--vocab`; an hf engine against an hf reference of the same dtype,
   with output noise planted on the last layer's MLP so the two differ; the fixture
   trace, `--scale` times over.
2. Time: one session; trials with nothing swapped and no prefix reuse (every layer
   computed), alternating `--metric kl-mean` (the engine's full logits taken, a float64
   KL against the reference's) and `k3-mean` (token log-probs only), `--repeats` times.
   Medians and their ratio.
3. Memory: in a fresh child process each, after loading and one forward per side (the
   memory-mapped weights paged in): a plain engine forward over the trace, and
   `compare` (stats capture) with each metric; the peak RSS over the RSS before it
   (VmHWM reset). With k3-mean no full log-probs outlive their sample; kl-mean keeps
   the reference's for its trials: tokens x vocab x 4 bytes (printed as "full log-probs").

    .venv/bin/python benchmarks/vocab_scale.py                       # hidden 256, 2 layers, vocab 32768
    .venv/bin/python benchmarks/vocab_scale.py --vocab 131072 --scale 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _setup import quiet_env  # noqa: E402

FAULT = "output_noise=1e-2@layers.{last}.mlp"


def open_session(model: str, dtype: str, scale: int, metric: str, layers: int, trace_dir: str):
    from numbisect.model.trace import load_trace
    from numbisect.pipeline.measure import Settings
    from numbisect.session.session import Session, Spec

    src = ROOT / "fixtures" / "traces" / "qwen3.jsonl"
    trace = Path(trace_dir) / f"trace_x{scale}.jsonl"
    if not trace.exists():
        lines = [json.dumps({"prompt_ids": s.prompt_ids, "completion_ids": s.completion_ids}) for s in load_trace(str(src)).samples]
        trace.write_text("\n".join(lines * scale) + "\n")
    spec = Spec(ref=f"hf:{model}", engine=f"hf:{model}", trace=str(trace), ref_dtype=dtype, engine_dtype=dtype,
                faults=[FAULT.format(last=layers - 1)])
    return Session(spec, Settings(metric=metric, threshold=0.0), prefix_reuse=False)


def child(model: str, dtype: str, scale: int, metric: str, layers: int, trace_dir: str) -> dict:
    from capture_overhead import peak_mb, reset_peak, rss_mb

    s = open_session(model, dtype, scale, "k3-mean" if metric == "plain" else metric, layers, trace_dir)
    try:
        # a first forward on each side pages in the weights (safetensors are memory-mapped)
        s.ref.forward(s.samples[:1], full_logits=True)
        s.engine.forward(s.samples[:1], full_logits=True)
        after = rss_mb()
        reset = reset_peak()
        if metric == "plain":
            s.engine.forward(s.samples)
            kl = None
        else:
            kl = s.compare(local=False)["baseline"]["groups"]["completion"]["kl"]["mean"]
        return {"rss_after_load_mb": after, "peak_over_load_mb": peak_mb() - after,
                "peak_since": "load" if reset else "start", "kl_mean": kl}
    finally:
        s.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--scale", type=int, default=1, help="run the 20-sample trace this many times over")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", help="also write every measurement here")
    ap.add_argument("--child", nargs=3, metavar=("MODEL", "METRIC", "TRACE_DIR"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    quiet_env()
    import torch

    torch.set_num_threads(args.threads)
    if args.child:
        model, metric, tdir = args.child
        print(json.dumps(child(model, args.dtype, args.scale, metric, args.layers, tdir)))
        return 0
    from layer_stream_memory import make_checkpoint

    with tempfile.TemporaryDirectory(prefix="numbisect-vocab-") as tmp:
        model = str(Path(tmp) / "model")
        make_checkpoint(model, args.hidden, args.layers, dtype=args.dtype, vocab=args.vocab)
        times: dict[str, list[float]] = {"kl-mean": [], "k3-mean": []}
        s = open_session(model, args.dtype, args.scale, "k3-mean", args.layers, tmp)
        try:
            s.reference()  # both sides' full log-probs for the KL trials (not timed)
            tokens = sum(len(x.ids) - 1 for x in s.samples)
            values = {}
            for metric in times:  # warm-up
                s.settings.metric = metric
                values[metric] = s.trial(())
            for _ in range(args.repeats):
                for metric in times:
                    s.settings.metric = metric
                    t0 = time.perf_counter()
                    s.trial(())
                    times[metric].append(time.perf_counter() - t0)
        finally:
            s.close()
        full_mb = tokens * args.vocab * 4 / 2**20
        print(f"random qwen3 hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, hf {args.dtype} vs hf {args.dtype}, "
              f"{tokens} tokens, torch threads {torch.get_num_threads()}, {args.repeats} repeats")
        kl_t, k3_t = statistics.median(times["kl-mean"]), statistics.median(times["k3-mean"])
        print(f"trial (every layer computed): full logits + KL {kl_t:.3f} s, token log-probs only {k3_t:.3f} s, "
              f"ratio {kl_t / k3_t:.2f}; judged k3 the same: {values['kl-mean'][1]['groups']['completion']['k3_mean'] == values['k3-mean'][1]['groups']['completion']['k3_mean']}")
        mem = {}
        for metric in ("plain", *times):
            cmd = [sys.executable, __file__, "--dtype", args.dtype, "--scale", str(args.scale), "--layers", str(args.layers),
                   "--threads", str(args.threads), "--child", model, metric, tmp]
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            mem[metric] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"peak RSS over load: engine forward over the trace +{mem['plain']['peak_over_load_mb']:.0f} MB; compare (stats "
              f"capture) with k3-mean +{mem['k3-mean']['peak_over_load_mb']:.0f} MB, with kl-mean "
              f"+{mem['kl-mean']['peak_over_load_mb']:.0f} MB (keeps the reference's full log-probs for its trials); "
              f"the trace's full log-probs, one side: {full_mb:.0f} MB; KL the same: {mem['k3-mean']['kl_mean'] == mem['kl-mean']['kl_mean']}")
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "tokens": tokens, "trial_s": times, "memory": mem,
                                                    "full_logprobs_mb": full_mb}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

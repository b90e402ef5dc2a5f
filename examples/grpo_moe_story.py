"""The story numbisect exists for, on this CPU: a GRPO run, the seed's cause planted in the
rollout engine (the MoE expert weighted sum in bf16), found by the tool, and the fix.

    python examples/grpo_moe_story.py [--steps 30] [--out story-out] [--engine-dtype float32] [--threshold 1e-9] [--quick]

(about 45 minutes here: three runs of 30 steps at 18-31 s a step on 2 shared cores, then 12
minutes of replay and search on the bundle; docs/how-to/training-loop.md has the figures)

1. A copy of fixtures/models/qwen3_moe with a word-level tokenizer (as examples/trl_grpo.py),
   its config's dtype set to --dtype (the trainer's). TRL passes vLLM no dtype, and vLLM's
   "auto" runs a float32 config in bf16 on this CPU; --engine-dtype float32 hands vLLM the
   dtype (through TRL's reference to `vllm.LLM`).
2. Three runs of Hugging Face TRL's GRPOTrainer (vLLM colocate on CPU, compiled, prefix
   caching on, as TRL starts it), each in a process of its own, same seeds and prompts; the
   reward is the share of a completion's tokens whose id is under 64:
   - `aligned`: nothing planted;
   - `planted`: NUMBISECT_ENGINE_FAULT=moe_combine_bf16@layers.*.moe, every MoE block's
     weighted sum of expert outputs rounded and accumulated in bf16 (the seed's cause),
     planted while vLLM loads the model, before it compiles, for the whole run
     (numbisect.backends.vllm.enginefault);
   - `fixed`: NUMBISECT_ENGINE_FAULT=moe_combine_fp32@layers.*.moe: the fix numbisect's
     precision what-if suggests (the weighted sum in fp32), in the same code path.
   numbisect's TRL callback (numbisect.live.trl) runs in each: the weight check after each
   sync, the trigger on each batch's trainer vs vLLM log-probs (mean k3), a bundle on a fire.
   The trigger's threshold: --threshold, or 10 x the largest batch k3 of the aligned run.
3. On the planted run's bundle: `bisect replay`, `bisect run` (the search, the culprits, the
   precision what-if) and `bisect run --swap moe`, in child processes.
4. OUT/story.json: every figure; OUT/story.png: the per-step figure of the three runs
   (matplotlib), the fire marked.

`--quick`: the planted run only (--steps of it), the trigger's threshold fixed
(--threshold), then the search on its bundle (the suite's shortened version,
tests/live/test_story.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
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
FIXTURE = os.path.join(ROOT, "fixtures", "models", "qwen3_moe")
PLANTED = "moe_combine_bf16@layers.*.moe"
FIXED = "moe_combine_fp32@layers.*.moe"
LOW = 64  # the reward: the share of completion tokens with an id under this


def reward_low_ids(completions, completion_ids=None, **kwargs) -> list[float]:
    """The share of a completion's tokens whose id is under LOW (ids from TRL; the text's
    words "tN" otherwise)."""
    if completion_ids is not None:
        return [sum(1 for t in ids if t < LOW) / max(1, len(ids)) for ids in completion_ids]
    return [sum(1 for w in c.split() if w.startswith("t") and w[1:].isdigit() and int(w[1:]) < LOW) / max(1, len(c.split()))
            for c in completions]


def model_copy(dest: str, dtype: str) -> str:
    """fixtures/models/qwen3_moe with a word-level tokenizer, its config's dtype `dtype`."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from trl_grpo import with_word_tokenizer

    with_word_tokenizer(FIXTURE, dest)
    path = os.path.join(dest, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["dtype"] = dtype
    cfg.pop("torch_dtype", None)
    with open(path, "w") as f:
        json.dump(cfg, f, indent=1)
    return dest


def one_run(name: str, steps: int, out: str, dtype: str, threshold: float, engine_dtype: str | None = None,
            seed: int = 0, lr: float = 3e-3) -> dict:
    """One GRPO run in this process (its engine's faults come from NUMBISECT_ENGINE_FAULT)."""
    import functools

    import trl.generation.vllm_generation as VG
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    if engine_dtype:  # TRL 1.16 passes vLLM no dtype; vLLM's "auto" turns a float32 config into bf16 on this CPU
        VG.LLM = functools.partial(VG.LLM, dtype=engine_dtype)

    from numbisect.live.trigger import Trigger
    from numbisect.live.trl import NumbisectCallback, reload_sync

    work = tempfile.mkdtemp(prefix=f"numbisect-story-{name}-")
    try:
        model = model_copy(os.path.join(work, "model"), dtype)
        prompts = [" ".join(f"t{(37 * i + 11 * j) % 250 + 2}" for j in range(8)) for i in range(16)]
        args = GRPOConfig(output_dir=os.path.join(work, "trainer"), use_vllm=True, vllm_mode="colocate", use_cpu=True,
                          bf16=False, per_device_train_batch_size=16, num_generations=8, max_completion_length=12,
                          max_steps=steps, logging_steps=1, report_to="none", learning_rate=lr, vllm_max_model_length=64,
                          save_strategy="no", seed=seed, data_seed=seed, disable_tqdm=True, temperature=1.0)
        trainer = GRPOTrainer(model=model, reward_funcs=reward_low_ids, args=args,
                              train_dataset=Dataset.from_dict({"prompt": prompts}))
        # repack: vLLM-CPU 0.32's reload leaves MoE experts scrambled otherwise (numbisect.live.sync)
        trainer.vllm_generation.sync_weights = reload_sync(trainer.vllm_generation, repack=True)
        cb = NumbisectCallback(trainer, os.path.join(out, name), trigger=Trigger(threshold=threshold, cooldown=10_000, max_fires=1))
        trainer.add_callback(cb)
        faults = cb.probe.engine_faults()
        engine_dtype = str(cb.probe.engine.dtype).removeprefix("torch.")  # the callback closes the probe when training ends
        t0 = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - t0
    finally:
        shutil.rmtree(work, ignore_errors=True)
    fires = [{"step": b["step"] + 1, "k3": b["k3"], **(b["results"] or {})} for b in cb.batches if b["fired"]]
    return {"name": name, "engine_faults": faults, "steps": steps, "dtype": dtype, "threshold": threshold,
            "engine_dtype": engine_dtype,
            "seconds_per_step": seconds / steps, "rows": cb.rows, "fires": fires,
            "checks_ok": sum(1 for c in cb.checks if c["ok"]), "checks": len(cb.checks)}


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def child(name: str, fault: str | None, a, threshold: float) -> dict:
    """`one_run` in a fresh process, the fault in its environment only."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("NUMBISECT_ENGINE_FAULT", None)
    env["MASTER_PORT"] = str(free_port())  # TRL's engine sets up torch.distributed: not the default 29500 another job holds
    if fault:
        env["NUMBISECT_ENGINE_FAULT"] = fault
    res = os.path.join(a.out, f"{name}.json")
    if a.resume and os.path.exists(res):  # a finished run of an earlier call, same --out
        with open(res) as f:
            done = json.load(f)
        if done["steps"] == a.steps and done["threshold"] == threshold:
            print(f"[{time.strftime('%H:%M:%S')}] run {name}: reused {res}", flush=True)
            return done
    cmd = [sys.executable, os.path.abspath(__file__), "--one", name, "--steps", str(a.steps), "--out", a.out,
           "--dtype", a.dtype, "--threshold", repr(threshold), "--result", res,
           *(["--engine-dtype", a.engine_dtype] if a.engine_dtype != "auto" else [])]
    print(f"[{time.strftime('%H:%M:%S')}] run {name}: {fault or 'nothing planted'}", flush=True)
    with open(os.path.join(a.out, f"{name}.log"), "w") as log:
        subprocess.run(cmd, env=env, check=True, stdout=log, stderr=subprocess.STDOUT)
    with open(res) as f:
        return json.load(f)


def bisect(args: list[str], out: str, name: str) -> dict:
    """`bisect ARGS` in a child process; its exit code, seconds, and the last lines it printed."""
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("NUMBISECT_ENGINE_FAULT", None)
    p = subprocess.run([sys.executable, "-m", "numbisect", *args], env=env, capture_output=True, text=True, cwd=ROOT)
    with open(os.path.join(out, f"{name}.log"), "w") as f:
        f.write(p.stdout + p.stderr)
    return {"argv": ["bisect", *args], "rc": p.returncode, "seconds": time.perf_counter() - t0,
            "tail": (p.stdout + p.stderr).strip().splitlines()[-12:]}


def find(bundle: str, out: str, quick: bool = False) -> dict:
    """The tool on the planted run's bundle: replay, the search with the what-ifs, the MoE
    swapped (`quick`: the search only)."""
    with open(os.path.join(bundle, "manifest.json")) as f:
        m = json.load(f)
    faults = m["engine"].get("faults") or []
    # the bundle's sides in their own dtypes, judged at the trigger's threshold, the live engine's faults planted per trial
    side = ["--ref", f"hf:{bundle}/reference", "--engine", f"vllm:{bundle}/engine", "--trace", f"{bundle}/trace.jsonl",
            "--ref-dtype", m["reference"]["dtype"], "--engine-dtype", m["engine"]["dtype"],
            "--threshold", repr(m["fire"]["threshold"]), *[x for s in faults for x in ("--engine-fault", s)], "-q"]
    found = {"bundle_faults": faults}
    steps = ("run",) if quick else ("replay", "run", "swap_moe")
    if "replay" in steps:
        found["replay"] = bisect(["replay", bundle, "--out", os.path.join(out, "replay.json"), "-q"], out, "replay")
    found["run"] = bisect(["run", *side, "--out", os.path.join(out, "run.json")], out, "run")
    if "swap_moe" in steps:
        found["swap_moe"] = bisect(["run", *side, "--swap", "moe", "--out", os.path.join(out, "swap_moe.json")], out, "swap_moe")
    for k in steps:
        p = os.path.join(out, f"{k}.json")
        if os.path.exists(p):
            with open(p) as f:
                r = json.load(f)
            found[k]["k3"] = r["baseline"]["groups"]["completion"]["k3"]["mean"]
            found[k]["verdict"] = r["verdict"]
            found[k]["culprits"] = [(c.get("unit"), c.get("kind")) for c in r.get("culprits") or [] if isinstance(c, dict)]
            found[k]["systematic"] = (r.get("search") or {}).get("systematic")
            found[k]["trials"] = [(t.get("role"), t.get("value")) for t in r.get("trials") or []]
            found[k]["precision"] = [c.get("precision", {}).get("suggested") for c in r.get("culprits") or [] if isinstance(c, dict)]
    return found


def plot(story: dict, path: str) -> None:
    """The per-step figure: reward, TRL's mismatch, the batch k3 (the threshold, the fire) and
    TRL's IS ratio (the share it masked in the panel's title), per run."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    runs = [r for r in (story.get("aligned"), story.get("planted"), story.get("fixed")) if r]
    colors = {"aligned": "tab:green", "planted": "tab:red", "fixed": "tab:blue"}
    panels = [("reward", "reward (share of ids < 64)", "linear"), ("mismatch", "TRL mismatch |logp diff| (mean)", "log"),
              ("k3", "trigger: batch k3 (trainer vs vLLM)", "log"), ("is_ratio", "TRL importance-sampling ratio (mean)", "linear")]
    masked = max((row.get("masked") or 0) for r in runs for row in r["rows"])
    fig = Figure(figsize=(10, 7.5), layout="constrained")
    axes = fig.subplots(2, 2).flatten()
    for ax, (key, label, scale) in zip(axes, panels):
        for r in runs:
            xs = [row["step"] for row in r["rows"] if row.get(key) is not None]
            ys = [row[key] for row in r["rows"] if row.get(key) is not None]
            ax.plot(xs, ys, marker="o", ms=3, lw=1.2, color=colors[r["name"]], label=f"{r['name']}"
                    + (f" ({', '.join(sorted({f.split('@')[0] for f in r['engine_faults']}))})" if r["engine_faults"] else ""))
        if key == "k3" and story.get("planted"):
            ax.axhline(story["planted"]["threshold"], color="black", ls=":", label=f"threshold {story['planted']['threshold']:.2g}")
            for f in story["planted"]["fires"]:
                ax.plot([f["step"]], [f["k3"]], marker="*", ms=16, color="tab:red", ls="none", label=f"fire (step {f['step']})")
        if key == "is_ratio":
            ax.set_title(f"share of samples TRL's IS correction masked: at most {masked:.0%} in any batch", fontsize=8)
        ax.set_yscale(scale)
        ax.set_xlabel("GRPO step")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    eng = (story.get("planted") or {}).get("engine_dtype", "?")
    fig.suptitle(f"TRL GRPO on the qwen3_moe fixture (trainer {story['dtype']}, vLLM-CPU {eng}, colocate): "
                 "the MoE weighted sum in bf16 planted, and the fp32 fix", fontsize=10)
    fig.savefig(path, dpi=72)


def table(story: dict) -> str:
    runs = [r for r in (story.get("aligned"), story.get("planted"), story.get("fixed")) if r]
    head = "step | " + " | ".join(f"{r['name']}: reward, mismatch, k3, masked" for r in runs)
    lines = [head]
    n = max(len(r["rows"]) for r in runs)
    for i in range(n):
        cells = []
        for r in runs:
            row = r["rows"][i] if i < len(r["rows"]) else {}
            cells.append(", ".join("-" if row.get(k) is None else f"{row[k]:.3g}" for k in ("reward", "mismatch", "k3", "masked"))
                         + (" FIRED" if row.get("fired") else ""))
        lines.append(f"{i + 1} | " + " | ".join(cells))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default="story-out")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the trainer's dtype (the model copy's config)")
    ap.add_argument("--engine-dtype", default="float32", choices=["float32", "bfloat16", "auto"],
                    help="vLLM's dtype; auto: TRL's own (it passes none: vLLM's auto, bfloat16 on this CPU, where the planted "
                         "bf16 sum sits under the bf16 noise floor of this model)")
    ap.add_argument("--threshold", type=float, default=1e-9,
                    help="the trigger's threshold on the batch's mean k3 (0: 10 x the aligned run's largest batch k3)")
    ap.add_argument("--quick", action="store_true", help="the suite's version: a few steps, planted run only")
    ap.add_argument("--resume", action="store_true", help="reuse the runs already finished under --out (same steps, threshold)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    if a.one:  # a child: one run
        res = one_run(a.one, a.steps, a.out, a.dtype, a.threshold, None if a.engine_dtype == "auto" else a.engine_dtype)
        with open(a.result, "w") as f:
            json.dump(res, f, indent=1)
        return 0
    story: dict = {"dtype": a.dtype, "engine_dtype": a.engine_dtype, "steps": a.steps, "machine": "Intel Xeon (AMX), 2 shared cores, vLLM-CPU 0.32"}
    if a.quick:
        story["planted"] = child("planted", PLANTED, a, a.threshold or 1e-9)
        fires = story["planted"]["fires"]
        if fires and fires[0].get("bundle"):
            story["found"] = find(fires[0]["bundle"], a.out, quick=True)
    else:
        story["aligned"] = child("aligned", None, a, 1e9)  # never fires: the aligned run only measures
        top = max(r["k3"] for r in story["aligned"]["rows"] if r.get("k3") is not None)
        thr = a.threshold if a.threshold else 10 * top
        story["planted"] = child("planted", PLANTED, a, thr)
        fires = story["planted"]["fires"]
        if fires and fires[0].get("bundle"):
            print(f"[{time.strftime('%H:%M:%S')}] the tool on the bundle {fires[0]['bundle']}", flush=True)
            story["found"] = find(fires[0]["bundle"], a.out)
        story["fixed"] = child("fixed", FIXED, a, thr)
        plot(story, os.path.join(a.out, "story.png"))
    with open(os.path.join(a.out, "story.json"), "w") as f:
        json.dump(story, f, indent=1)
    if not a.quick:
        print(table(story))
    for r in [story.get(k) for k in ("aligned", "planted", "fixed")]:
        if r:
            print(f"{r['name']}: {r['seconds_per_step']:.1f} s/step, faults {r['engine_faults'] or 'none'}, fires {r['fires'] or 'none'}")
    for k, v in (story.get("found") or {}).items():
        if isinstance(v, dict):
            print(f"{k}: rc {v['rc']}, {v['seconds']:.0f} s, k3 {v.get('k3')}, culprits {v.get('culprits')}, systematic {v.get('systematic')}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    raise SystemExit(main())

"""The cold engine of the warm-vs-cold oracle (numbisect.live.cold): the same weights
loaded cold by numbisect's eager vLLM engine in a child process, and the digests both
sides answer.

- `load_cold(job, timeout)` (in the parent): runs `python -P -m numbisect.backends.vllm.cold
  IN OUT` through numbisect.backends.vllm.child's `run_child` (a second engine in the
  trainer's process would share vLLM's global state and its thread settings with the
  user's engine); its answer, a dict.
- `cold_job` (in the child, `main` is its `serve`): the engine on the written checkpoint
  directory, in the live engine's dtype, max_model_len and tensor-parallel size; per
  tensor, the digest of each engine tensor read back in the checkpoint's names
  (numbisect.backends.vllm.readback) and of each parameter's bytes as the engine holds them
  (`raw_digests`: prepacked, by vLLM's name; no layout knowledge), and, fed the
  reference's unit inputs on a few samples, every unit's local output.
- What the warm engine answers the same way, in its workers (`rank_raw_digests`,
  `param_names`) and put together here (`merge_raw`, `rank_names`).
"""

from __future__ import annotations

import functools
import json
import sys
import time

import torch

from numbisect.backends.vllm import VLLMBackend
from numbisect.backends.vllm import readback as RB
from numbisect.backends.vllm.child import run_child, serve
from numbisect.backends.vllm.tp import VLLMTPBackend
from numbisect.model.ckptdiff import tensor_digest
from numbisect.model.trace import Sample

MODULE = "numbisect.backends.vllm.cold"  # the child's main (`python -P -m MODULE IN OUT`)


def raw_digests(model) -> dict[str, str]:
    """Each non-empty float parameter's bytes as the engine holds them (a kernel's layout,
    not read back), by vLLM's name. Runs where the model lives (`apply_model`)."""
    return {n: tensor_digest(p.data) for n, p in model.named_parameters() if p.is_floating_point() and p.numel()}


def rank_raw_digests(model) -> str:
    """Run in each of an engine's workers: its rank, the world size and `raw_digests`, as
    JSON (what crosses vLLM's engine-core boundary intact)."""
    try:
        rank, world = RB._rank(model)
    except (AssertionError, RuntimeError):  # no distributed state: one process, one rank
        rank, world = 0, 1
    return json.dumps({"rank": rank, "world": world, "digests": raw_digests(model)})


def merge_raw(answers: list[str]) -> dict[str, str]:
    """Every worker's `rank_raw_digests` in one table: by vLLM's name on one rank; with
    several, `name@rank` (each rank holds its own shard, in its kernel's layout: compared
    with the same rank's of an engine loaded cold at the same tensor-parallel size)."""
    ranks = [json.loads(a) for a in answers]
    if len(ranks) == 1 and ranks[0]["world"] == 1:
        return ranks[0]["digests"]
    return {f"{n}@{r['rank']}": d for r in ranks for n, d in r["digests"].items()}


def rank_names(raw: dict[str, str], names: dict[str, list[str]]) -> dict[str, list[str]]:
    """`param_names` (by vLLM's name) for the keys of `merge_raw`'s table (`name@rank`)."""
    return {k: names.get(k.partition("@")[0], [k.partition("@")[0]]) for k in raw}


def warm_raw(llm, shapes: dict[str, tuple]) -> tuple[dict[str, str], dict[str, list[str]]]:
    """A running engine's parameters as the cold engine answers for its own: `merge_raw` of
    every worker's `rank_raw_digests`, and the checkpoint names each holds (`rank_names`)."""
    raw = merge_raw(llm.apply_model(rank_raw_digests))
    return raw, rank_names(raw, llm.apply_model(functools.partial(param_names, shapes=shapes))[0])


def param_names(model, shapes: dict[str, tuple]) -> dict[str, list[str]]:
    """vLLM parameter -> the checkpoint names it holds (`engine_tensors`' split), where the
    model lives."""
    out = {}
    for pname, p in model.named_parameters():
        if p.is_floating_point() and p.numel():
            out[pname] = [n for n, _ in RB._split(pname, p.data, shapes)]
    return out


def load_cold(job: dict, timeout: float | None = None) -> dict:
    """In the parent: `job` (the checkpoint directory, dtype, max_model_len,
    tensor_parallel_size, shapes; feed, samples and units for the local outputs) run by the
    cold engine in a child process; its answer (`cold_job`'s, with `seconds`)."""
    return run_child({**job, "job": "cold", "answer": "torch"}, "the cold engine", timeout=timeout, module=MODULE)


# -- the child process ---------------------------------------------------------------------------
def cold_job(job: dict) -> dict:
    """In the child: numbisect's eager engine on the written directory, at the live engine's
    tensor-parallel size (a rank's bytes compare with the same rank's only); the digests of
    its tensors read back (every rank's put together) and of its parameters' bytes (each
    rank's), and its units' local outputs when fed."""
    tp = int(job.get("tensor_parallel_size") or 1)
    if tp > 1:
        eng = VLLMTPBackend(job["model"], job["dtype"], tensor_parallel_size=tp, max_model_len=int(job["max_model_len"]))
    else:
        eng = VLLMBackend(job["model"], job["dtype"], max_model_len=int(job["max_model_len"]))
    try:
        shapes = {n: tuple(s) for n, s in job["shapes"].items()}
        if tp > 1:
            digests = RB.reader_digests(RB.unit_reader(shapes, eng.arch, eng.config, llm=eng.llm))
            raw = merge_raw(eng.llm.apply_model(rank_raw_digests))
        else:
            digests = RB.reader_digests(RB.unit_reader(shapes, eng.arch, eng.config, model=eng.model))
            raw = raw_digests(eng.model)
        captures = None
        if job.get("feed"):
            samples = [Sample(line=i + 1, prompt_ids=list(ids[:p]), completion_ids=list(ids[p:]))
                       for i, (ids, p) in enumerate(job["samples"])]
            feed = torch.load(job["feed"])
            captures = eng.forward(samples, capture=job["units"], feed=feed).captures
        return {"digests": digests, "raw": raw, "captures": captures}
    finally:
        eng.close()


def answer(job: dict, out_path: str) -> None:
    """The child's answer (`child.serve`): `cold_job`'s, timed, as a torch file."""
    t0 = time.perf_counter()
    out = cold_job(job)
    out["seconds"] = time.perf_counter() - t0
    torch.save(out, out_path)


def main(argv: list[str]) -> int:
    return serve(argv, answer)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

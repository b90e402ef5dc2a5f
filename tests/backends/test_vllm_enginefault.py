"""NUMBISECT_ENGINE_FAULT (numbisect.backends.vllm.enginefault): a fault planted in a vLLM
engine for its life, through numbisect's vLLM plugin, before the engine compiles.

On the shared qwen3_moe engine: the plugin wrapped vLLM's model loader when the engine
started; `plant` with a `*` pattern plants the fault in every MoE block, the engine's
log-probs move, `take_out` puts them back bit for bit. Bad specs are one line. (The
compiled, prefix-cached engine TRL starts is exercised by tests/live/test_story.py.)"""

from __future__ import annotations

import pytest
import torch
from conftest import trace_path, vllm

from numbisect.backends.vllm import enginefault as EF
from numbisect.common.errors import InputError
from numbisect.model.trace import load_trace

pytestmark = pytest.mark.vllm


def test_env_specs_reads_commas_semicolons_and_spaces():
    env = {EF.ENV: " moe_combine_bf16@layers.*.moe; output_noise=1@layers.2.moe.experts,,"}
    assert EF.env_specs(env) == ["moe_combine_bf16@layers.*.moe", "output_noise=1@layers.2.moe.experts"]
    assert EF.env_specs({}) == []
    assert EF.env_value(["a@x", "b@y"]) == "a@x,b@y"


def test_planted_for_the_engines_life_and_taken_out_bit_for_bit():
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    eng = vllm("qwen3_moe")
    # the plugin (entry point numbisect_compat) wrapped the loader when vLLM started
    assert getattr(BaseModelLoader.load_model, "_numbisect_engine_fault_wrapper", False)
    assert EF.install() is False  # once per process
    ss = load_trace(trace_path("qwen3_moe")).samples[:4]
    before = eng.forward(ss).token_logprobs
    try:
        done = EF.plant(eng.model, "bfloat16", ["moe_combine_fp8@layers.*.moe"])
        assert done == [f"moe_combine_fp8@layers.{i}.moe" for i in range(4)]
        assert EF.planted(eng.model) == done
        planted = eng.forward(ss).token_logprobs
        assert any(not torch.equal(torch.as_tensor(a), torch.as_tensor(b)) for a, b in zip(before, planted))
    finally:
        assert EF.take_out(eng.model) == [f"moe_combine_fp8@layers.{i}.moe" for i in range(4)]
    assert EF.planted(eng.model) == [] and EF.take_out(eng.model) == []
    after = eng.forward(ss).token_logprobs
    assert all(torch.equal(torch.as_tensor(a), torch.as_tensor(b)) for a, b in zip(before, after))


@pytest.mark.parametrize("spec,msg", [("moe_combine_bf16@layers.*.nope", "matches no unit"),
                                      ("moe_combine_bf9@layers.*.moe", "dtype must be one of"),
                                      ("moe_combine_bf16@layers.*.attn", "applies to units of kind")])
def test_a_bad_spec_is_one_line_and_plants_nothing(spec, msg):
    eng = vllm("qwen3_moe")
    with pytest.raises(InputError, match=msg):
        EF.plant(eng.model, "bfloat16", [spec])
    assert EF.planted(eng.model) == []

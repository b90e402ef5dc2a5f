"""A swap described by data is rebuilt where the engine's model lives (as `apply_model` does)."""

from __future__ import annotations

import functools
import pickle

import pytest
import torch
from conftest import hf, model_dir, trace_path, vllm

from numbisect.backends.vllm.model import apply_swap_spec, undo_swap_spec
from numbisect.model.trace import load_trace
from numbisect.patching.ledger import Ledger
from numbisect.patching.swap import SwapSpec, apply_swaps


@pytest.mark.vllm
def test_swap_spec_rebuilt_through_apply_model_equals_the_direct_swap():
    eng, ref = vllm("qwen3_moe"), hf("qwen3_moe")
    ss = load_trace(trace_path("qwen3_moe")).samples[:4]
    spec = SwapSpec(units=("layers.1.moe", "layers.2.attn", "final_norm"), donor_path=model_dir("qwen3_moe"), donor_dtype="bfloat16")
    fn = functools.partial(apply_swap_spec, spec=spec, engine_dtype="bfloat16")
    pickle.loads(pickle.dumps(fn))  # what vLLM sends to its workers must pickle

    base = eng.forward(ss).token_logprobs
    try:
        assert eng.llm.apply_model(fn) == [list(spec.units)]
        rebuilt = eng.forward(ss).token_logprobs
    finally:
        eng.llm.apply_model(undo_swap_spec)
    with Ledger() as ledger:  # undone on the way out
        apply_swaps(eng, ref, list(spec.units), ledger)
        direct = eng.forward(ss).token_logprobs
    for a, b in zip(rebuilt, direct):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(rebuilt, base))  # the swap did something
    for a, b in zip(eng.forward(ss).token_logprobs, base):  # and was undone
        assert torch.equal(a, b)

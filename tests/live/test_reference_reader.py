"""The weight check's reference side, streamed (numbisect.live.weights.ReferenceReader):
each layer reverted to checkpoint names on its own gives what reverting the whole model
gives (transformers' weight conversion never mixes layers), so the check needs one
layer's conversion copies at a time. No engine."""

from __future__ import annotations

import pytest
import torch
from conftest import model_dir


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3", "qwen3_5_moe"])
def test_the_reference_read_layer_by_layer_is_the_whole_models(family):
    from transformers import AutoModelForCausalLM

    from numbisect.live import weights as W

    model = AutoModelForCausalLM.from_pretrained(model_dir(family), dtype=torch.float32)
    whole = W.reference_tensors(model)
    reader = W.ReferenceReader(model)
    layers = list(reader.layers())
    assert len(layers) == model.config.get_text_config().num_hidden_layers + 1  # and the tensors outside the layers
    seen = {n: t for _, ts in layers for n, t in ts.items()}
    assert set(seen) == set(whole) and all(torch.equal(seen[n], whole[n]) for n in whole)
    assert reader.shapes == {n: tuple(t.shape) for n, t in whole.items()}
    assert reader.digests(torch.bfloat16) == W.reference_digests(whole, torch.bfloat16)
    name = next(n for n in whole if ".layers.1." in n)
    assert torch.equal(reader.in_dtype(torch.bfloat16).tensor(name), whole[name].to(torch.bfloat16))

"""`numbisect.live.weights.check` on tensors alone (no engine): the functional judgment of a
MoE block whose router sent a few tokens to other experts when fed the reference's input."""

from __future__ import annotations

import pytest
from conftest import model_dir


@pytest.mark.parametrize("flips, status", [
    (None, "buffer differs"),  # no routing to explain it: the weights read back right, the unit computes otherwise
    ({"layers.2.moe": (1, 48)}, "ok"),  # one near-tie of 48 tokens (measured on this fixture after a correct sync)
    ({"layers.2.moe": (10, 48)}, "buffer differs"),  # more than FLIP_FRAC: not near-ties
    ({"layers.1.moe": (1, 48)}, "buffer differs"),  # another layer's flips explain nothing here
])
def test_a_moe_block_whose_router_flipped_a_few_tokens_is_not_a_buffer_that_differs(flips, status):
    import torch
    from transformers import AutoModelForCausalLM

    from numbisect.live import weights as W
    from numbisect.model.arch import arch_for

    model = AutoModelForCausalLM.from_pretrained(model_dir("qwen3_moe"), dtype=torch.bfloat16)
    config = model.config
    engine = [("whole model", W.reference_tensors(model))]  # an engine holding the reference's weights
    local = {"layers.2.moe": 0.073, "layers.2.moe.experts": 0.073, "layers.2.attn": 0.004}
    check = W.check(W.ReferenceReader(model), engine, W.History(), arch_for(config), config, dtype=torch.bfloat16,
                    step="check", local=local, flips=flips)
    assert check.status("layers.2.moe.experts") == status
    if status == "ok":
        assert check and "1 of 48 tokens routed to other experts" in next(
            u.summary for u in check.units if u.unit == "layers.2.moe.experts")
    else:
        assert {u.unit for u in check.differing()} == {"layers.2.moe", "layers.2.moe.experts"}

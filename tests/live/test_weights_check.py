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


def _check(name, ref_dtype, edit, dtype="bfloat16", local=None, from_checkpoint=False):
    """`check` of an engine holding the reference's tensors (or the checkpoint's, in the
    engine's dtype), `edit(name, tensor)` applied to each."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from numbisect.live import weights as W
    from numbisect.model.arch import arch_for

    model = AutoModelForCausalLM.from_pretrained(model_dir(name), dtype=getattr(torch, ref_dtype))
    config, dt = model.config, getattr(torch, dtype)
    src = load_file(f"{model_dir(name)}/model.safetensors") if from_checkpoint else W.reference_tensors(model)
    engine = [("whole model", {n: edit(n, t).to(dt) for n, t in src.items()})]
    return W.check(W.ReferenceReader(model), engine, W.History(), arch_for(config), config, dtype=dt, step="check",
                   local=local)


def summaries(check) -> dict:
    return {u.unit: (u.status, u.summary) for u in check.differing()}


def test_a_float16_trainer_against_its_own_checkpoint_is_ok():
    """The engine rounds the bf16 checkpoint once, the float16 reference twice: 86 of 722,560
    values differ by the reference's own precision (9 units 'corrupted' before #36)."""
    check = _check("qwen3", "float16", lambda n, t: t, from_checkpoint=True)
    assert check.ok, check.lines()


def test_a_sync_through_float16_is_named_rounding_not_a_layer_shift():
    import torch

    check = _check("qwen3", "float32", lambda n, t: t.to(torch.float16))
    got = summaries(check)
    assert got and all(s == "corrupted" and "rounded through float16" in text for s, text in got.values()), got
    assert not any("shifted" in text for _, text in got.values())


def test_stale_norm_weights_are_changed_values_not_a_layer_shift():
    """Every norm holding an earlier step's values (a step no check saw): each element's value
    occurs in some other layer's norm (bf16 weights near 1 take few values), which read as 'a
    layer index shifted' before #36; only a whole vector found in another layer does now."""
    import torch

    g = torch.Generator().manual_seed(0)

    def stale(n, t):
        return t + 0.02 * torch.randn(t.shape, generator=g) if n.endswith("norm.weight") else t

    got = summaries(_check("qwen3", "float32", stale))
    norms = {u: v for u, v in got.items() if "norm" in u}
    assert len(norms) >= 8, got
    assert not any("shifted" in text for _, text in got.values()), got
    assert all("changed" in text for _, text in norms.values()), norms


def test_a_whole_norm_vector_from_another_layer_is_still_named_as_such():
    """The 1-D rule (#36) keeps what a shifted norm is: its whole vector is another layer's."""
    import torch
    from transformers import AutoModelForCausalLM

    from numbisect.live import weights as W
    from numbisect.model.arch import arch_for

    model = AutoModelForCausalLM.from_pretrained(model_dir("qwen3"), dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # distinct norms per layer (the fixture's are all ones)
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
    ref = W.reference_tensors(model)
    eng = {n: t.to(torch.bfloat16) for n, t in ref.items()}
    eng["model.layers.2.input_layernorm.weight"] = eng["model.layers.1.input_layernorm.weight"]
    config = model.config
    check = W.check(W.ReferenceReader(model), [("m", eng)], W.History(), arch_for(config), config, dtype=torch.bfloat16,
                    step="check")
    got = summaries(check)
    assert list(got) == ["layers.2.input_norm"], got
    assert "layers.1" in got["layers.2.input_norm"][1] and "changed" not in got["layers.2.input_norm"][1], got


def test_inf_and_nan_are_named():
    def poison(n, t):
        if n == "model.layers.1.mlp.up_proj.weight":
            t = t.clone()
            t[0, :3] = float("inf")
            t[1, 0] = float("nan")
        return t

    got = summaries(_check("qwen3", "float32", poison))
    assert got.keys() == {"layers.1.mlp"}
    assert "holds 3 inf and 1 NaN" in got["layers.1.mlp"][1], got


def test_a_wrong_router_does_not_mark_its_experts():
    """The experts read back right; their local error follows from the router's weights."""
    local = {"layers.2.moe": 0.4, "layers.2.moe.experts": 0.3, "layers.2.moe.router": 0.5, "layers.2.attn": 0.004}
    check = _check("qwen3_moe", "bfloat16", lambda n, t: -t if n.endswith("layers.2.mlp.gate.weight") else t, local=local)
    got = summaries(check)
    assert got.get("layers.2.moe.router", ("",))[0] == "corrupted", got
    assert "layers.2.moe.experts" not in got, got

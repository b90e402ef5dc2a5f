"""Module-call helpers every change to a live model uses: find a module, read and replace a
call's hidden-states argument, carry a decoder layer's flags to its stand-in, plant weight
noise (the backends and the engine-neutral changes share them)."""

from __future__ import annotations

import torch
from torch import nn

from numbisect.patching.ledger import Ledger
from numbisect.patching.torchops import seeded


def get_module(root: nn.Module, path: str) -> nn.Module:
    return root.get_submodule(path)


def hidden_arg(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The hidden-states input of a module call: first positional tensor or `hidden_states`."""
    if "hidden_states" in kwargs:
        return kwargs["hidden_states"]
    for a in args:
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return a
    return None


def plant_weight_noise(mod: nn.Module, fault, ledger: Ledger) -> None:
    """`weight_noise`: every float parameter of `mod` times (1 + value * N(0, 1)), seeded by the unit."""
    g = seeded(fault.unit)
    for p in mod.parameters():
        if p.is_floating_point() and p.numel():
            ledger.save(p)
            p.data.mul_(1 + fault.value * torch.randn(p.shape, generator=g))


# Attributes a model reads from its decoder layers on every forward (vLLM's Qwen3-Next and
# Qwen3.5 model: `layers[0].use_attn_reduce_scatter_for_moe`): a stand-in for a layer (a
# swap adapter, a prefix-reuse replay) carries the replaced layer's.
LAYER_FLAGS = ("use_attn_reduce_scatter_for_moe",)


def carry_layer_flags(new: nn.Module, old: nn.Module) -> None:
    """Give `new` the `LAYER_FLAGS` that `old`, the layer it stands in for, has."""
    for flag in LAYER_FLAGS:
        if hasattr(old, flag):
            setattr(new, flag, getattr(old, flag))


def with_hidden(args: tuple, kwargs: dict, x: torch.Tensor, new: torch.Tensor) -> tuple[tuple, dict]:
    """(args, kwargs) of a module call with its hidden-states input `x` (as `hidden_arg`
    found it) replaced by `new`."""
    if "hidden_states" in kwargs:
        return args, {**kwargs, "hidden_states": new}
    i = next(i for i, a in enumerate(args) if a is x)
    return args[:i] + (new,) + args[i + 1 :], kwargs

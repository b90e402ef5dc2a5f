"""Gated DeltaNet's conv and gates on vLLM-CPU: a module each, for the `conv` and `gates` units.

vLLM's QwenGatedDeltaNetAttention (Qwen3.5, Qwen3-Next) hands its projections to one custom
op, `cpu_gdn_attention_core`, whose Python body (vllm/model_executor/layers/mamba/ops/cpu/
gdn_attention.py) runs the causal conv (`_causal_conv1d_fwd_cpu`, or `causal_conv1d_torch`
on a CPU without a bf16 conv kernel), the gates (`ops.fused_gdn_gating_cpu`: g and beta from
a, b, `A_log`, `dt_bias`) and the chunked delta rule. In the eager engine numbisect hooks, that
body runs in Python inside the attention's forward, so `install` replaces those names in
that file (once, for the process) by routers that send the running attention's calls to two
modules it gives each such attention:

- `conv` (`ConvUnit`): `[tokens, channels] -> [tokens, channels]` (q, k, v, after the
  activation), the engine's own conv call (`call`: the function and its other arguments:
  conv-state cache, slots, the packed weight flag);
- `gates` (`GatesUnit`): `[tokens, 2 * heads]` (a, then b) -> `[tokens, 2 * heads]` (g, then
  beta) in float32, the engine's own gating kernel on the attention's `A_log`/`dt_bias`.

Only prefill calls are routed (a decode step fuses the gates into its recurrent kernel and
updates the conv in place: no such calls to route). A call outside a routed attention runs
as it was. Results are the engine's, bit for bit: the same kernels on the same tensors.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

from numbisect.backends.base import get_module
from numbisect.patching.torchops import route_names

FILE = "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention"
CONV_FNS = ("_causal_conv1d_fwd_cpu", "causal_conv1d_torch")  # the bf16 kernel's path, the torch one
GATING = "fused_gdn_gating_cpu"
_ACTIVE: list[nn.Module] = []  # routed attentions in their forward, innermost last


class ConvUnit(nn.Module):
    """`layers.{i}.attn.conv` on vLLM: the engine's conv call on [tokens, channels]. Its
    weight (packed for the CPU kernel where vLLM packs it) is registered here as well, so a
    weight noise reaches it."""

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight

    def forward(self, x, call):
        fn, kwargs = call
        return fn(x=x.transpose(0, 1), **kwargs).transpose(0, 1)


class GatesUnit(nn.Module):
    """`layers.{i}.attn.gates` on vLLM: the engine's gating kernel, (a, b) -> (g, beta)."""

    def __init__(self, A_log: nn.Parameter, dt_bias: nn.Parameter):
        super().__init__()
        self.A_log = A_log
        self.dt_bias = dt_bias

    def forward(self, ab, call):
        fn, _ = call
        a, b = ab.chunk(2, dim=-1)
        g, beta = fn(A_log=self.A_log, a=a.contiguous(), b=b.contiguous(), dt_bias=self.dt_bias)
        return torch.cat([g.reshape(a.shape).float(), beta.reshape(b.shape).float()], dim=-1)


def _running(attr: str):
    m = _ACTIVE[-1] if _ACTIVE else None
    unit = getattr(m, attr, None)
    return unit if isinstance(unit, nn.Module) else None


def _conv_router(original):
    def conv(*, x, **kwargs):
        unit = _running("conv")
        if unit is None:
            return original(x=x, **kwargs)
        return unit(x.transpose(0, 1), (original, kwargs)).transpose(0, 1)

    return conv


class _Ops:
    """vLLM's `_custom_ops` as the GDN file sees it, its gating kernel routed."""

    def __init__(self, ops):
        self._ops = ops

    def __getattr__(self, name):
        return getattr(self._ops, name)

    def fused_gdn_gating_cpu(self, *, A_log, a, b, dt_bias):
        unit = _running("gates")
        fn = self._ops.fused_gdn_gating_cpu
        if unit is None:
            return fn(A_log=A_log, a=a, b=b, dt_bias=dt_bias)
        out = unit(torch.cat([a, b.to(a.dtype)], dim=-1), (fn, None))
        heads = out.shape[-1] // 2
        return out[..., :heads].contiguous()[None], out[..., heads:].to(b.dtype).contiguous()[None]


def _route() -> None:
    mod = importlib.import_module(FILE)
    route_names(mod, {name: _conv_router for name in CONV_FNS})
    if not isinstance(mod.ops, _Ops):
        mod.ops = _Ops(mod.ops)


def _enter(m, args, kwargs):
    _ACTIVE.append(m)


def _leave(m, args, out):
    _ACTIVE.pop()


def install(model: nn.Module, arch, units) -> None:
    """A `conv` and a `gates` module in each Gated DeltaNet attention with those units, and
    the routing to them (once: a second call changes nothing)."""
    parents = {u.parent: u for u in units if u.kind in ("conv", "gates")}
    by_name = {u.name: u for u in units}
    for parent in parents:
        try:
            attn = get_module(model, arch.path("vllm", by_name[parent]))
        except AttributeError:
            continue  # hookpoints names the missing attention
        if isinstance(getattr(attn, "gates", None), GatesUnit) or not hasattr(attn, "A_log"):
            continue  # done before, or not vLLM's GDN (hookpoints names what is missing)
        _route()
        attn.conv = ConvUnit(attn.conv1d.weight)
        attn.gates = GatesUnit(attn.A_log, attn.dt_bias)
        attn.register_forward_pre_hook(_enter, with_kwargs=True)
        attn.register_forward_hook(_leave, always_call=True)

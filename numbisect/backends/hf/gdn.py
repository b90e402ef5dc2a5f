"""Gated DeltaNet's conv and gates on a transformers engine: a module each, for the `conv`
and `gates` units.

transformers' Gated DeltaNet modules (Qwen3.5-MoE's `Qwen3_5MoeGatedDeltaNet`, Qwen3-Next's
`Qwen3NextGatedDeltaNet`) compute both without a module call of their own: the causal
depthwise conv is the modeling file's function `causal_conv1d_fn` on `conv1d.weight`, and
the gates are inline, `beta = b.sigmoid()` and `g = -A_log.float().exp() * softplus(a.float()
+ dt_bias)`, handed to `torch_chunk_gated_delta_rule`. `install` gives each such module two
submodules and routes its own calls to them:

- `conv` (`GdnConv`): the modeling file's own `causal_conv1d_fn` on `conv1d` (a child, the
  same module the attention holds), `[batch, tokens, channels] -> [batch, tokens, channels]`
  after the activation; channels are q, k, v as the attention splits them. The name
  `causal_conv1d_fn` in the modeling file is replaced by a router (once per file, for the
  process) that sends the running attention's call to its `conv`.
- `gates` (`GdnGates`): the same two lines on the attention's own `A_log` and `dt_bias`,
  `[batch, tokens, 2 * heads]` (a, then b) -> `[batch, tokens, 2 * heads]` (g, then beta),
  float32. `a` and `b` are read where the attention makes them (Qwen3.5: the outputs of
  `in_proj_a`/`in_proj_b`; Qwen3-Next: what `fix_query_key_value_ordering` returns), and the
  router in `torch_chunk_gated_delta_rule`'s name hands the rule `gates`' g and beta (beta
  in the dtype the attention's own had).

"Running" is kept by a forward pre-hook and an always-called forward hook on each
attention; the hooks and the readers are module-level functions and keep what they read
on the module itself, so a deep copy (a float32 donor's) routes to its own. Results are
transformers', bit for bit (the same function, the same arithmetic on the same values).
A decode step with a cache runs `causal_conv1d_update` and `torch_recurrent_gated_delta_rule`,
which are not routed: the units are prefill units, as on vLLM-CPU (whose decode step fuses
the gates into its recurrent kernel).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from numbisect.common.errors import BackendError
from numbisect.patching.torchops import ROUTED, route_names

CONV_FN = "causal_conv1d_fn"
RULE_FN = "torch_chunk_gated_delta_rule"
_ACTIVE: list[nn.Module] = []  # Gated DeltaNet modules in their forward, innermost last
_AB = "_numbisect_ab"  # (a, b) of the attention's current forward, as it computed them
_OUT = "_numbisect_out"  # an `in_proj_a` / `in_proj_b` output, kept on that module


class GdnConv(nn.Module):
    """`layers.{i}.attn.conv`: `fn` (the modeling file's causal conv) with `conv1d`'s weights
    and the attention's activation, on [batch, tokens, channels]."""

    def __init__(self, fn, conv1d: nn.Module, activation):
        super().__init__()
        self.fn = fn
        self.conv1d = conv1d
        self.activation = activation

    def forward(self, x, **kwargs):
        out = self.fn(x.transpose(1, 2), self.conv1d.weight.squeeze(1), self.conv1d.bias, activation=self.activation, **kwargs)
        return out.transpose(1, 2)


class GdnGates(nn.Module):
    """`layers.{i}.attn.gates`: [.., 2 * heads] (a, b) -> [.., 2 * heads] (g, beta) in float32,
    as transformers' Gated DeltaNet computes them inline."""

    def __init__(self, A_log: nn.Parameter, dt_bias: nn.Parameter):
        super().__init__()
        self.A_log = A_log  # the attention's own parameters, registered here as well
        self.dt_bias = dt_bias

    def forward(self, ab):
        a, b = ab.chunk(2, dim=-1)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        return torch.cat([g, beta.float()], dim=-1)


def _running():
    return _ACTIVE[-1] if _ACTIVE else None


def _conv_router(original):
    def conv(hidden_states, weight, bias=None, activation=None, **kwargs):
        attn = _running()
        unit = getattr(attn, "conv", None)
        if not isinstance(unit, nn.Module):
            return original(hidden_states, weight, bias, activation=activation, **kwargs)
        return unit(hidden_states.transpose(1, 2), **kwargs).transpose(1, 2)

    return conv


def _rule_router(original):
    def rule(query, key, value, g, beta, *args, **kwargs):
        attn = _running()
        unit = getattr(attn, "gates", None)
        ab = _gate_inputs(attn) if attn is not None else None
        if isinstance(unit, nn.Module) and ab is not None:
            a, b = ab
            out = unit(torch.cat([a, b.to(a.dtype)], dim=-1))
            heads = out.shape[-1] // 2
            g, beta = out[..., :heads], out[..., heads:].to(beta.dtype)
        return original(query, key, value, g, beta, *args, **kwargs)

    return rule


ROUTERS = {CONV_FN: _conv_router, RULE_FN: _rule_router}


def _route(module_name: str) -> dict:
    """The modeling file's conv and delta-rule functions (their originals), the names routed."""
    return route_names(sys.modules[module_name], ROUTERS)


def _forget(m: nn.Module) -> None:
    """Drop what an earlier forward of `m` left to be read (a decode step reads none of it)."""
    m.__dict__.pop(_AB, None)
    for name in ("in_proj_a", "in_proj_b"):
        proj = getattr(m, name, None)
        if proj is not None:
            proj.__dict__.pop(_OUT, None)


def _enter(m, args, kwargs):
    _forget(m)
    _ACTIVE.append(m)


def _leave(m, args, out):
    _ACTIVE.pop()
    _forget(m)


def _keep_output(m, args, out):
    m.__dict__[_OUT] = out


def _gate_inputs(attn: nn.Module):
    """(a, b) of the running attention's forward, each read once: Qwen3-Next's kept by
    `fix_query_key_value_ordering`, Qwen3.5's the outputs of `in_proj_a` and `in_proj_b`."""
    ab = attn.__dict__.pop(_AB, None)
    if ab is None and hasattr(attn, "in_proj_a") and hasattr(attn, "in_proj_b"):
        a, b = attn.in_proj_a.__dict__.pop(_OUT, None), attn.in_proj_b.__dict__.pop(_OUT, None)
        ab = None if a is None or b is None else (a, b)
    return ab


def _split_ab(cls) -> None:
    """Qwen3-Next: `fix_query_key_value_ordering` returns (q, k, v, z, b, a); keep (a, b) on the
    module (the class's method wrapped once, for the process)."""
    fn = cls.__dict__.get("fix_query_key_value_ordering")
    if fn is None or ROUTED in fn.__dict__:
        return

    def fix(self, *args, **kwargs):
        out = fn(self, *args, **kwargs)
        self.__dict__[_AB] = (out[5], out[4])
        return out

    fix.__dict__[ROUTED] = fn
    cls.fix_query_key_value_ordering = fix


def gated_deltanets(engine) -> list[tuple[object, nn.Module]]:
    """(unit, module) of each Gated DeltaNet attention with `conv` or `gates` units."""
    parents = {u.parent for u in engine.units if u.kind in ("conv", "gates")}
    return [(engine.unit(p), engine.module(p)) for p in sorted(parents, key=lambda p: engine.unit(p).order)]


def install(engine) -> None:
    """A `conv` and a `gates` module in each Gated DeltaNet that has those units, and the
    routing to them (once per module)."""
    for _, attn in gated_deltanets(engine):
        if isinstance(getattr(attn, "gates", None), GdnGates):
            continue
        fns = _route(type(attn).__module__)
        if CONV_FN not in fns or RULE_FN not in fns:
            raise BackendError(f"{type(attn).__name__} ({type(attn).__module__}) has no {CONV_FN} or {RULE_FN} to route")
        attn.conv = GdnConv(fns[CONV_FN], attn.conv1d, attn.activation)
        attn.gates = GdnGates(attn.A_log, attn.dt_bias)
        if hasattr(attn, "in_proj_a") and hasattr(attn, "in_proj_b"):
            attn.in_proj_a.register_forward_hook(_keep_output)
            attn.in_proj_b.register_forward_hook(_keep_output)
        else:
            _split_ab(type(attn))
        attn.register_forward_pre_hook(_enter, with_kwargs=True)
        attn.register_forward_hook(_leave, always_call=True)

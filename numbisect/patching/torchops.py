"""Torch pieces the engines share: planted-fault arithmetic and the per-top-k-slot sum.

- `LOWP`: the low-precision dtypes a fault rounds to, by name.
- `noise_hook`, `round_input_hook`, `round_logits_hook`, `LowpNorm`: the faults that act on
  any module's call (`Backend.plant_fault` plants them; numbisect.patching.faults documents them).
- `lowp_experts`: SiLU-gated expert MLPs whose weighted sum is accumulated in low precision.
- `slot_sum`: the engine's own experts run one top-k slot at a time, summed either in
  float32 (the `fp32 weighted sum` what-if) or in a low precision (the `moe_combine`
  fault), written once for every engine.
- `gate_width`, `head_rows`, `gate_input`: Gated DeltaNet's gated norm (`out_gate`), which
  runs per value head, in per-token rows; its two inputs as one canonical input.
"""

from __future__ import annotations

import zlib
from typing import Callable

import torch
from torch import nn

LOWP = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn, "fp32": torch.float32}


ROUTED = "_numbisect_original"  # on a routed function: the function it stands in for


def route_names(mod, routers: dict[str, Callable]) -> dict:
    """Replace each name of module `mod` that `routers` lists by `routers[name](function)`, once
    for the process (a name routed before stays as it is); returns the functions as they were
    (the originals) by name, for the names the module has. Used where numbisect sends a
    modeling file's or a kernel file's own calls to modules of its own (MLA's rope, Gated
    DeltaNet's conv and gates)."""
    out = {}
    for name, router in routers.items():
        fn = getattr(mod, name, None)
        if fn is None:
            continue
        original = fn.__dict__.get(ROUTED, fn)
        if original is fn:
            routed = router(fn)
            routed.__dict__[ROUTED] = fn
            setattr(mod, name, routed)
        out[name] = original
    return out


def gate_width(config) -> int:
    """Width of an `out_gate`'s output and of `out_proj`'s input: value heads * head dim."""
    text = config.get_text_config()
    return text.linear_num_value_heads * text.linear_value_head_dim


def conv_width(config) -> int:
    """Channels of a Gated DeltaNet's causal conv (the `conv` unit, in and out): q, k, v."""
    text = config.get_text_config()
    return 2 * text.linear_num_key_heads * text.linear_key_head_dim + gate_width(config)


def gates_width(config) -> int:
    """Width of a Gated DeltaNet's `gates` unit, in ((a, b)) and out ((g, beta)): 2 * value heads."""
    return 2 * config.get_text_config().linear_num_value_heads


def head_rows(kind: str, t: torch.Tensor, config) -> torch.Tensor:
    """An `out_gate` activation as [tokens, value heads * head dim]: the gated norm runs per
    value head, on [tokens * heads, head dim] in transformers and [tokens, heads, head dim]
    in vLLM; other kinds as they are."""
    return t.reshape(-1, gate_width(config)) if kind == "out_gate" else t


def gate_input(args: tuple, config) -> torch.Tensor:
    """An `out_gate`'s canonical input: its two inputs, the core attention output and the
    gate z, as [tokens, 2 * value heads * head dim] (every head's core, then every head's z)."""
    core, z = args[0], args[1]
    return torch.cat([head_rows("out_gate", core, config), head_rows("out_gate", z, config)], dim=-1)


def first(x):
    return x[0] if isinstance(x, (tuple, list)) else x


def seeded(unit: str) -> torch.Generator:
    """The generator a fault's noise is drawn from: seeded from the unit name, so a fault
    is the same in every trial, run and tensor-parallel rank."""
    return torch.Generator().manual_seed(zlib.crc32(unit.encode()))


def noise_hook(unit: str, scale: float):
    """A forward hook adding scale * rms * N(0, 1) to every float output (a router's logits
    and, in transformers, its weights; a vision tower's ModelOutput, in place)."""

    def noisy(t: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        rms = t.float().pow(2).mean().sqrt()
        return (t.float() + scale * rms * torch.randn(t.shape, generator=g)).to(t.dtype)

    def every(x, g):
        if isinstance(x, torch.Tensor):
            return noisy(x, g) if x.is_floating_point() else x
        if isinstance(x, (tuple, list)):
            return type(x)(every(t, g) for t in x)
        if isinstance(x, dict):
            for k in list(x.keys()):
                x[k] = every(x[k], g)
            return x
        return x

    def hook(m, args, out):
        return every(out, seeded(unit))

    return hook


def round_input_hook(dtype: torch.dtype):
    """A forward pre-hook rounding the first (float) input to `dtype`."""

    def hook(m, args):
        if args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
            return (args[0].to(dtype).to(args[0].dtype),) + tuple(args[1:])
        return None

    return hook


def round_logits_hook(dtype: torch.dtype):
    """A forward hook rounding the (first) output to `dtype`."""

    def hook(m, args, out):
        t = first(out)
        r = t.to(dtype).to(t.dtype)
        return (r,) + tuple(out[1:]) if isinstance(out, tuple) else r

    return hook


class TextRotary(nn.Module):
    """A rotary embedding that takes M-RoPE's (3, batch, n) position ids, called with a text
    model's (batch, n) ones: the three rows are equal, as the text model itself expands them
    (`ArchMap.rotary_ids_3d`). Ids that are already 3-D pass as they are."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x, position_ids):
        if position_ids.ndim == 2:
            position_ids = position_ids.expand(3, *position_ids.shape)
        return self.inner(x, position_ids)


def text_rotary(arch, rotary: nn.Module | None) -> nn.Module | None:
    """`rotary`, wrapped in `TextRotary` where the family's embedding wants 3-D text ids."""
    return TextRotary(rotary) if rotary is not None and getattr(arch, "rotary_ids_3d", False) else rotary


class LowpNorm(nn.Module):
    """RMSNorm without the float32 upcast (both the plain and the fused-residual call)."""

    def __init__(self, inner: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.inner = inner
        self.lowp = dtype
        self.eps = getattr(inner, "variance_epsilon", getattr(inner, "eps", 1e-6))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(self.lowp)
        var = h.pow(2).mean(-1, keepdim=True)
        return (self.inner.weight.to(self.lowp) * (h * torch.rsqrt(var + self.eps))).to(x.dtype)

    def forward(self, x, residual=None):
        if residual is None:
            return self._norm(x)
        stream = x + residual
        return self._norm(stream), stream


def lowp_experts(x, idx, w, gate_up, down, dtype: torch.dtype) -> torch.Tensor:
    """Expert MLPs (SiLU-gated) with each weighted contribution rounded to `dtype` and
    accumulated in it (fp8 has no addition on CPU: its sum is rounded after each add)."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for k in range(idx.shape[1]):
        for e in idx[:, k].unique().tolist():
            rows = (idx[:, k] == e).nonzero().flatten()
            gu = x[rows] @ gate_up[e].T.to(x.dtype)
            g, u = gu.chunk(2, dim=-1)
            y = (torch.nn.functional.silu(g) * u) @ down[e].T.to(x.dtype)
            contrib = (y * w[rows, k, None].to(y.dtype)).to(dtype).float()
            out[rows] = (out[rows] + contrib).to(dtype).float()
    return out.to(x.dtype)


def slot_sum(experts: Callable, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
             lowp: torch.dtype | None = None) -> torch.Tensor:
    """The routed experts' weighted sum, one top-k slot at a time: `experts(x, w, ids)` is the
    engine's own experts on slot k alone (`w`, `ids`: [T, 1]).

    `lowp` None: each slot runs with weight 1 (the expert's output as the engine rounds it)
    and is multiplied by its weight and summed in float32. `lowp` a dtype: each slot runs
    with its own weight, its contribution is rounded to `lowp` and the sum accumulated in it."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for k in range(topk_ids.shape[1]):
        w = topk_weights[:, k : k + 1].contiguous()
        ids = topk_ids[:, k : k + 1].contiguous()
        if lowp is None:
            out += w.float() * experts(x, torch.ones_like(w), ids).float()
        else:
            out = (out + experts(x, w, ids).to(lowp).float()).to(lowp).float()
    return out.to(x.dtype)

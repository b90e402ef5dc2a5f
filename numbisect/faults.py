"""Planted numerical faults: known ground truth for the search, on the real backends.

A fault spec is `NAME[=VALUE]@UNIT`, e.g. `moe_combine_bf16@layers.2.moe`. Faults are
applied to the engine's own modules before any swap, so swapping the faulty unit (or
an ancestor) removes the fault exactly as swapping a real bug would.

Kinds:
- `weight_noise=S@UNIT`: multiply every weight of the unit by (1 + S * N(0, 1)).
- `output_noise=S@UNIT`: add S * rms(out) * N(0, 1) to the unit's output (every float
  tensor of it: a vision tower's image embeddings and deepstack features alike).
- `moe_combine_bf16@L.moe` (also `moe_combine_fp16`, `moe_combine_fp8`): each expert's
  weighted contribution is rounded to that dtype and the sum accumulated in it, as in
  the Qwen3.5-MoE case (the weighted sum of expert outputs in low precision).
- `router_logits_fp16@L.moe.router` (also `_bf16`, `_fp8`): the router GEMM in low
  precision: its input and its logits rounded to that dtype.
- `rmsnorm_no_upcast@NORM` (optionally `=DTYPE`): RMSNorm computed without the float32
  upcast, in bfloat16 unless given.
Noise is seeded from the unit name, so a fault is the same in every trial and run.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
from torch import nn

from numbisect.backends.base import first, get_module
from numbisect.errors import InputError

LOWP = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn, "fp32": torch.float32}
KINDS = {
    "weight_noise": None,
    "output_noise": None,
    "moe_combine": ("moe", "experts"),
    "router_logits": ("router",),
    "rmsnorm_no_upcast": ("norm",),
}


@dataclass(frozen=True)
class Fault:
    kind: str  # one of KINDS
    unit: str  # canonical unit name
    value: float | None = None  # noise scale
    dtype: str | None = None  # low-precision dtype name (bf16, fp16, fp8)
    spec: str = ""  # as the user wrote it

    def to_dict(self) -> dict:
        return {"spec": self.spec, "kind": self.kind, "unit": self.unit, "value": self.value, "dtype": self.dtype}


def parse_fault(spec: str) -> Fault:
    """A `Fault` from `NAME[=VALUE]@UNIT`; InputError for an unknown name, a dtype not in
    `LOWP`, a value given to a kind that takes none, or a noise scale that is not a finite
    number >= 0 (nan, inf and negative scales are refused)."""
    what, sep, unit = spec.partition("@")
    if not sep or not unit or not what:
        raise InputError(f"bad fault spec {spec!r}: expected NAME[=VALUE]@UNIT, e.g. moe_combine_bf16@layers.2.moe")
    name, has_val, val = what.partition("=")
    for kind in ("moe_combine", "router_logits"):
        if name.startswith(kind + "_"):
            dt = name[len(kind) + 1 :]
            if dt not in LOWP:
                raise InputError(f"bad fault {name!r}: dtype must be one of {', '.join(LOWP)}")
            if has_val:
                raise InputError(f"bad fault {spec!r}: {name} takes no value (the dtype is in its name)")
            return Fault(kind, unit, dtype=dt, spec=spec)
    if name == "rmsnorm_no_upcast":
        dt = val or "bf16"
        if dt not in ("bf16", "fp16"):
            raise InputError(f"bad fault {spec!r}: rmsnorm_no_upcast runs in bf16 or fp16")
        return Fault(name, unit, dtype=dt, spec=spec)
    if name in ("weight_noise", "output_noise"):
        try:
            scale = float(val)
        except ValueError:
            raise InputError(f"bad fault {spec!r}: {name} needs a scale, e.g. {name}=1e-2@{unit}") from None
        if not (math.isfinite(scale) and scale >= 0):  # NaN noise is no fault to find; a negative scale is a typo
            raise InputError(f"bad fault {spec!r}: the scale must be a finite number >= 0, e.g. {name}=1e-2@{unit}")
        return Fault(name, unit, value=scale, spec=spec)
    known = "weight_noise=S, output_noise=S, moe_combine_{bf16,fp16,fp8}, router_logits_{bf16,fp16,fp8}, rmsnorm_no_upcast"
    raise InputError(f"unknown fault {name!r}; known: {known}")


def check_fault(engine, fault: Fault) -> None:
    unit = engine.unit(fault.unit)  # names nearby units when it does not exist
    allowed = KINDS[fault.kind]
    if allowed and unit.kind not in allowed:
        raise InputError(f"fault {fault.kind} applies to units of kind {', '.join(allowed)}; {fault.unit} is {unit.kind}")


def _gen(unit: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(unit.encode()))


class Planted:
    """The faults in force on one engine; `undo()` puts everything back."""

    def __init__(self, engine):
        self.engine = engine
        self._params: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._hooks: list = []
        self._attrs: list[tuple[object, str]] = []
        self._modules: list[tuple[str, nn.Module]] = []

    def undo(self) -> None:
        for h in self._hooks:
            h.remove()
        for p, saved in self._params:
            p.data.copy_(saved)
        for obj, attr in self._attrs:
            try:
                delattr(obj, attr)
            except AttributeError:
                pass
        from numbisect.backends.base import set_module

        for path, mod in reversed(self._modules):
            set_module(self.engine.root, path, mod)
        self._hooks, self._params, self._attrs, self._modules = [], [], [], []


def apply_faults(engine, faults: list[Fault]) -> Planted:
    """Plant `faults` on the engine; on a failure, the ones already planted are undone."""
    planted = Planted(engine)
    try:
        _plant(engine, planted, faults)
    except BaseException:
        planted.undo()
        raise
    return planted


def _plant(engine, planted: Planted, faults: list[Fault]) -> None:
    for f in faults:
        check_fault(engine, f)
        mod = engine.module(f.unit)
        if f.kind == "weight_noise":
            g = _gen(f.unit)
            for p in mod.parameters():
                if p.is_floating_point() and p.numel():
                    planted._params.append((p, p.data.clone()))
                    p.data.mul_(1 + f.value * torch.randn(p.shape, generator=g))
        elif f.kind == "output_noise" and engine.kind == "vllm" and engine.unit(f.unit).kind == "experts":
            # The routed sum (what an experts swap replaces), not the runner's output.
            routed = mod.routed_experts
            kernel = routed.forward_modular
            add_noise = _output_noise(f)

            def forward_modular(*args, _kernel=kernel, _noise=add_noise, **kwargs):
                return _noise(None, args, _kernel(*args, **kwargs))

            setattr(routed, "forward_modular", forward_modular)
            planted._attrs.append((routed, "forward_modular"))
        elif f.kind == "output_noise":
            planted._hooks.append(mod.register_forward_hook(_output_noise(f)))
        elif f.kind == "router_logits":  # the router GEMM in low precision: input and logits rounded
            planted._hooks.append(mod.register_forward_pre_hook(_round_input(LOWP[f.dtype])))
            planted._hooks.append(mod.register_forward_hook(_round_logits(LOWP[f.dtype])))
        if f.kind in ("output_noise", "router_logits") and engine.kind == "hf" and engine.unit(f.unit).kind == "router":
            # transformers' router picks its experts inside forward, before the hooks above:
            # choose again from the perturbed logits, as vLLM does after its gate.
            planted._hooks.append(mod.register_forward_hook(_reroute(engine)))
        if f.kind == "rmsnorm_no_upcast":
            path = engine.module_path(f.unit)
            planted._modules.append((path, mod))
            from numbisect.backends.base import set_module

            set_module(engine.root, path, LowpNorm(mod, LOWP[f.dtype]))
        if f.kind == "moe_combine":
            _plant_combine(engine, planted, f)


def _output_noise(f: Fault):
    """Noise on every float output (a router's logits and, in transformers, its weights)."""

    def noisy(t: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        rms = t.float().pow(2).mean().sqrt()
        return (t.float() + f.value * rms * torch.randn(t.shape, generator=g)).to(t.dtype)

    def every(x, g):
        if isinstance(x, torch.Tensor):
            return noisy(x, g) if x.is_floating_point() else x
        if isinstance(x, (tuple, list)):
            return type(x)(every(t, g) for t in x)
        if isinstance(x, dict):  # a transformers ModelOutput (a vision tower's), in place
            for k in list(x.keys()):
                x[k] = every(x[k], g)
            return x
        return x

    def hook(m, args, out):
        return every(out, _gen(f.unit))

    return hook


def _reroute(engine):
    """A transformers router's (logits, weights, ids) chosen again from its (perturbed) logits."""
    from numbisect.routing import router_spec, select, weights_for

    spec = router_spec(engine.config)

    def hook(m, args, out):
        if spec is None:
            return None
        logits, w = out[0], out[1]
        bias = getattr(m, "e_score_correction_bias", None)
        ids = select(logits, spec, None if bias is None else bias.double())
        return (logits, weights_for(logits, ids, spec).to(w.dtype), ids.to(out[2].dtype)) + tuple(out[3:])

    return hook


def _round_input(dtype: torch.dtype):
    def hook(m, args):
        if args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
            return (args[0].to(dtype).to(args[0].dtype),) + tuple(args[1:])
        return None

    return hook


def _round_logits(dtype: torch.dtype):
    def hook(m, args, out):
        t = first(out)
        r = t.to(dtype).to(t.dtype)
        return (r,) + tuple(out[1:]) if isinstance(out, tuple) else r

    return hook


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


def _plant_combine(engine, planted: Planted, f: Fault) -> None:
    unit = engine.unit(f.unit)
    block = f.unit if unit.kind == "moe" else unit.parent
    dtype = LOWP[f.dtype]
    if engine.kind == "vllm":
        # vLLM-CPU keeps its expert weights in its own (prepacked) layout, so the fault
        # runs the engine's own kernel once per top-k slot: each call returns one expert's
        # weighted contribution, rounded to the engine dtype; the sum is taken in `dtype`.
        routed = engine.module(block + ".experts").routed_experts  # the block's FusedMoE runner (arch map)
        kernel = routed.forward_modular

        def forward_modular(x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None):
            from numbisect.swap import run_shared_experts

            run_shared_experts(shared_experts, shared_experts_input)
            out = torch.zeros(x.shape, dtype=torch.float32)
            for k in range(topk_ids.shape[1]):
                part = kernel(x=x, topk_weights=topk_weights[:, k : k + 1].contiguous(), topk_ids=topk_ids[:, k : k + 1].contiguous())
                out = (out + part.to(dtype).float()).to(dtype).float()
            return out.to(x.dtype)

        setattr(routed, "forward_modular", forward_modular)
        planted._attrs.append((routed, "forward_modular"))
    else:
        path = engine.module_path(block + ".experts")
        experts = get_module(engine.root, path)
        planted._modules.append((path, experts))
        from numbisect.backends.base import set_module

        set_module(engine.root, path, LowpExperts(experts, dtype))


class LowpExperts(nn.Module):
    """transformers experts module `(hidden, top_k_index, top_k_weights)` with a low-precision sum."""

    def __init__(self, inner: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.inner = inner
        self.lowp = dtype

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return lowp_experts(hidden_states, top_k_index, top_k_weights, self.inner.gate_up_proj, self.inner.down_proj, self.lowp)

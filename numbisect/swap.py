"""Transplants: put the reference's own module for a unit into the engine.

A swap is data (`SwapSpec`: unit names plus the donor checkpoint), so it can be rebuilt
wherever the engine's model lives. The donor module keeps its own weights and dtype;
an adapter gives it the engine's calling convention and casts at the boundary:

- hf engine: the same calling convention, so a `CastAdapter` casts tensors in and out.
- vllm engine: flat `[tokens, hidden]` activations, `(hidden, residual)` layer outputs,
  RMSNorm fused with the residual add, attention called as `(positions, hidden)`,
  logits from a logits processor. Each kind has an adapter below. MoE sub-units are
  swapped inside vLLM's MoE runner: `moe.router` replaces gate + top-k + renormalise
  (`router.select_experts`), `moe.experts` replaces the expert MLPs and their weighted
  sum (`routed_experts.forward_modular`) and keeps the engine's routing.

Logits from a swapped `lm_head` stay in the donor's dtype (both backends take a float32
log-softmax of them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from numbisect.backends.base import Backend, hidden_arg
from numbisect.errors import InputError
from numbisect.units import SWAP_KINDS


@dataclass(frozen=True)
class SwapSpec:
    units: tuple[str, ...]  # canonical unit names to swap
    donor_path: str  # the reference checkpoint the modules come from
    donor_dtype: str  # the dtype the donor modules run in

    def to_dict(self) -> dict:
        return {"units": list(self.units), "donor_path": self.donor_path, "donor_dtype": self.donor_dtype}


def _cast(x: Any, dtype: torch.dtype, only: torch.dtype | None = None) -> Any:
    """`x` with its float tensors cast to `dtype`; with `only`, just the tensors of that
    dtype (the activations), so an fp32 side input (a router's top-k weights) stays fp32."""
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if x.is_floating_point() and (only is None or x.dtype == only) else x
    if isinstance(x, tuple):
        return tuple(_cast(v, dtype, only) for v in x)
    if isinstance(x, list):
        return [_cast(v, dtype, only) for v in x]
    if isinstance(x, dict):  # a plain dict or a transformers ModelOutput (keep its class)
        return type(x)(**{k: _cast(v, dtype, only) for k, v in x.items()})
    return x


class CastAdapter(nn.Module):
    """Run `inner` in `inner_dtype`; hand its float outputs back in `out_dtype` (None: keep)."""

    def __init__(self, inner: nn.Module, inner_dtype: torch.dtype, out_dtype: torch.dtype | None, rotary=None):
        super().__init__()
        self.inner = inner
        self.inner_dtype = inner_dtype
        self.out_dtype = out_dtype
        self.rotary = rotary  # donor rotary embedding: recompute cos/sin in the donor's dtype

    def forward(self, *args, **kwargs):
        x = hidden_arg(args, kwargs)
        outer = x.dtype if x is not None else None
        args, kwargs = _cast(args, self.inner_dtype, outer), _cast(kwargs, self.inner_dtype, outer)
        if self.rotary is not None and kwargs.get("position_ids") is not None and "position_embeddings" in kwargs:
            x = kwargs.get("hidden_states", args[0] if args else None)
            kwargs["position_embeddings"] = self.rotary(x, kwargs["position_ids"])
        out = self.inner(*args, **kwargs)
        return out if self.out_dtype is None else _cast(out, self.out_dtype, self.inner_dtype)

    def __getattr__(self, name):
        # Callers read attributes of the module they think they hold (a vision tower's
        # `dtype`, `spatial_merge_size`): answer for the inner module.
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("_modules", {}).get("inner")
            if inner is None or name.startswith("__"):  # half-built, copy/pickle probes
                raise
            return getattr(inner, name)


class _VllmHF(nn.Module):
    """Base for vLLM-side adapters around a donor transformers module."""

    def __init__(self, inner: nn.Module, donor, engine_dtype: torch.dtype):
        super().__init__()
        self.inner = inner
        self.rdt = donor.dtype
        self.edt = engine_dtype
        self._donor_model = [donor.model]  # in a list: not a submodule of the engine
        self._donor_arch = donor.arch  # where the donor's family keeps its rotary embedding

    def hf_context(self, x: torch.Tensor, positions: torch.Tensor):
        """What the transformers model hands a layer for one unpadded sequence."""
        from transformers.masking_utils import create_causal_mask

        model = self._donor_model[0]
        pos = positions.view(1, -1).long()
        x3 = x.view(1, x.shape[-2], x.shape[-1])
        mask = create_causal_mask(
            config=model.config,
            inputs_embeds=x3,
            attention_mask=torch.ones(1, x3.shape[1], dtype=torch.long),
            past_key_values=None,
            position_ids=pos,
        )
        return {"attention_mask": mask, "position_ids": pos, "position_embeddings": self._donor_arch.rotary(model)(x3, pos)}


class VllmEmbed(_VllmHF):
    def forward(self, input_ids):
        return self.inner(input_ids.long()).to(self.edt)


class VllmNorm(_VllmHF):
    """vLLM RMSNorm: `norm(x)` or fused `norm(x, residual) -> (norm(x + residual), x + residual)`."""

    def forward(self, x, residual=None):
        if residual is None:
            return self.inner(x.to(self.rdt)).to(self.edt)
        stream = x + residual  # the residual add, in the engine's dtype as the engine keeps it
        return self.inner(stream.to(self.rdt)).to(self.edt), stream


class VllmAttn(_VllmHF):
    def forward(self, positions, hidden_states):
        x = hidden_states.to(self.rdt)[None]
        out = self.inner(hidden_states=x, **{k: v for k, v in self.hf_context(x, positions).items() if k != "position_ids"})
        return out[0][0].to(self.edt)


class VllmBlock(_VllmHF):
    """A whole MLP or MoE block: `[tokens, hidden] -> [tokens, hidden]`."""

    def forward(self, hidden_states):
        return self.inner(hidden_states.to(self.rdt)[None])[0].to(self.edt)


class VllmLayer(_VllmHF):
    """A whole decoder layer: `(positions, hidden, residual) -> (stream, zeros)`."""

    def forward(self, positions, hidden_states, residual):
        stream = hidden_states if residual is None else hidden_states + residual
        x = stream.to(self.rdt)[None]
        out = self.inner(x, **self.hf_context(x, positions))
        out = (out[0] if isinstance(out, tuple) else out)[0].to(self.edt)
        return out, torch.zeros_like(out)


class VllmLogits(_VllmHF):
    """The logits processor: `(lm_head, hidden) -> logits`, computed by the donor's lm_head."""

    def forward(self, lm_head, hidden_states, embedding_bias=None, *args, **kwargs):
        return self.inner(hidden_states.to(self.rdt))


VLLM_ADAPTERS = {
    "embed": VllmEmbed,
    "norm": VllmNorm,
    "attn": VllmAttn,
    "moe": VllmBlock,
    "mlp": VllmBlock,
    "shared_expert": VllmBlock,
    "layer": VllmLayer,
    "lm_head": VllmLogits,
}


def expand(backend: Backend, names: list[str] | tuple[str, ...]) -> list[str]:
    """Unit names to apply: drop any unit whose ancestor is also swapped."""
    wanted = set(names)
    out = []
    for n in names:
        u = backend.unit(n)
        parent, covered = u.parent, False
        while parent != "model":
            if parent in wanted:
                covered = True
                break
            parent = backend.unit(parent).parent
        if not covered and n not in out:
            out.append(n)
    return out


def units_of_kinds(backend: Backend, kinds: list[str]) -> list[str]:
    """Every unit of the given kinds; an unknown kind is a usage error listing the real ones."""
    have = sorted({u.kind for u in backend.units})
    bad = [k for k in kinds if k not in have]
    if bad:
        raise InputError(f"unknown kind {', '.join(bad)} for --swap; {backend.arch.name} has: {', '.join(have)}")
    return [u.name for u in backend.units if u.kind in kinds]


def apply_swaps(engine: Backend, donor, names: list[str] | tuple[str, ...]) -> None:
    """Make exactly `names` swapped in `engine` (earlier swaps and patches are undone)."""
    unpatch(engine)
    engine.restore()
    for name in expand(engine, names):
        unit = engine.unit(name)
        if unit.kind not in SWAP_KINDS:
            raise InputError(f"unit {name} of kind {unit.kind} cannot be swapped")
        ref = donor.original(name)
        if engine.kind == "hf":
            _swap_hf(engine, donor, unit, ref)
        else:
            _swap_vllm(engine, donor, unit, ref)


def _swap_hf(engine, donor, unit, ref: nn.Module) -> None:
    out_dtype = None if unit.kind == "lm_head" else engine.dtype
    rotary = donor.arch.layer_rotary(donor.model) if unit.kind in ("attn", "layer") else None
    engine.replace(unit.name, CastAdapter(ref, donor.dtype, out_dtype, rotary))


def _swap_vllm(engine, donor, unit, ref: nn.Module) -> None:
    if unit.kind in ("router", "experts"):
        _patch_vllm_moe(engine, donor, unit, ref)
        return
    adapter = VLLM_ADAPTERS[unit.kind](ref, donor, engine.dtype)
    engine.replace(unit.name, adapter)
    if unit.kind == "shared_expert":  # the MoE runner holds its own reference to the shared expert
        shared = getattr(_runner(engine, unit), "_shared_experts", None)
        if shared is not None and hasattr(shared, "_layer"):
            _patch(engine, shared, "_layer", adapter)


# -- vLLM MoE runner patches ----------------------------------------------------------------
_PATCHED = "_numbisect_patched"


def _runner(engine, unit):
    return engine.module(unit.parent + ".experts")  # the MoE block's FusedMoE runner (arch map)


_MISSING = object()


def _patch(engine, obj, attr: str, value) -> None:
    """Set `obj.attr`, remembering what was there (an instance attribute or a submodule)."""
    own = obj.__dict__.get(attr, _MISSING)
    if own is _MISSING and isinstance(obj, nn.Module):
        own = obj._modules.get(attr, _MISSING)
    engine.__dict__.setdefault(_PATCHED, []).append((obj, attr, own))
    setattr(obj, attr, value)


def unpatch(engine) -> None:
    for obj, attr, old in reversed(engine.__dict__.pop(_PATCHED, [])):
        if old is _MISSING:
            try:
                delattr(obj, attr)  # back to the class's method
            except AttributeError:
                pass
        else:
            setattr(obj, attr, old)


def run_shared_experts(shared_experts, shared_input) -> None:
    """What the fused kernel does with vLLM's shared experts: run them in whichever order
    they were planned for (the runner already ran the NO_OVERLAP ones)."""
    if shared_experts is None or shared_input is None:
        return
    from vllm.model_executor.layers.fused_moe.runner.shared_experts import SharedExpertsOrder

    for order in (SharedExpertsOrder.MK_INTERNAL_OVERLAPPED, SharedExpertsOrder.MULTI_STREAM_OVERLAPPED):
        shared_experts(shared_input, order)


def _patch_vllm_moe(engine, donor, unit, ref: nn.Module) -> None:
    runner = _runner(engine, unit)
    rdt = donor.dtype
    if unit.kind == "router":
        original = runner.router.select_experts

        def select_experts(hidden_states, router_logits, topk_indices_dtype=None, **kw):
            _, weights, idx = ref(hidden_states.to(rdt))
            ids_dtype = topk_indices_dtype or torch.int32
            out = weights.to(torch.float32)
            # The engine's kernel takes float32 weights; swapped experts get the router's own.
            runner.__dict__["_numbisect_routed"] = (out, weights)
            return out, idx.to(ids_dtype)

        select_experts.__wrapped__ = original
        _patch(engine, runner.router, "select_experts", select_experts)
    else:

        def forward_modular(x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None):
            # Weights in the dtype the reference router gave them (bf16 or float32 by family).
            routed = runner.__dict__.pop("_numbisect_routed", None)
            w = routed[1] if routed is not None and routed[0] is topk_weights else topk_weights
            out = ref(x.to(rdt), topk_ids.long(), w).to(x.dtype)
            run_shared_experts(shared_experts, shared_experts_input)  # still the engine's
            return out

        _patch(engine, runner.routed_experts, "forward_modular", forward_modular)


# -- rebuilding a swap from data, where the engine's model lives ------------------------------
_DONORS: dict = {}


class _ModelEngine(Backend):
    """A backend view of a bare vLLM model (what `llm.apply_model` hands a function)."""

    kind = "vllm"

    def __init__(self, model: nn.Module, dtype: str):
        from numbisect.arch import arch_for
        from numbisect.backends.base import parse_dtype

        self.model = model
        self.dtype_name, self.dtype = dtype, parse_dtype(dtype)
        self.config = model.config
        self.arch = arch_for(self.config)
        self.units = self.arch.units(self.config)
        self.unit_by_name = {u.name: u for u in self.units}
        self._originals = {}

    @property
    def root(self):
        return self.model


def apply_swap_spec(model: nn.Module, spec: SwapSpec, engine_dtype: str) -> list[str]:
    """Rebuild `spec` on a vLLM model in this process (an engine worker): load the donor
    from its checkpoint once per process, then swap. Pass it to `llm.apply_model` as
    `functools.partial(apply_swap_spec, spec=spec, engine_dtype=...)`: it pickles, so it
    reaches workers of a multi-process engine too. Returns the units swapped."""
    from numbisect.backends.hf import HFBackend

    key = (spec.donor_path, spec.donor_dtype)
    if key not in _DONORS:
        _DONORS[key] = HFBackend(spec.donor_path, spec.donor_dtype)
    engine = model.__dict__.get("_numbisect_engine") or _ModelEngine(model, engine_dtype)
    model.__dict__["_numbisect_engine"] = engine
    apply_swaps(engine, _DONORS[key], list(spec.units))
    return expand(engine, list(spec.units))


def undo_swap_spec(model: nn.Module) -> None:
    """Put back what `apply_swap_spec` replaced in this process."""
    engine = model.__dict__.pop("_numbisect_engine", None)
    if engine is not None:
        unpatch(engine)
        engine.restore()

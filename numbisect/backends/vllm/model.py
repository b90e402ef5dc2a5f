"""A vLLM model in this process, as a `Backend`: its swaps, faults, routing probe and what-ifs.

`VLLMModel` implements the state-changing half of the backend interface for any vLLM
model reachable in this process: the in-process engine (`runner.VLLMBackend` subclasses
it) and a bare model inside a tensor-parallel worker (`VLLMModel.of(model, dtype)`, what
`llm.apply_model` hands a function). Swaps rebuilt from data in a worker
(`apply_swap_spec`, `undo_swap_spec`) live here too.

- Swaps (`swap_unit`): a donor transformers module behind the adapter of its unit kind
  (and variant: `adapters.py`); router and experts inside the fused-MoE runner, and the
  runner's and a gated shared expert's references to the swapped module (`moe.py`).
- Faults (`plant_fault`): `moe_combine_*` and an output noise on the experts' routed sum
  in the fused-MoE runner, a weight noise at experts on the routed experts' weights only
  (the runner holds the gate and shared expert too); a weight noise reaches a linear
  layer's GEMM through `plant_weight_noise_cpu` (on a CPU with a bf16 GEMM kernel vLLM keeps
  the weight packed in its `cpu_linear` closure and empties `.weight`); the others as on
  any module (`Backend.plant_fault`).
- What-ifs: `fp32 weighted sum` in the runner (`moe.slot_sum_whatif`); `fp32 unit` is the
  reference's module in float32 swapped in (vLLM's linear weights are prepacked: the
  engine's own module cannot be copied), so noise planted at or inside the unit is lost,
  except an output noise at the unit itself, planted again on top.
"""

from __future__ import annotations

import copy
import math
from collections import OrderedDict

import torch
from torch import nn

from numbisect.backends.base import WHATIF_UNIT, WHATIF_WSUM, Backend, parse_dtype
from numbisect.backends.hf import HFBackend
from numbisect.backends.vllm import cpu_mla, moe
from numbisect.backends.vllm.adapters import ADAPTERS, VllmGatedShared
from numbisect.model.arch import arch_for
from numbisect.patching.ledger import Ledger
from numbisect.patching.swap import apply_swaps, expand
from numbisect.patching.torchops import seeded

PRECISION_FAULTS = ("moe_combine", "router_logits", "rmsnorm_no_upcast")


def _inside(name: str, unit: str) -> bool:
    return name == unit or name.startswith(unit + ".")


def gemm_weight(lin: nn.Module, block: int = 256, probe: int = 16) -> torch.Tensor:
    """The [N, K] weight a vLLM-CPU linear layer multiplies by. vLLM's CPU linear methods
    (`dispatch_cpu_unquantized_gemm`, vllm/model_executor/layers/utils.py) hand it to a GEMM
    kernel in `lin.cpu_linear` (oneDNN, the SGL kernel, zentorch) that keeps a packed copy
    of its own and, for a `LinearBase`, leave `.weight` empty; where no such kernel runs
    `cpu_linear` is `F.linear` over `.weight` itself. The SGL kernel's packed copy is
    unpacked by its packing order (`sgl_weight`: the very tensor the kernel reads, one
    gather); another kernel's (oneDNN keeps it behind a handle) is read back through the
    kernel on the identity (`_through_kernel`: each output is one weight times 1, exact).

    An embedding and an lm_head keep `.weight` beside the kernel's copy (the lookup reads
    it): `.weight` is returned when the kernel's copy equals it bit for bit (the SGL
    kernel's whole copy; another kernel's `probe` columns, picked by a fixed seed, read
    through it), the kernel's whole copy when they differ (a sync that wrote `.weight` in
    place, as vLLM's `load_weights` does, leaves the logits computed with the copy made at
    start-up: measured here with oneDNN; docs/explanation/cpu-paths.md)."""
    w = lin.weight
    if getattr(lin, "cpu_linear", torch.nn.functional.linear) is torch.nn.functional.linear:
        return w.data
    packed = sgl_weight(lin)
    if packed is not None:
        return w.data if w.numel() and torch.equal(packed, w.data) else packed
    if not w.numel():
        return _through_kernel(lin, block)
    k = w.shape[1]
    cols = torch.randperm(k, generator=torch.Generator().manual_seed(0))[:probe]
    eye = torch.zeros(len(cols), k, dtype=w.dtype)
    eye[torch.arange(len(cols)), cols] = 1
    got = lin.cpu_linear(eye, w, None)  # [probe, N]: the kernel's columns `cols`
    if got.dtype == w.dtype and torch.equal(got.t(), w.data[:, cols]):
        return w.data
    return _through_kernel(lin, block)


ORDER_CACHE_BYTES = 256 << 20  # the packing orders kept (`pack_order`), least recently used let go first
_ORDERS: OrderedDict = OrderedDict()  # (kernel, shape, dtype, block, most) -> a packed layout's element order (or None)


def pack_order(key: tuple, shape: tuple, dtype: torch.dtype, pack, block: int | None = None,
               most: int | None = None) -> torch.Tensor | None:
    """Where a packing kernel `pack` (a tensor of `shape` and `dtype` -> its packed form)
    puts each element: found by packing the element indices themselves, one base-256 digit
    at a time (0..255 are exact in bf16 and fp16); `order[j]` is the index of the element
    the packed tensor holds at j (int32 where the count fits). None when the packing is not a
    pure reordering.

    `block`: rows along the first dimension that the kernel packs apart from the others (one
    expert of vLLM-CPU's MoE prepacking, [E, N, K]: 1; the SGL GEMM kernel's [N, K]: 32).
    Where `shape` holds at least two blocks and two blocks of random values pack as each
    block alone, the order is one block's (`unpack` applies it to each block in turn): its
    memory and the time to find it are one block's, whatever the tensor's size. Else the
    order spans the whole tensor: None when that is over `most` elements. Found once per
    (key, shape, dtype, block); the orders kept are bounded by `ORDER_CACHE_BYTES` (the
    least recently used let go first)."""
    key = (key, tuple(shape), dtype, block, most)
    if key in _ORDERS:
        _ORDERS.move_to_end(key)
        return _ORDERS[key]
    one = (block, *shape[1:]) if block and shape[0] % block == 0 and shape[0] >= 2 * block else None
    order = _order(one, dtype, pack) if one is not None and _packs_apart(one, dtype, pack) else None
    if order is None and (most is None or math.prod(shape) <= most):
        order = _order(tuple(shape), dtype, pack)
    _ORDERS[key] = order
    while len(_ORDERS) > 1 and sum(o.numel() * o.element_size() for o in _ORDERS.values() if o is not None) \
            > ORDER_CACHE_BYTES:
        _ORDERS.popitem(last=False)
    return order


def _order(shape: tuple, dtype: torch.dtype, pack) -> torch.Tensor | None:
    """`pack_order` over a tensor of `shape` (module doc there); None when no reordering."""
    n = math.prod(shape)
    itype = torch.int32 if n <= torch.iinfo(torch.int32).max else torch.int64
    idx = torch.arange(n, dtype=itype)
    order = torch.zeros(n, dtype=itype)
    for d in range(max(1, math.ceil(math.log(n, 256)))):
        digit = ((idx >> (8 * d)) & 255).to(dtype).view(shape)
        order += pack(digit).reshape(-1).to(itype) << (8 * d)
    return order if torch.equal(order.sort().values, idx) else None


def _packs_apart(one: tuple, dtype: torch.dtype, pack) -> bool:
    """Whether `pack` packs two blocks of shape `one` (stacked along the first dimension) as
    it packs each block alone (random values, a fixed seed)."""
    two = torch.randn((2 * one[0], *one[1:]), generator=torch.Generator().manual_seed(0), dtype=dtype)
    whole = pack(two).reshape(-1)
    return whole.numel() == two.numel() and torch.equal(
        whole, torch.cat([pack(two[: one[0]].contiguous()).reshape(-1), pack(two[one[0]:].contiguous()).reshape(-1)]))


def unpack(t: torch.Tensor, order: torch.Tensor | None, shape: tuple | None = None) -> torch.Tensor | None:
    """A packed tensor `t` in its plain layout (`shape`: its own by default), by its
    packing order (`pack_order`: over the whole tensor, or over one block, applied to each
    block of `t` in turn); None when the order is unknown. A tensor of its own."""
    if order is None or not order.numel() or t.numel() % order.numel():
        return None
    src = t.detach().reshape(-1, order.numel()).cpu()
    out = torch.empty_like(src)
    for b in range(src.shape[0]):
        out[b][order] = src[b]
    return out.view(t.shape if shape is None else shape)


# The most elements of a weight the SGL GEMM kernel packs whole (not 32 rows at a time) that
# is unpacked by its packing order (`sgl_weight`), an order over the whole weight being
# 4 bytes an element. vLLM-CPU 0.32 packs 32 rows at a time (the order is 32 rows') and gives
# the kernel weights of at most 1 MiB (`_CPU_SGL_GEMM_MAX_WEIGHT_BYTES`: 512Ki bf16
# elements); over this bound a weight is read through the kernel.
SGL_MAX = 1 << 22
SGL_BLOCK = 32  # rows the SGL kernel packs apart (`convert_weight_packed`, block_n), checked at each shape


def _sgl_closure(lin: nn.Module) -> tuple[torch.Tensor, int] | None:
    """(packed weight, N) where `lin.cpu_linear` is vLLM-CPU's SGL kernel closure
    (`dispatch_cpu_unquantized_gemm`: `lambda x, weight, bias:
    ops.weight_packed_linear_cpu(x, packed_weight, N, bias)`), else None (oneDNN, zentorch,
    `F.linear`, a `cpu_linear` numbisect or a user put there)."""
    fn = getattr(lin, "cpu_linear", None)
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or not cells or sorted(code.co_freevars) != ["N", "packed_weight"] \
            or "weight_packed_linear_cpu" not in code.co_names:
        return None
    got = dict(zip(code.co_freevars, (c.cell_contents for c in cells)))
    packed, n = got["packed_weight"], got["N"]
    return (packed, n) if isinstance(packed, torch.Tensor) and isinstance(n, int) else None


def sgl_weight(lin: nn.Module) -> torch.Tensor | None:
    """The [N, K] weight vLLM-CPU's SGL GEMM kernel multiplies by, from the packed copy its
    closure holds (`_sgl_closure`), unpacked by the packing order of `convert_weight_packed`
    (`pack_order`: the kernel's own packing of the indices, a pure reordering for bf16 and
    fp16 with N a multiple of 16; found for 32 rows where the kernel packs them apart:
    `SGL_BLOCK`). None where `lin` runs another kernel, or the packing is no reordering (N
    under 16: packed transposed in float32), or the weight, packed whole, is over `SGL_MAX`
    elements, or vLLM has no such op."""
    got = _sgl_closure(lin)
    pack = getattr(getattr(torch.ops, "_C", None), "convert_weight_packed", None)
    if got is None or pack is None:
        return None
    packed, n = got
    if packed.dtype != lin.weight.dtype or not packed.numel() or n <= 0 or packed.numel() % n:
        return None
    shape = (n, packed.numel() // n)
    return unpack(packed, pack_order(("sgl",), shape, packed.dtype, pack, block=SGL_BLOCK, most=SGL_MAX), shape)


def _through_kernel(lin: nn.Module, block: int = 256) -> torch.Tensor:
    """The weight `lin.cpu_linear` multiplies by, read through it on the identity, fed
    `block` rows at a time (a whole [K, K] identity and its [K, N] answer, transposed, were
    ~3x the weight)."""
    w = lin.weight
    k = getattr(lin, "input_size_per_partition", None) or getattr(lin, "input_size", None) or w.shape[1]
    out = None
    for i in range(0, k, block):
        eye = torch.zeros(min(block, k - i), k, dtype=w.dtype)
        eye[:, i:i + eye.shape[0]].fill_diagonal_(1)
        cols = lin.cpu_linear(eye, w, None)  # [rows of the identity, N]: columns i.. of the weight
        if out is None:
            out = torch.empty(cols.shape[1], k, dtype=cols.dtype)
        out[:, i:i + eye.shape[0]] = cols.t()
    return out


def _plain_linear(weight: torch.Tensor):
    """A `cpu_linear` that multiplies by `weight` (a bias vLLM turned to float32 cast back)."""

    def cpu_linear(x, _weight, bias):
        return torch.nn.functional.linear(x, weight, None if bias is None else bias.to(x.dtype))

    return cpu_linear


def plant_weight_noise_cpu(mod: nn.Module, fault, ledger: Ledger) -> None:
    """`weight_noise` on a vLLM module: every float parameter times (1 + value * N(0, 1)),
    seeded by the unit (as `base.plant_weight_noise`), where a linear layer's weight is the
    one its GEMM kernel reads (`gemm_weight`): the noisy weight goes to the kernel through a
    `cpu_linear` of its own, and into `.weight` too where that holds one (an embedding's
    lookup reads it). Noise written into `.weight` alone would not reach a packed GEMM. An
    AMX_MLA layer's `kv_b_proj` (weight emptied) gets it in the packed W_UK/W_UV its kernel
    reads (numbisect.backends.vllm.cpu_mla)."""
    gemm = {id(m.weight): m for m in mod.modules() if hasattr(m, "cpu_linear") and isinstance(getattr(m, "weight", None), torch.Tensor)}
    absorbed = {id(attn.kv_b_proj.weight): attn for attn in cpu_mla.amx_layers(mod).values()}
    g = seeded(fault.unit)
    for p in mod.parameters():
        attn = absorbed.get(id(p))
        if attn is not None:  # AMX_MLA multiplies by its packed W_UK/W_UV only: the noise goes there
            w = cpu_mla.absorbed_kv_b(attn)
            noisy = (w * (1 + fault.value * torch.randn(w.shape, generator=g))).to(w.dtype)
            for name, packed in zip(("_w_uk_packed", "_w_uv_packed"), cpu_mla.packed(attn, noisy)):
                ledger.setattr(attn.impl, name, packed)
            continue
        if not p.is_floating_point():
            continue
        lin = gemm.get(id(p))
        if lin is None:
            if p.numel():
                ledger.save(p)
                p.data.mul_(1 + fault.value * torch.randn(p.shape, generator=g))
            continue
        w = gemm_weight(lin)
        noisy = w * (1 + fault.value * torch.randn(w.shape, generator=g))
        noisy = noisy.to(w.dtype)
        if p.numel():
            ledger.save(p)
            p.data.copy_(noisy)
        ledger.setattr(lin, "cpu_linear", _plain_linear(noisy))


class Fp32Donor:
    """The reference as a swap donor whose modules run in float32 (fresh copies: a planted
    noise put on them never touches the reference)."""

    dtype = torch.float32

    def __init__(self, ref):
        self.ref = ref
        self.model = ref.model  # causal mask and rotary embedding for the adapters
        self.arch = ref.arch  # where the family keeps them

    def module(self, name: str) -> nn.Module:
        return copy.deepcopy(self.ref.module(name)).float()


class VLLMModel(Backend):
    """The vLLM side of the backend interface for a model in this process."""

    kind = "vllm"
    module_names = "vllm"

    @classmethod
    def of(cls, model: nn.Module, dtype: str) -> VLLMModel:
        """A backend view of a bare vLLM model (in a worker): no engine, no forward."""
        self = cls.__new__(cls)
        self.model = model
        self.dtype_name, self.dtype = dtype, parse_dtype(dtype)
        self.config = model.config
        self.arch = arch_for(self.config)
        self.units = self.arch.units(self.config)
        self.unit_by_name = {u.name: u for u in self.units}
        return self

    @property
    def root(self):
        return self.model

    def swap_unit(self, unit, donor, ledger: Ledger) -> None:
        ref = donor.module(unit.name)
        if unit.kind == "router":
            moe.swap_router(self, unit, ref, donor.dtype, ledger)
            return
        if unit.kind == "experts":
            moe.swap_experts(self, unit, ref, donor.dtype, ledger)
            return
        if unit.kind == "shared_expert" and moe.gated_shared(self.module(unit.name)):
            adapter = VllmGatedShared(ref, donor, self.dtype, self.module(unit.parent))
        else:
            adapter = (ADAPTERS.get(f"{unit.kind}@{unit.variant}") or ADAPTERS[unit.kind])(ref, donor, self.dtype)
        old = ledger.replace(self.root, self.module_path(unit.name), adapter)
        if unit.kind == "layer":
            adapter.keep_flags(old)
        elif unit.kind == "shared_expert":
            moe.swap_shared(self, unit, adapter, ledger)
        elif unit.kind == "shared_expert_gate":
            moe.swap_shared_gate(self, unit, adapter, ledger)

    def plant_fault(self, fault, ledger: Ledger) -> None:
        unit = self.unit(fault.unit)
        if fault.kind == "moe_combine":
            moe.plant_combine(self, fault.unit if unit.kind == "moe" else unit.parent, fault.dtype, ledger)
        elif fault.kind == "output_noise" and unit.kind == "experts":
            moe.plant_routed_noise(self, fault, ledger)
        elif fault.kind == "weight_noise" and unit.kind == "experts":
            # The runner also holds the router's gate and the shared expert (units of their own).
            plant_weight_noise_cpu(moe.runner(self, unit.parent).routed_experts, fault, ledger)
        elif fault.kind == "weight_noise":
            mod = self.module(fault.unit)
            if unit.kind == "lm_head" and not any(p.numel() for p in mod.parameters()):
                # vLLM's logits processor holds no weights: it is handed the model's lm_head
                mod = getattr(self.root, "lm_head", mod)
            if not any(p.is_floating_point() for p in mod.parameters()):
                raise self.lacks(f"plant weight_noise at {fault.unit}: its module holds no weights")
            plant_weight_noise_cpu(mod, fault, ledger)
        else:
            super().plant_fault(fault, ledger)

    def install_routing_probe(self, probe, ledger: Ledger) -> None:
        moe.install_probe(self, probe, ledger)

    def install_state_probe(self, probe, ledger: Ledger) -> None:
        from numbisect.backends.vllm import (  # lazy: import cycle (numbisect.backends.vllm imports numbisect.backends.vllm.model at load)
            recurrent,  # lazy: import cycle (numbisect.backends.vllm imports numbisect.backends.vllm.model at load)
        )

        recurrent.install_probe(self, probe, ledger)

    def install_whatif(self, whatif: str, unit, donor, faults, ledger: Ledger) -> list:
        """The what-if in place over the planted `faults`; returns those to plant again on top."""
        if whatif == WHATIF_WSUM:
            block = unit.name if unit.kind == "moe" else unit.parent
            moe.slot_sum_whatif(self, block, ledger)  # replaces a planted output noise on the routed sum
            return [f for f in faults if f.kind == "output_noise" and f.unit == block + ".experts"]
        if whatif != WHATIF_UNIT:
            raise self.lacks(f"run the precision what-if {whatif!r}")
        self.swap_unit(unit, Fp32Donor(donor), ledger)  # the reference's module in float32
        return [f for f in faults if f.unit == unit.name and f.kind == "output_noise"]

    def whatif_not_carried(self, whatif: str, unit, faults) -> list[str]:
        if whatif != WHATIF_UNIT:
            return []
        return [f.spec for f in faults if f.kind not in PRECISION_FAULTS and _inside(f.unit, unit.name)
                and not (f.kind == "output_noise" and f.unit == unit.name)]


# -- a swap rebuilt from data, where the engine's model lives ---------------------------------
_DONORS: dict = {}
_VIEW = VIEW_KEY = "_numbisect_engine"  # model.__dict__ key: the VLLMModel view of a worker's model
_SWAPS = "_numbisect_swaps"  # model.__dict__ key: the ledger of the swaps in force


def view(model: nn.Module, dtype: str) -> VLLMModel:
    """The (one) VLLMModel view of a bare vLLM model in this process."""
    engine = model.__dict__.get(_VIEW) or VLLMModel.of(model, dtype)
    model.__dict__[_VIEW] = engine
    return engine


def apply_swap_spec(model: nn.Module, spec, engine_dtype: str) -> list[str]:
    """Rebuild `spec` (a numbisect.patching.swap.SwapSpec) on a vLLM model in this process (an engine
    worker): load the donor from its checkpoint once per process, then swap (earlier swaps
    undone). Pass it to `llm.apply_model` as `functools.partial(apply_swap_spec, spec=spec,
    engine_dtype=...)`: it pickles, so it reaches workers of a multi-process engine too.
    Returns the units swapped."""
    donor = donor_of(spec.donor_path, spec.donor_dtype)
    undo_swap_spec(model)
    engine = view(model, engine_dtype)
    ledger = Ledger()
    model.__dict__[_SWAPS] = ledger
    apply_swaps(engine, donor, list(spec.units), ledger)
    return expand(engine, list(spec.units))


def donor_of(path: str, dtype: str):
    """The reference as a donor in this process (an engine worker): loaded from its checkpoint
    once per (path, dtype)."""
    key = (path, dtype)
    if key not in _DONORS:
        _DONORS[key] = HFBackend(path, dtype)
    return _DONORS[key]


def forget_donor(path: str) -> None:
    """Drop the donors `donor_of` loaded from `path` in this process (a temporary checkpoint)."""
    for key in [k for k in _DONORS if k[0] == path]:
        del _DONORS[key]


def swap_ledger(model: nn.Module) -> Ledger | None:
    """The ledger of the swaps `apply_swap_spec` made in this process (None: none)."""
    return model.__dict__.get(_SWAPS)


def undo_swap_spec(model: nn.Module) -> None:
    """Put back what `apply_swap_spec` replaced in this process."""
    ledger = model.__dict__.pop(_SWAPS, None)
    if ledger is not None:
        ledger.undo()

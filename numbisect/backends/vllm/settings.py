"""A running `vllm.LLM`'s settings, as numbisect reads them, never changes them.

`settings(llm)` reads what numbisect depends on; `reach(llm)` reads them and refuses an
engine numbisect cannot reach (`Unreachable`: shut down already, `closed`; not a
`vllm.LLM`; an engine in worker processes without VLLM_ALLOW_INSECURE_SERIALIZATION=1);
`hooks_problem(settings)` says, in one line naming the setting and what would work, why
forward hooks cannot give a right answer on it, or None when they can:

1. compiled (CUDA graphs or torch.compile): forward hooks never fire (`enforce_eager=True`);
2. prefix caching on: a sample whose prefix was cached runs only its tail, so captures are
   partial, and a swap trial's keys and values would stay cached for the user's requests
   (`enable_prefix_caching=False`); what such an engine reuses after a weight sync is
   checked without hooks (numbisect.backends.vllm.prefix_cache, numbisect.live.prefix);
3. log-probs other than raw (`logprobs_mode="raw_logprobs"`).

An engine whose model lives in worker processes (V1 multiprocessing, vLLM's default, or
tensor parallel) is reached through `apply_model` with functions its workers import
(`is_module` here; numbisect.backends.vllm.tp, `VLLMTPBackend.of`). numbisect.live.engine
turns `Unreachable` into its typed errors.
"""

from __future__ import annotations

import torch

from numbisect.common.errors import InputError, exception_line

WHAT_WORKS = "start it with LLM(..., enforce_eager=True, enable_prefix_caching=False)"


class Unreachable(InputError):
    """The engine cannot be reached: shut down (`closed`), or not reachable as started."""

    def __init__(self, message: str, closed: bool = False):
        super().__init__(message)
        self.closed = closed


def settings(llm) -> dict:
    """The engine settings numbisect depends on, as the engine holds them."""
    cfg = llm.llm_engine.vllm_config
    return {
        "enforce_eager": bool(cfg.model_config.enforce_eager),
        "enable_prefix_caching": bool(cfg.cache_config.enable_prefix_caching),
        "logprobs_mode": str(getattr(cfg.model_config, "logprobs_mode", "raw_logprobs")),
        "tensor_parallel_size": int(cfg.parallel_config.tensor_parallel_size),
        "dtype": str(cfg.model_config.dtype).removeprefix("torch."),
        "max_model_len": int(cfg.model_config.max_model_len),
    }


def model_config(llm) -> tuple:
    """(the transformers config, the torch dtype) of the model a running engine serves."""
    mc = llm.llm_engine.model_config
    return mc.hf_config, mc.dtype


def is_module(model) -> bool:
    """Run in the engine's worker: whether it holds an nn.Module (a picklable answer)."""
    return isinstance(model, torch.nn.Module)


def in_process_client(llm) -> bool:
    """vLLM's in-process engine core client (VLLM_ENABLE_V1_MULTIPROCESSING=0): functions
    given to `apply_model` run here, unpickled; else they must be importable by a worker."""
    return type(llm.llm_engine.engine_core).__name__ == "InprocClient"


def reach(llm) -> dict:
    """The engine's settings and `in_process` (its model in this process), after refusing an
    engine numbisect cannot reach (`Unreachable`, module doc)."""
    if not hasattr(llm, "llm_engine") or not hasattr(llm, "apply_model"):
        raise Unreachable(f"the engine must be a vllm.LLM, not {type(llm).__name__}")
    try:
        s = settings(llm)
        here = in_process_client(llm) and s["tensor_parallel_size"] == 1  # else in workers (functions pickled)
        models = llm.apply_model(lambda m: m) if here else llm.apply_model(is_module)
    except Exception as e:  # a closed engine core raises on any call
        if "VLLM_ALLOW_INSECURE_SERIALIZATION" in str(e):
            raise Unreachable("the engine runs its model in worker processes, which numbisect reaches with functions "
                              "pickled to them: set VLLM_ALLOW_INSECURE_SERIALIZATION=1 (in the engine's environment "
                              "and this process's)") from None
        raise Unreachable(f"the engine cannot be reached (shut down already?): {exception_line(e)}", closed=True) from None
    if not models:
        raise Unreachable("the engine has no model workers to reach")
    s["in_process"] = isinstance(models[0], torch.nn.Module)
    return s


def hooks_problem(s: dict) -> str | None:
    """Why forward hooks cannot give a right answer on an engine with settings `s` (one
    line naming the setting and what would work), or None when they can (module doc)."""
    if not s["enforce_eager"]:
        return f"the engine is compiled (enforce_eager=False): forward hooks never fire in a compiled model; {WHAT_WORKS}"
    if s["enable_prefix_caching"]:
        return ("the engine has prefix caching on (enable_prefix_caching=True): a sample whose prefix is cached runs "
                f"only its tail, so captures would be partial; {WHAT_WORKS} (whether KV cached before a weight sync is "
                "reused: probe.check_prefix_cache(prompts))")
    if s["logprobs_mode"] != "raw_logprobs":
        return f"the engine returns {s['logprobs_mode']}: numbisect compares raw log-probs (logprobs_mode=\"raw_logprobs\", vLLM's default)"
    return None

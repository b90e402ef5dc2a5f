"""The user's running vLLM engine: its settings checked, read, never changed.

`check_engine(llm)` refuses, in one line naming the setting and what would work, an
engine whose settings would make numbisect's answer partial or wrong:

1. shut down already (`EngineClosedError`);
2. the model in another process (V1 multiprocessing, vLLM's default; tensor parallel):
   the hooks run in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0` before `import vllm`);
3. compiled (CUDA graphs or torch.compile): forward hooks never fire (`enforce_eager=True`);
4. prefix caching on: a sample whose prefix was cached runs only its tail, so captures are
   partial (`enable_prefix_caching=False`);
5. log-probs other than raw (`logprobs_mode="raw_logprobs"`).

Each is an `EngineSettingError`; nothing is set on the engine to make it pass.
"""

from __future__ import annotations

import torch

from numbisect.live.errors import EngineClosedError, EngineSettingError

WHAT_WORKS = "start it with LLM(..., enforce_eager=True, enable_prefix_caching=False) in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)"


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


def check_engine(llm) -> dict:
    """The engine's settings, after refusing those numbisect cannot work under (module doc)."""
    if not hasattr(llm, "llm_engine") or not hasattr(llm, "apply_model"):
        raise EngineSettingError(f"the engine must be a vllm.LLM, not {type(llm).__name__}")
    s = settings(llm)
    if s["tensor_parallel_size"] != 1:
        raise EngineSettingError(f"the engine runs tensor_parallel_size={s['tensor_parallel_size']}: attach works on a "
                                 f"single in-process engine so far; {WHAT_WORKS}")
    try:
        models = llm.apply_model(lambda m: m)
    except Exception as e:  # a closed engine core raises on any call
        raise EngineClosedError(f"the engine cannot be reached (shut down already?): {type(e).__name__}: "
                                f"{str(e).splitlines()[0] if str(e) else ''}") from None
    if not models or not isinstance(models[0], torch.nn.Module):
        raise EngineSettingError("the engine runs its model in another process (V1 multiprocessing, vLLM's default): "
                                 f"numbisect's hooks need it here; {WHAT_WORKS}")
    if not s["enforce_eager"]:
        raise EngineSettingError("the engine is compiled (enforce_eager=False): forward hooks never fire in a compiled "
                                 f"model, so no unit could be captured; {WHAT_WORKS}")
    if s["enable_prefix_caching"]:
        raise EngineSettingError("the engine has prefix caching on (enable_prefix_caching=True): a sample whose prefix is "
                                 f"cached runs only its tail, so captures would be partial; {WHAT_WORKS}")
    if s["logprobs_mode"] != "raw_logprobs":
        raise EngineSettingError(f"the engine returns {s['logprobs_mode']}: numbisect compares raw log-probs "
                                 "(start it with logprobs_mode=\"raw_logprobs\", vLLM's default)")
    return s

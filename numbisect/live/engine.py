"""The user's running engine: its settings checked, read, never changed.

The engine kind numbisect.live attaches to is the registry's (`numbisect.backends.weights_kind`,
"engine": vLLM); `ENGINE` is what this layer reaches of it, through the registry
(`numbisect.backends.services`: numbisect.backends.vllm.services). Its settings are read
and judged there (numbisect.backends.vllm.settings: `settings`, `hooks_problem`, the
settings under which forward hooks cannot give a right answer); here they become the live
API's typed errors:

- `check_engine(llm)`: the settings and `in_process`, after refusing an engine numbisect
  cannot reach (`EngineClosedError`: shut down already; `EngineSettingError`: not a
  `vllm.LLM`, or an engine in worker processes without VLLM_ALLOW_INSECURE_SERIALIZATION=1);
- `refuse_hooks(settings)`: `EngineSettingError` with `hooks_problem`'s line.

An engine whose hooks cannot give a right answer can still have its weights checked tensor
by tensor (numbisect.live.weights) and its prefix cache after a sync (numbisect.live.prefix);
a comparison on it is refused with that line. Nothing is set on the engine to make it pass.
"""

from __future__ import annotations

from numbisect.backends import services, weights_kind
from numbisect.live.errors import EngineClosedError, EngineSettingError

KIND = weights_kind("engine")  # the registered kind a running engine is wrapped as
ENGINE = services(KIND)  # what numbisect.live reaches of it (numbisect.backends.protocols.EngineServices)
REFERENCE_KIND = weights_kind("reference")  # the registered kind a trainer's model is wrapped as
REFERENCE = services(REFERENCE_KIND)  # (numbisect.backends.protocols.ReferenceServices)

WHAT_WORKS = ENGINE.WHAT_WORKS
settings = ENGINE.settings  # the engine settings numbisect depends on, as the engine holds them
hooks_problem = ENGINE.hooks_problem  # why forward hooks cannot give a right answer on these settings, or None


def check_engine(llm) -> dict:
    """The engine's settings and `in_process`, after refusing an engine numbisect cannot reach."""
    try:
        return ENGINE.reach(llm)
    except ENGINE.Unreachable as e:
        raise (EngineClosedError if e.closed else EngineSettingError)(e.message) from None


def refuse_hooks(s: dict) -> None:
    problem = hooks_problem(s)
    if problem:
        raise EngineSettingError(problem)

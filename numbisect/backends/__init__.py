"""Backends: each a way to run a model over a token trace (DESIGN.md, "Backend").

- `base.py`: the interface every backend implements and the hook machinery they share.
- `options.py`: `--ref-opt` / `--engine-opt` parsing and checks (torch-free).
- `hf.py` (transformers), `vllm.py` (in-process vLLM; `vllm_force.py` forces decode
  tokens, `vllm_tp.py` runs tensor-parallel workers), `dump.py` (activations an engine
  wrote), `steps.py` (decode steps back into token order).
- This module is the registry: `BACKENDS` maps a backend name to its loader, so adding
  a backend is one line here. Loaders import their backend on first use (torch,
  transformers and vLLM load only then).

Backends sit under the search: nothing here imports numbisect.search, run, session or
selftest (tests/test_layering.py checks it).
"""

from __future__ import annotations

from numbisect.backends.options import check_opts
from numbisect.errors import InputError


def _hf(path: str, dtype: str, opts: dict):
    from numbisect.backends.hf import HFBackend

    if "layer_stream" in opts:
        raise InputError("layer_stream=true needs --engine dump:DIR (the layers' inputs come from the dump)")
    return HFBackend(path, dtype, **opts)


def _vllm(path: str, dtype: str, opts: dict):
    if opts.get("tensor_parallel_size", 1) > 1:  # the model lives in worker processes
        from numbisect.backends.vllm_tp import VLLMTPBackend

        return VLLMTPBackend(path, dtype, **opts)
    from numbisect.backends.vllm import VLLMBackend

    return VLLMBackend(path, dtype, **opts)


# Backend name (the KIND of `--ref KIND:DIR` / `--engine KIND:DIR`) -> loader(path, dtype, opts).
BACKENDS = {"hf": _hf, "vllm": _vllm}


def open_backend(kind: str, path: str, dtype: str, opts: dict, what: str | None = None):
    """A backend of `kind` on `path`; `opts` checked first (`check_opts`, under the option
    name `what`: --ref-opt or --engine-opt). An unknown `kind` is an InputError naming the
    known ones."""
    if kind not in BACKENDS:
        raise InputError(f"unknown backend {kind!r}; known: {', '.join(BACKENDS)}")
    check_opts(kind, opts, what or ("--engine-opt" if kind == "vllm" else "--ref-opt"))
    return BACKENDS[kind](path, dtype, opts)

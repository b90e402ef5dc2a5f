"""What the layers above reach of an engine kind beyond running a model (a `Backend`):
the protocols a registry entry's `services` module implements (numbisect.backends,
`Registered.services`, opened by `services(kind)` on first use). Outside numbisect/backends/
nothing imports a backend's folder; numbisect.live, the session and the commands reach an
engine kind through these.

- `ReferenceServices`: a trainer's model in memory wrapped as the reference (`of`).
- `EngineServices`: a running engine as numbisect.live reads it (wrapped, its settings,
  its weights read back and pushed in, its prefix cache, the cold engine of the
  warm-vs-cold oracle) and the engine's child processes (`run_child`: the user's engine
  configuration, `bisect conditions`).

Torch-free and backend-free: this module only names what is offered (tests/backends/
test_registry.py checks each registered services module defines every member).
"""

from __future__ import annotations

from typing import Any, Callable, Protocol


class ReferenceServices(Protocol):
    of: Callable[..., Any]  # (model) -> Backend: a model already in memory, loaded from nothing, changed in nothing


class EngineServices(Protocol):
    # a running engine wrapped
    of: Callable[..., Any]  # (llm) -> Backend: its model in this process
    of_workers: Callable[..., Any]  # (llm) -> Backend: its model in worker processes
    in_process_model: Callable[..., Any]  # (llm) -> its model (nn.Module) in this process
    # its settings
    WHAT_WORKS: str  # the settings under which hooks give a right answer, as a sentence
    Unreachable: type  # InputError `reach` raises (`closed`: shut down already)
    settings: Callable[..., dict]  # (llm) -> the settings numbisect depends on
    reach: Callable[..., dict]  # (llm) -> settings and `in_process`, or Unreachable
    hooks_problem: Callable[..., Any]  # (settings) -> why hooks cannot give a right answer (one line) or None
    in_process_client: Callable[..., bool]  # (llm) -> functions given to it run in this process, unpickled
    model_config: Callable[..., tuple]  # (llm) -> (transformers config, torch dtype) of its model
    # its weights, read back in the checkpoint's names
    FUSED: dict  # fused parameter leaf -> the checkpoint parts it holds
    UnitReader: type  # one unit's tensors at a time
    unit_reader: Callable[..., Any]  # (shapes, arch, config, *, model=None, llm=None) -> UnitReader
    reader_digests: Callable[..., dict]  # (UnitReader) -> name -> digest
    engine_tensors: Callable[..., dict]  # (model, shapes) -> name -> tensor (in this process)
    remote_tensors: Callable[..., dict]  # (llm, shapes) -> name -> tensor (from its workers)
    engine_dtypes: Callable[..., dict]  # (model, shapes, dtype) -> the tensors it holds in another dtype
    remote_dtypes: Callable[..., dict]  # (llm, shapes, dtype) -> the same, from its workers
    base_name: Callable[..., str]  # a LoRA engine's parameter name -> the base model's
    # its LoRA slots, and decoding with an adapter
    lora_slot: Callable[..., dict]  # (llm, lora_int_id) -> the slot's A and B slices per module
    load_lora: Callable[..., Any]  # (llm, lora_int_id, tensors, cfg, name) -> the request that generates with it
    greedy_logprobs: Callable[..., list]  # (llm, prompts, tokens, lora_request=None) -> (token ids, log-probs) each
    # its weights, pushed in (a sync as RL frameworks make it) and its reload's fixes
    HOW: tuple
    push: Callable[..., int]
    load_into: Callable[..., int]
    reload_in_worker: Callable[..., int]
    reload_problem: Callable[..., Any]
    repack_cpu_moe: Callable[..., int]
    restore_kv_b: Callable[..., int]
    unfinished: Callable[..., int]
    undo_unfinished: Callable[..., int]
    unfinished_reload: Callable[..., int]
    undo_unfinished_reload: Callable[..., int]
    # its prefix cache
    cache_settings: Callable[..., dict]  # (llm) -> enabled, block_size, vocab, max_logprobs
    next_token_logprobs: Callable[..., list]  # (llm, prompts, top, salt=None) -> (cached tokens, top log-probs) each
    # its weight-transfer API (an in-process transport) and the pushes made through it
    TRANSFER_BACKEND: str
    register_transfer: Callable[[], str]
    transfer_send: Callable[..., dict]
    transfer_push: Callable[..., None]  # (llm, items, version=None, chunks=1)
    watch_pushes: Callable[..., None]  # (llm): a ledger of every push in each worker
    weight_version: Callable[..., Any]  # (llm) -> its weight version, or None
    last_session: Callable[..., Any]  # (llm) -> the last push a watched engine recorded, or None
    # the cold engine (the warm-vs-cold oracle) and the digests both engines answer
    load_cold: Callable[..., dict]  # (job, timeout) -> the cold engine's answer, from a child process
    raw_digests: Callable[..., dict]
    rank_raw_digests: Callable[..., str]
    merge_raw: Callable[..., dict]
    rank_names: Callable[..., dict]
    param_names: Callable[..., dict]
    warm_raw: Callable[..., tuple]  # (llm, shapes) -> the running engine's `merge_raw` table and its checkpoint names
    # child processes
    run_child: Callable[..., Any]  # (job, what, timeout=None, module=...) -> its answer
    shutdown_children: Callable[[], None]  # the fork server the children came from, ended
    # faults planted for an engine's life, and the engine's own check of its settings
    FAULT_ENV: str
    fault_env_value: Callable[..., str]
    planted_faults: Callable[..., list]  # (model) -> the specs planted in it (run in its workers)
    planted_in: Callable[..., list]  # (llm) -> the specs planted in a running engine, every worker's; [] when unknown
    check_with_vllm: Callable[..., None]  # (settings, where, model_dir) -> None, or InputError naming the setting


def members(protocol: type) -> list[str]:
    """The names a services module must define to implement `protocol`."""
    return sorted(protocol.__annotations__)

"""What the layers above reach of the vllm engine kind beyond a Backend: its
`EngineServices` (numbisect.backends.protocols), opened through the registry
(`numbisect.backends.services(kind)`, the entry's `services`). Each name is defined in
the module of this folder named for what it does; this module only gathers them.

- a running `vllm.LLM` wrapped (`of`, `of_workers`: numbisect.backends.vllm.runner, .tp),
  its model in this process (`in_process_model`);
- its settings (numbisect.backends.vllm.settings);
- its weights read back in the checkpoint's names (numbisect.backends.vllm.readback) and
  pushed in, its reload's fixes (numbisect.backends.vllm.reload, .cpu_mla);
- its prefix cache (numbisect.backends.vllm.prefix_cache);
- its weight-transfer API, an in-process transport and the pushes made through it
  (numbisect.backends.vllm.transfer);
- the cold engine of the warm-vs-cold oracle (numbisect.backends.vllm.cold), the child
  runner every vLLM child goes through (numbisect.backends.vllm.child) and the fork server
  they come from (`shutdown_children`);
- the faults planted for an engine's life (numbisect.backends.vllm.enginefault), a LoRA
  engine's names and slots (numbisect.backends.vllm.lora_names, .lora_slots), vLLM's own check of engine settings
  (numbisect.backends.vllm.validate).
"""

from __future__ import annotations

from numbisect.backends.vllm import forkserver
from numbisect.backends.vllm.child import run_child
from numbisect.backends.vllm.cold import (
    load_cold,
    merge_raw,
    param_names,
    rank_names,
    rank_raw_digests,
    raw_digests,
    warm_raw,
)
from numbisect.backends.vllm.cpu_mla import restore_kv_b
from numbisect.backends.vllm.enginefault import ENV as FAULT_ENV
from numbisect.backends.vllm.enginefault import env_value as fault_env_value
from numbisect.backends.vllm.enginefault import planted as planted_faults
from numbisect.backends.vllm.enginefault import planted_in
from numbisect.backends.vllm.lora_names import base_name
from numbisect.backends.vllm.lora_slots import greedy_logprobs, load_lora, lora_slot
from numbisect.backends.vllm.prefix_cache import cache_settings, next_token_logprobs
from numbisect.backends.vllm.readback import (
    FUSED,
    UnitReader,
    engine_dtypes,
    engine_tensors,
    reader_digests,
    remote_dtypes,
    remote_tensors,
    unit_reader,
)
from numbisect.backends.vllm.reload import (
    HOW,
    load_into,
    push,
    reload_in_worker,
    reload_problem,
    repack_cpu_moe,
    undo_unfinished,
    undo_unfinished_reload,
    unfinished,
    unfinished_reload,
)
from numbisect.backends.vllm.runner import VLLMBackend, in_process_model
from numbisect.backends.vllm.settings import (
    WHAT_WORKS,
    Unreachable,
    hooks_problem,
    in_process_client,
    model_config,
    reach,
    settings,
)
from numbisect.backends.vllm.tp import VLLMTPBackend
from numbisect.backends.vllm.transfer import BACKEND as TRANSFER_BACKEND
from numbisect.backends.vllm.transfer import last_session, weight_version
from numbisect.backends.vllm.transfer import push as transfer_push
from numbisect.backends.vllm.transfer import register as register_transfer
from numbisect.backends.vllm.transfer import send as transfer_send
from numbisect.backends.vllm.transfer import watch as watch_pushes
from numbisect.backends.vllm.validate import check_with_vllm

of = VLLMBackend.of  # a backend on a running engine whose model is in this process
of_workers = VLLMTPBackend.of  # one whose model lives in worker processes (V1 multiprocessing, tensor parallel)
shutdown_children = forkserver.shutdown  # the fork server the children came from, ended

__all__ = [
    "FAULT_ENV", "FUSED", "HOW", "Unreachable", "UnitReader", "WHAT_WORKS", "base_name", "cache_settings", "check_with_vllm",
    "engine_dtypes", "engine_tensors", "fault_env_value", "hooks_problem", "in_process_client", "in_process_model", "load_cold",
    "load_into", "merge_raw", "model_config", "next_token_logprobs", "of", "of_workers", "param_names", "planted_faults",
    "push", "rank_names", "rank_raw_digests", "raw_digests", "reach", "reader_digests", "reload_in_worker", "reload_problem",
    "remote_tensors", "repack_cpu_moe", "restore_kv_b", "run_child", "settings", "shutdown_children", "undo_unfinished",
    "undo_unfinished_reload", "unfinished", "unfinished_reload", "unit_reader",
    "lora_slot", "load_lora", "greedy_logprobs", "planted_in", "remote_dtypes", "warm_raw",
    "TRANSFER_BACKEND", "register_transfer", "transfer_send", "transfer_push", "watch_pushes", "weight_version", "last_session",
]

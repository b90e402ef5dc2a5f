"""The recurrent-state probe (numbisect.patching.probes.state.StateProbe) on a transformers model.

transformers' Gated DeltaNet modules (Qwen3.5-MoE's `Qwen3_5MoeGatedDeltaNet`, Qwen3-Next's
`Qwen3NextGatedDeltaNet`) run a prefill through their modeling file's module-level
`torch_chunk_gated_delta_rule` (or the kernel it resolved to), which returns the final
state only when asked (`output_final_state`, set when a cache is in use). The probe puts a
wrapper in that name for one forward: it asks for the final state, hands it to the probe
under the unit whose module is running (a pre-hook on each linear unit says which), and
returns to the module exactly what it asked for. A decode step with a cache runs the
module's `torch_recurrent_gated_delta_rule` instead: wrapped the same way, so decode mode's
states after each step are read too. The computation is unchanged: asking for
the state only keeps a tensor the function computes anyway.
"""

from __future__ import annotations

import sys

from numbisect.common.errors import BackendError
from numbisect.patching.ledger import Ledger

CHUNK_FN = "torch_chunk_gated_delta_rule"
STEP_FN = "torch_recurrent_gated_delta_rule"  # a decode step with a cache (one token)


def install_probe(engine, probe, ledger: Ledger) -> None:
    running: list[str] = []  # the linear unit whose module is in its forward
    modules = {}
    for unit in probe.units:
        m = engine.module(unit)
        pymod = sys.modules.get(type(m).__module__)
        if pymod is None or not callable(getattr(pymod, CHUNK_FN, None)):
            raise BackendError(f"{unit}: {type(m).__name__} ({type(m).__module__}) has no {CHUNK_FN} to read its state from")
        modules[pymod.__name__] = pymod

        def pre(mod, args, kwargs, unit=unit):
            running.append(unit)

        def post(mod, args, kwargs, out):
            running.pop()

        ledger.hooks(m, pre=pre, post=post)
    for pymod in modules.values():
        for name in (CHUNK_FN, STEP_FN):
            original = getattr(pymod, name, None)
            if not callable(original):
                continue  # no recurrent step: decode-mode states are not read (prefill is)

            def wrapped(*args, original=original, **kwargs):
                want = kwargs.get("output_final_state", False)
                kwargs["output_final_state"] = True
                out, state = original(*args, **kwargs)
                if running and state is not None:
                    query = args[0] if args else kwargs.get("query")
                    probe.record(running[-1], state, int(query.shape[1]))  # [batch, tokens, heads, dim]
                return out, (state if want else None)

            ledger.setattr(pymod, name, wrapped)
    probe.source = f"transformers {CHUNK_FN} final state (float32; a decode step's: {STEP_FN})"

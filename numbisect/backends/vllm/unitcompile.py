"""Each unit compiled alone: what vLLM's compiled path changes, unit by unit (`bisect conditions`).

Module hooks cannot see inside vLLM's compiled graph, so a guilty `compiled` atom is
localised in numbisect's eager engine instead: each leaf unit's `forward` (a unit with no
unit inside it: norms, attention, router, experts, lm_head ...; an attention with sub-units
whole, `leaf_units`) is replaced by its
`torch.compile` with inductor and the inductor options vLLM-CPU's compiled mode sets,
the token dimension of its tensor arguments dynamic as in vLLM's graph. Hooks stay on the
module's `__call__`, outside the compiled code, so feeding and capturing work as in eager.

What it approximates: vLLM compiles the whole model as one graph, so fusions across unit
boundaries (a norm into the next projection, a residual add into a norm) and the glue
between units (a layer's residual adds, a MoE block's sum of shared and routed experts) are
not compiled here; the graph passes vLLM adds (its fusion pass manager) are not run. How
much that leaves out is measured: the engine run with every leaf unit compiled, chained on
its own inputs, gives token log-probs whose k3 against the eager run is set beside the
compiled path's own k3 (`numbisect.commands.conditions.localise_compiled`).

`fullgraph=True`: a unit dynamo cannot capture whole raises instead of running parts of
it eagerly (which would read as "bitwise equal"). Each layer's unit is its own module
instance of one class, so the recompile limits are raised for the process (the capture
child, which exists for this).
"""

from __future__ import annotations

import time

import torch

from numbisect.model.units import local_feed_names

# vllm/platforms/cpu.py (0.32.0): compilation_config.inductor_compile_config in compiled mode.
INDUCTOR_OPTIONS = {"dce": True, "size_asserts": False, "nan_asserts": False, "epilogue_fusion": True,
                    "cpp.dynamic_threads": True}


def leaf_units(units) -> list[str]:
    """The units compiled: those with no other unit inside them (`layers.0.attn`, not
    `layers.0`), except that an attention with sub-units (MLA's rope, GLM-5's indexer, the
    Gated DeltaNet's conv, gates, output gate and projection) is compiled whole, its sub-units traced
    into it: its own code (projections, the attention or recurrence core) is more than its
    sub-units, as a MoE block's is not (router, experts, shared expert and their sum)."""
    by_name = {u.name: u for u in units}
    out = []
    for u in units:
        if any(m != u.name and m.startswith(u.name + ".") for m in by_name):
            if u.kind != "attn":
                continue
        elif by_name.get(u.parent) is not None and by_name[u.parent].kind == "attn":
            continue  # inside a compiled attention
        out.append(u.name)
    return out


def _token_dim_dynamic(fn):
    """`fn` called with dim 0 (the tokens) of each tensor argument marked dynamic, as vLLM
    compiles for any number of tokens; a size-1 dimension stays static (dynamo's rule). A
    unit called inside another one's compiled code (vLLM's MoE runner calls its router) is
    traced into that code: nothing to mark there."""

    def call(*args, **kwargs):
        for a in () if torch.compiler.is_compiling() else (*args, *kwargs.values()):
            if isinstance(a, torch.Tensor) and a.dim() and a.shape[0] > 1:
                torch._dynamo.maybe_mark_dynamic(a, 0)
        return fn(*args, **kwargs)

    return call


def compile_units(backend, names: list[str]) -> None:
    """Replace each unit's `forward` by its inductor compile (compiled on first call)."""
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64 * max(1, len(names)))
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit,
                                                           256 * max(1, len(names)))
    for name in names:
        mod = backend.module(name)
        mod.forward = _token_dim_dynamic(torch.compile(mod.forward, backend="inductor", fullgraph=True,
                                                       options=dict(INDUCTOR_OPTIONS)))


def eager_and_compiled(backend, samples) -> dict:
    """Every unit's input captured (eager), then every unit fed those inputs eager and with
    each leaf unit compiled: {"eager", "compiled"} (unit -> per-sample local output),
    "compiled_units", "compile_seconds" (the first compiled forward, compiles included).
    Then the engine run on its own inputs with every leaf compiled (nothing fed): its token
    log-probs ("chained_logprobs") against the eager run's ("eager_logprobs") say how much
    of the compiled path the units compiled alone reproduce; the rest is across them."""
    names = [u.name for u in backend.units]
    first = backend.forward(samples, capture=names, capture_inputs=local_feed_names(backend))
    eager = backend.forward(samples, capture=names, feed=first.inputs)
    leaves = leaf_units(backend.units)
    compile_units(backend, leaves)
    start = time.perf_counter()
    compiled = backend.forward(samples, capture=names, feed=first.inputs)
    seconds = time.perf_counter() - start
    chained = backend.forward(samples)
    return {"eager": eager.captures, "compiled": compiled.captures, "compiled_units": leaves,
            "compile_seconds": seconds, "eager_logprobs": [t.float() for t in first.token_logprobs],
            "chained_logprobs": [t.float() for t in chained.token_logprobs]}

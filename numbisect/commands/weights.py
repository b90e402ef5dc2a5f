"""`bisect weights`: per unit, whether an engine (vLLM's) computes with the reference's weights.

1. Before anything loads: the two specs (kinds the registry lets play each part: hf:DIR
   and vllm:DIR), the trace (if given), both
   configs (a family numbisect knows, the same sizes).
2. `attach` (numbisect.live.attach, handed in by the caller: the weight check is the live
   API's, a layer above the commands) loads the reference and starts the engine from the
   two directories.
3. `Probe.check_weights` reads every engine tensor back in the checkpoint's names and
   compares it with the reference's, and feeds each unit the reference's inputs on the
   trace (default: a few random sequences); `Probe.weights_report` makes the report
   (kind "weights"). The probe is closed before this returns.
"""

from __future__ import annotations

from numbisect.backends import require_weights
from numbisect.backends.base import load_config
from numbisect.model.arch import arch_for
from numbisect.model.rlformats import load_any
from numbisect.pipeline.measure import check_configs, parse_spec


def weights(ref: str, engine: str, trace: str | None, *, ref_dtype: str, engine_dtype: str, argv: list[str], attach,
            progress=lambda m: None):
    """(the report, the weight check: its `lines()` and `ok`) of `ref` ("hf:DIR") against
    `engine` ("vllm:DIR"); bad input is one InputError before anything loads."""
    ref_kind, ref_path = parse_spec(ref, "--ref")
    eng_kind, eng_path = parse_spec(engine, "--engine")
    require_weights(ref_kind, ref, "reference")  # the kinds that can play each part, from the registry
    require_weights(eng_kind, engine, "engine")
    samples = load_any(trace, None, None) if trace else None  # bad input refused before anything loads
    configs = [load_config(path) for path in (ref_path, eng_path)]
    for config in configs:  # a family numbisect does not know, named before the two disagree on sizes
        arch_for(config)
    check_configs(*configs)  # before anything loads
    progress(f"loading reference {ref_kind}:{ref_path} and starting engine {eng_kind}:{eng_path}")
    probe = attach(reference=ref_path, engine=eng_path, ref_dtype=ref_dtype, engine_dtype=engine_dtype,
                   ref_kind=ref_kind, engine_kind=eng_kind)
    try:
        progress("checking the engine's weights, unit by unit")
        check = probe.check_weights(samples=samples, step="cold load")
        return probe.weights_report(check, argv).report, check
    finally:
        probe.close()

"""`bisect replay BUNDLE`: `bisect compare` on a replay bundle's batch, offline.

The caller reads the bundle (numbisect.live.bundle: `load`, `replay_inputs`, a layer
above the commands) and hands over what it names, typed:

1. `plant_faults`: the faults the live engine had planted for its life
   (NUMBISECT_ENGINE_FAULT), planted again in every engine of the replay, before any
   compiles.
2. `replay`: the comparison (numbisect.commands.compare) of the bundle's reference
   weights with vLLM on the engine's weights as read back, in the live engine's settings
   (the bundle's engine.json, as --engine-config), at the live comparison's threshold.
3. `record`: whether the replay names the bundle's finding (`match`:
   numbisect.live.bundle.reproduced), as the report's `replay` section and one line; a
   match that fails is recorded, never loses the report.
"""

from __future__ import annotations

import os
import traceback

from numbisect.backends import services
from numbisect.commands.compare import compare
from numbisect.common.textsafe import clip
from numbisect.pipeline.measure import Settings
from numbisect.session.session import Spec

DEFAULT_THRESHOLD = 1e-3  # a bundle that recorded none: `bisect compare`'s default


def plant_faults(engine: str, faults: list[str]) -> tuple[str, str]:
    """Plant `faults` in every engine of `engine`'s kind (the bundle's "vllm:DIR") this
    process starts: (the variable, its value) (numbisect.backends.vllm.enginefault)."""
    eng = services(engine.partition(":")[0])
    os.environ[eng.FAULT_ENV] = eng.fault_env_value(faults)
    return eng.FAULT_ENV, os.environ[eng.FAULT_ENV]


def replay(*, ref: str, engine: str, trace: str, ref_dtype: str, engine_dtype: str, engine_config: dict | None,
           engine_config_path: str | None, threshold: float | None, argv: list[str], progress=None) -> dict:
    """The compare report of the bundle's batch. `engine_config`: the live engine's
    settings as checked (`engine_config_path` the file they came from)."""
    spec = Spec(ref=ref, engine=engine, trace=trace, ref_dtype=ref_dtype, engine_dtype=engine_dtype)
    if engine_config:
        spec.engine_config, spec.engine_config_path = engine_config, engine_config_path
    settings = Settings(threshold=DEFAULT_THRESHOLD if threshold is None else threshold)
    return compare(spec, settings, local=True, argv=argv, progress=progress)


def record(report: dict, bundle: str, finding: dict, match) -> str:
    """Add `replay` (the bundle, whether the replay reproduced its finding, the finding) to
    `report`, in place; the line that says so. `match(report) -> (reproduced, line)`."""
    try:  # the replay ran: a late step that fails is recorded, never loses the report
        same, line = match(report)
    except Exception as e:
        if os.environ.get("NUMBISECT_DEBUG"):
            traceback.print_exc()
        same, line = None, f"replay: could not be matched with the bundle's finding ({type(e).__name__}: {clip(str(e), 200)})"
    report["replay"] = {"bundle": bundle, "reproduced": same, "bundle_finding": {k: v for k, v in finding.items() if k != "weights_summary"}}
    return line


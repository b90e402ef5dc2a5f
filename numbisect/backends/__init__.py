"""Backends: each a way to run a model over a token trace (docs/design.md, "Backend").

- `base.py`: the interface every backend implements (`Backend`) and what they share
  (the ledger, fault arithmetic and module helpers live a layer below, in
  numbisect.patching); `options.py`: `--ref-opt` / `--engine-opt` parsing and per-backend
  checks (torch-free); `steps.py`: decode steps back into token order; `mla_rope.py`:
  MLA's rotary part as a unit.
- One folder per engine, holding its runner, swap adapters, faults, routing probe and
  precision what-ifs: `hf/` (transformers), `vllm/` (in-process vLLM, forced decoding,
  tensor-parallel workers), `dump/` (activations an engine wrote).
- This module is the registry: `BACKENDS` maps a backend name (the KIND of `--ref
  KIND:DIR` / `--engine KIND:DIR`) to a `Registered` entry, so adding a backend is one
  folder (or one class) plus one line here. An entry names its loader as
  "module:function", imported on first use: torch, transformers and vLLM load only then,
  and the registry imports no backend (the core modules that read it, compare, decode
  and routing, form no import cycle with the backends they open).
- What the layers above need of an engine kind beyond a `Backend` (numbisect.live's
  read-back, reload, settings, prefix cache, cold engine; the session's child runner) is
  its entry's `services` module, opened by `services(kind)` on first use: it implements a
  protocol of `protocols.py` (`ReferenceServices`, `EngineServices`). Outside this folder
  nothing imports a backend's folder (`hf/`, `vllm/`, `dump/`): the registry is the one
  way in (tests/test_layering.py).

Backends sit under the pipeline, the search, the session and the commands: nothing here
imports them (tests/test_layering.py checks the layers).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from numbisect.backends.options import (
    check_hf_opts,
    check_vllm_opts,
    no_remote_code,
    vllm_remote,
)
from numbisect.common.errors import InputError


@dataclass(frozen=True)
class Registered:
    """What the core knows of a backend before it loads (every field but `load` torch-free)."""

    load: str | Callable | None  # "module:function" or a callable: (path, dtype, opts) -> Backend; None: never opened
    modes: tuple[str, ...] = ("prefill",)  # --engine-mode values it runs (decode.check_mode)
    runs: bool = True  # it runs the model: faults, swaps, trials, routing replay (a dump does not)
    reference: bool = True  # it may be given as --ref (a dump may not)
    options: Callable | None = None  # checker(opts, what) of its options; None: it takes none
    profile: str | None = None  # the self-test profile it is measured with (selftest.PROFILES)
    remote: Callable = lambda opts: False  # whether these options put its model in worker processes
    # What the session asks before anything loads (so no core module branches on a name):
    source: str = "checkpoint"  # what it reads: a "checkpoint" (config + weights) or a "dump" in its DIR, or
    # the "trace" itself (its recorded log-probs: nothing opened)
    takes_path: bool = True  # given as KIND:DIR (False: the KIND alone)
    loads_reference: bool = False  # it can be the reference numbisect loads (--ref)
    takes_images: bool = True  # it runs traces with images (pixel inputs)
    unit_map: str = "hf"  # the ArchMap table that names its modules ("hf" or "vllm")
    no_unit_map: str = "has no unit map"  # what the refusal says of a family without that table
    runs_user_config: bool = False  # it runs the user's own engine configuration (--engine-config)
    # What the layers above reach of this kind beyond a Backend: a module implementing
    # protocols.ReferenceServices or protocols.EngineServices, imported on first use (`services`).
    services: str | None = None
    weights: str | None = None  # its part in a weight check (`bisect weights`, numbisect.live): "reference" (its
    # model's tensors, in checkpoint names, are the truth) or "engine" (its weights read back); None: none

    def form(self, kind: str) -> str:
        """How --ref / --engine name it: KIND:DIR, or the KIND alone."""
        return f"{kind}:DIR" if self.takes_path else kind

    def loader(self) -> Callable:
        if self.load is None:
            raise InputError("this engine is not opened: its log-probs are the trace's")
        if callable(self.load):
            return self.load
        mod, _, fn = self.load.partition(":")
        return getattr(importlib.import_module(mod), fn)


BACKENDS: dict[str, Registered] = {
    "hf": Registered("numbisect.backends.hf:open_hf", modes=("prefill", "decode"), options=check_hf_opts, profile="hf",
                     loads_reference=True, services="numbisect.backends.hf.services", weights="reference"),
    "vllm": Registered("numbisect.backends.vllm:open_vllm", modes=("prefill", "decode"), options=check_vllm_opts,
                       profile="vllm", remote=vllm_remote, takes_images=False, unit_map="vllm", runs_user_config=True,
                       no_unit_map="has no vLLM unit map (vLLM-CPU cannot run it here)",
                       services="numbisect.backends.vllm.services", weights="engine"),
    "dump": Registered("numbisect.backends.dump:open_dump", runs=False, reference=False, source="dump"),
    # the rollout's own log-probs, recorded in the trace: compared, never opened or run
    "rollout": Registered(None, runs=False, reference=False, source="trace", takes_path=False),
}


def require_reference(kind: str, spec: str) -> None:
    """Refuse a --ref numbisect cannot load as the reference."""
    if not (kind in BACKENDS and BACKENDS[kind].loads_reference):
        kinds = " or ".join(f"{k}:DIR" for k, e in BACKENDS.items() if e.loads_reference)
        raise InputError(f"--ref must be {kinds} (got {spec!r})")


def source(kind: str) -> str | None:
    """What an --engine KIND[:DIR] reads: "checkpoint", "dump", "trace" (the rollout's own
    log-probs), or None for a kind not registered."""
    return BACKENDS[kind].source if kind in BACKENDS else None


def forms(what: str) -> str:
    """The kinds --ref (`what`) or --engine takes, as written: "hf:DIR, vllm:DIR, dump:DIR or rollout"."""
    items = [e.form(k) for k, e in BACKENDS.items() if e.reference or what == "--engine"]
    return ", ".join(items[:-1]) + " or " + items[-1] if len(items) > 1 else "".join(items)


def parse_spec(spec: str, what: str) -> tuple[str, str | None]:
    """(kind, path) of --ref / --engine (`what`) KIND:DIR, or (kind, None) of a kind given
    alone (the rollout); an InputError naming the forms it takes otherwise."""
    kind, sep, path = spec.partition(":")
    entry = BACKENDS.get(kind)
    if entry is not None and not entry.takes_path and not sep and (entry.reference or what == "--engine"):
        return kind, None
    if not sep or entry is None or not entry.takes_path or not path or (not entry.reference and what != "--engine"):
        raise InputError(f"bad {what} {spec!r}: expected {forms(what)}")
    return kind, path


def check_opts(kind: str, opts: dict, what: str) -> None:
    """Refuse, before anything loads, backend options of the wrong name, type or value
    (the checker the backend registered); a backend that registered none (dump) and the
    rollout engine take no options. `trust_remote_code` is refused for every kind."""
    no_remote_code(opts, what)
    entry = BACKENDS.get(kind)
    if entry is not None and entry.options is not None:
        entry.options(opts, what)
    elif opts:
        raise InputError(f"{what} {', '.join(repr(k) for k in sorted(opts))}: the {kind} engine takes no options")


def open_backend(kind: str, path: str, dtype: str, opts: dict, what: str | None = None, trace=None):
    """A backend of `kind` on `path`; `opts` checked first (`check_opts`, under the option
    name `what`: --ref-opt or --engine-opt, the default). `trace`: the trace a recorded
    engine (a dump) is checked against as it opens. An unknown `kind` is an InputError
    naming the known ones."""
    if kind not in BACKENDS:
        raise InputError(f"unknown backend {kind!r}; known: {', '.join(BACKENDS)}")
    check_opts(kind, opts, what or "--engine-opt")
    load = BACKENDS[kind].loader()
    return load(path, dtype, opts) if trace is None else load(path, dtype, opts, trace=trace)


def services(kind: str):
    """The services module of `kind` (`Registered.services`: a `ReferenceServices` or an
    `EngineServices`, numbisect.backends.protocols), imported on first use; an InputError
    for a kind that has none."""
    entry = BACKENDS.get(kind)
    if entry is None or entry.services is None:
        raise InputError(f"the {kind} engine offers no services beyond running a model")
    return importlib.import_module(entry.services)


def weights_kind(role: str) -> str:
    """The registered kind that plays `role` ("reference" or "engine") in a weight check
    (`Registered.weights`): the kind numbisect.live wraps a live object of that role in."""
    kinds = [k for k, e in BACKENDS.items() if e.weights == role]
    if len(kinds) != 1:
        raise InputError(f"{len(kinds)} registered kinds play the {role} of a weight check: expected one")
    return kinds[0]


def require_weights(kind: str, spec: str, role: str) -> None:
    """Refuse a --ref (`role` "reference") or --engine ("engine") that cannot play that
    part in `bisect weights` (`Registered.weights`), in one line naming the kinds that can."""
    if kind in BACKENDS and BACKENDS[kind].weights == role:
        return
    kinds = " or ".join(e.form(k) for k, e in BACKENDS.items() if e.weights == role)
    if role == "reference":
        raise InputError(f"--ref must be {kinds} (got {spec!r})")
    raise InputError(f"--engine must be {kinds} for `bisect weights` (its weights are read back from the engine), got {spec!r}")


def user_config_kind() -> str:
    """The registered kind that runs the user's own engine configuration (`--engine-config`:
    `Registered.runs_user_config`), whose services check its settings."""
    return next(k for k, e in BACKENDS.items() if e.runs_user_config)

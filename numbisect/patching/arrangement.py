"""The engine's state for one forward, set up and torn down in one place.

`arranged(engine, donor, faults, swapped, probe)` plants the faults, swaps the units in
from the donor (the reference), installs a routing probe, and undoes all of it, in
reverse order, when the block ends, whatever happened inside. Every engine forward of
a session (baseline, trials, streamed compare, routing passes, what-ifs) runs inside
it. Each change goes through one ledger per arrangement
(numbisect.patching.ledger.Ledger); how a change is made on an engine is its backend's
(`Backend.plant_fault`, `swap_unit`, `install_routing_probe`).
"""

from __future__ import annotations

import contextlib

from numbisect.patching.faults import apply_faults
from numbisect.patching.ledger import Ledger
from numbisect.patching.swap import apply_swaps


@contextlib.contextmanager
def arranged(engine, donor, faults=(), swapped=(), probe=None):
    """`engine` with `faults` planted, then `swapped` units replaced by `donor`'s modules,
    then `probe` (a routing recorder/replayer) installed; undone on exit. Yields the
    arrangement's ledger (a what-if adds its own changes to it), or None for an engine
    whose model lives in worker processes (`remote`: they do this in the workers)."""
    if engine.remote:
        engine.prepare(list(faults), list(swapped), donor)
        try:
            yield None
        finally:
            engine.undo()
        return
    with Ledger() as ledger:
        apply_faults(engine, list(faults), ledger)
        apply_swaps(engine, donor, list(swapped), ledger)
        if probe is not None:
            engine.install_routing_probe(probe, ledger)
        yield ledger

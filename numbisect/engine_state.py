"""The engine's state for one forward, set up and torn down in one place.

`arranged(engine, donor, faults, swapped, probe)` plants the faults, swaps the units in
from the donor (the reference), installs a routing probe, and undoes all of it, in
reverse order, when the block ends, whatever happened inside. Every engine forward of
a session (baseline, trials, streamed compare, routing passes) runs inside it.
"""

from __future__ import annotations

import contextlib

from numbisect.faults import apply_faults
from numbisect.swap import apply_swaps, unpatch


@contextlib.contextmanager
def arranged(engine, donor, faults=(), swapped=(), probe=None):
    """`engine` with `faults` planted, then `swapped` units replaced by `donor`'s modules,
    then `probe` (a routing recorder/replayer) installed; undone on exit. A tensor-parallel
    engine (`remote`) does this in its workers."""
    if getattr(engine, "remote", False):
        engine.prepare(list(faults), list(swapped), donor)
        try:
            yield engine
        finally:
            engine.undo()
        return
    planted = apply_faults(engine, list(faults))
    undo = None
    try:
        apply_swaps(engine, donor, list(swapped))
        undo = probe.install() if probe else None
        yield engine
    finally:
        if undo:
            undo()
        unpatch(engine)
        engine.restore()
        planted.undo()

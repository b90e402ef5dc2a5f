"""`Probe.run(samples, ...)`: `bisect run`'s search over the live objects.

The CLI's search runs over a `Session` (numbisect.session.session): the trial is one
engine forward with a set of units swapped for the reference's modules (patching.swap
through the engine backend's `swap_unit`, or through the workers of an engine whose model
lives in other processes), measured against the reference's log-probs. `session` makes
that Session from the backends `attach` wrapped around the user's objects (`Session`'s
constructor from open objects: nothing opened from disk, no checkpoint diff, no trial
log), and `run` hands it to the same
`numbisect.commands.run.run` `bisect run` calls: the same self-check, search strategies,
trials, culprits and precision what-ifs, giving the same report ("run").

What is changed during a run, and undone: each trial's swaps and planted faults (one
ledger per trial, undone whatever happens), the hooks of each forward; the trainer's
modules run inside the engine while swapped (in eval mode: `eval_mode` around the whole
run; never written). An engine in worker processes gets the trainer's weights as a
temporary checkpoint directory its workers load the donor modules from (removed after,
with everything numbisect kept in the workers: `Probe.forget_workers`).
"""

from __future__ import annotations

from numbisect.commands.run import run as run_search
from numbisect.common.errors import InputError
from numbisect.pipeline import measure as C
from numbisect.session.session import Session, Spec


def session(ref, engine, trace, settings: C.Settings, faults=(), *, progress=None, prefix_reuse: bool = True,
            prefix_cache_mb: float | None = None) -> Session:
    """A `Session` over backends already open on live objects (module doc): `faults` planted
    in the engine for every trial, in prefill mode; the trace's own digest for identity."""
    spec = Spec(ref=f"live:{ref.kind}", engine=f"live:{engine.kind}", trace=trace.path, ref_dtype=ref.dtype_name,
                engine_dtype=engine.dtype_name, faults=list(faults))
    s = Session(ref, engine, trace, settings, spec, progress=progress, prefix_reuse=prefix_reuse,
                prefix_cache_mb=prefix_cache_mb)
    if settings.group not in s.groups:
        raise InputError(f"unknown group {settings.group!r}; these samples have: {', '.join(s.groups)}")
    return s


def run(session: Session, *, swap, strategy: str, max_trials: int | None, whatif: bool, progress) -> tuple[dict, int]:
    """`bisect run`'s body and exit code over a live session (numbisect.commands.run.run, no trial log)."""
    return run_search(session, swap=swap, strategy=strategy, max_trials=max_trials, log=None, resume=None,
                      progress=progress, whatif=whatif)

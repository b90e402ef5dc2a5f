"""`Probe.run(samples, ...)`: `bisect run`'s search over the live objects.

The CLI's search runs over a `Session` (numbisect.session.session): the trial is one
engine forward with a set of units swapped for the reference's modules (patching.swap
through the engine backend's `swap_unit`, or through the workers of an engine whose model
lives in other processes), measured against the reference's log-probs. `LiveSession` is
that Session over the backends `attach` wrapped around the user's objects (nothing opened
from disk, no checkpoint diff, no trial log), and `run` hands it to the same
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
from numbisect.patching.faults import check_fault, parse_fault
from numbisect.patching.prefix import DEFAULT_MB, PrefixCache
from numbisect.pipeline import measure as C
from numbisect.session.session import Session, Spec


class LiveSession(Session):
    """A `Session` over backends already open on live objects (module doc): every attribute
    `Session.__init__` would set from the inputs, set from them instead."""

    def __init__(self, ref, engine, trace, settings: C.Settings, faults=(), *, progress=None, prefix_reuse: bool = True,
                 prefix_cache_mb: float | None = None):
        self.spec = Spec(ref="live:hf", engine="live:vllm", trace=trace.path, ref_dtype=ref.dtype_name,
                         engine_dtype=engine.dtype_name, faults=list(faults))
        self.settings = settings
        self.say = progress or (lambda msg: None)
        self.prefix_reuse = prefix_reuse
        self.prefix = PrefixCache(max_bytes=int((DEFAULT_MB if prefix_cache_mb is None else prefix_cache_mb) * 2**20))
        self.checkpoint_diff = None
        self.trace = trace
        self.engine_kind = "vllm"
        self.engine_runs = True
        self.user_engine = None
        self.faults = [parse_fault(f) for f in faults]
        self.mode = "prefill"
        self.group_origin = {}
        self.ref = ref
        self.engine = engine
        for f in self.faults:
            check_fault(engine, f)
        self._owned = []
        self.samples = trace.samples
        self.groups = C.group_names(trace) + (["all"] if settings.group == "all" else [])
        if settings.group not in self.groups:
            raise InputError(f"unknown group {settings.group!r}; these samples have: {', '.join(self.groups)}")
        self._ref_result = None
        self.ref_routing = None
        self._ref_tokens = None
        self.comparison = None
        self.digests = {"trace": trace.sha256}


def run(session: LiveSession, *, swap, strategy: str, max_trials: int | None, whatif: bool, progress) -> tuple[dict, int]:
    """`bisect run`'s body and exit code over a LiveSession (numbisect.commands.run.run, no trial log)."""
    return run_search(session, swap=swap, strategy=strategy, max_trials=max_trials, log=None, resume=None,
                      progress=progress, whatif=whatif)

"""The "linear" strategy: one unit at a time (the benchmark baseline)."""

from __future__ import annotations

from numbisect.search.diffuse import diffuse
from numbisect.search.state import State, aligned, unreachable
from numbisect.search.trials import SearchResult


def linear(state: State) -> SearchResult:
    """Each unit swapped alone, in execution order; the units that fix it alone are named."""
    units = state.units
    early = aligned(state)
    if early is not None:
        return early
    fixing = []
    for u in sorted(units.names, key=units.order):
        if state.fixes([u]):
            fixing.append(u)
            state.found = list(fixing)
    # Name the most specific units: drop a unit when one of its sub-units fixes too.
    found = [u for u in fixing if not any(u in units.ancestors(v) for v in fixing)]
    state.found = found
    if found:
        culprits = [state.culprit(u) for u in found]
        reason = f"swapping {' or '.join(found)} alone brings {state.metric} {state.under}"
        return state.result("culprits", culprits, reason)
    early = unreachable(state)
    if early is not None:
        return early
    reason = f"no single unit brings {state.metric} {state.under} alone; swapping every candidate does"
    return diffuse(state, list(units.cands), reason)

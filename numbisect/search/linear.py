"""The "linear" strategy: one unit at a time (the benchmark baseline)."""

from __future__ import annotations

from numbisect.search.trials import SearchResult


class Linear:
    """One unit at a time (mixed into `_Search`)."""

    def _linear(self) -> SearchResult:
        aligned = self._baseline()
        if aligned is not None:
            return aligned
        fixing = []
        for u in sorted(self.units, key=self._order):
            if self._fixes([u]):
                fixing.append(u)
                self.found = list(fixing)
        # Name the most specific units: drop a unit when one of its sub-units fixes too.
        found = [u for u in fixing if not any(u in self._ancestors(v) for v in fixing)]
        self.found = found
        if found:
            culprits = [self._culprit(u) for u in found]
            reason = f"swapping {' or '.join(found)} alone brings {self.metric} {self._under}"
            return self._result("culprits", culprits, reason)
        unreachable = self._all_swapped()
        if unreachable is not None:
            return unreachable
        reason = (
            f"no single unit brings {self.metric} {self._under} alone; swapping every candidate does"
        )
        return self._diffuse(list(self.cands), reason)

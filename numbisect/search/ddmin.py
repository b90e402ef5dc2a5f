"""The "ddmin" strategy: Zeller's delta debugging over the same list of units, followed by the
hierarchical strategy's steps 4-6."""

from __future__ import annotations


class DeltaDebugging:
    """Zeller's ddmin over the unit list (mixed into `_Search`)."""

    def _ddmin(self, items) -> list[str]:
        """Zeller's ddmin: a 1-minimal subset of `items` that fixes (all of them do)."""
        current = list(items)
        n = 2
        while len(current) >= 2:
            size = len(current)
            chunks = [current[i * size // n : (i + 1) * size // n] for i in range(n)]
            chunks = [c for c in chunks if c]
            for chunk in chunks:
                if self._fixes(chunk):
                    current, n = chunk, 2
                    break
            else:
                for chunk in chunks if n > 2 else []:
                    rest = [u for u in current if u not in chunk]
                    if self._fixes(rest):
                        current, n = rest, max(n - 1, 2)
                        break
                else:
                    if n >= size:
                        break
                    n = min(size, 2 * n)
        return current

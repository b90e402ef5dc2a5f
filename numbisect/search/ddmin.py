"""The "ddmin" strategy's descent: Zeller's delta debugging over the same list of units; the
hierarchical strategy's other steps (numbisect.search.hierarchical, `Bisection.run`) go
around it."""

from __future__ import annotations

from numbisect.search.state import State


def ddmin(state: State, items) -> list[str]:
    """Zeller's ddmin: a 1-minimal subset of `items` that fixes (all of them do)."""
    current = list(items)
    n = 2
    while len(current) >= 2:
        size = len(current)
        chunks = [current[i * size // n : (i + 1) * size // n] for i in range(n)]
        chunks = [c for c in chunks if c]
        for chunk in chunks:
            if state.fixes(chunk):
                current, n = chunk, 2
                break
        else:
            for chunk in chunks if n > 2 else []:
                rest = [u for u in current if u not in chunk]
                if state.fixes(rest):
                    current, n = rest, max(n - 1, 2)
                    break
            else:
                if n >= size:
                    break
                n = min(size, 2 * n)
    return current

"""The hierarchical strategy (the default): bisection over one list of units to a 1-minimal
set that fixes (steps 3-4 of numbisect.search.search), then its sub-units, then pruning;
`Bisection.run` goes around ddmin's descent too (numbisect.search.ddmin)."""

from __future__ import annotations

import math
from typing import Callable

from numbisect.search.diffuse import diffuse, is_diffuse
from numbisect.search.kinds import KindHypotheses
from numbisect.search.state import State, Units, aligned, unreachable
from numbisect.search.trials import SearchResult, _Systematic


def plan_lengths(n_max: int, alone_singles: bool) -> dict[bool, list[list[tuple[int, int, int]]]]:
    """For each segment length n, the sizes a of the part to try next, with their
    (worst-case, summed) trial counts for finding and confirming a single fault;
    `options[True]` when some earlier part already failed.

    A unit found by elimination still needs its trial alone, one more. With
    `alone_singles` a single unit is tried alone, so when it fixes it needs no more;
    otherwise (see `Bisection._minimise`) every unit found after a failed part does.
    """
    worst = {False: [0, 0], True: [0, 1]}
    total = {False: [0, 0], True: [0, 1]}
    options: dict[bool, list] = {False: [[], []], True: [[], []]}
    for n in range(2, n_max + 1):
        for failed in (False, True):
            fa = failed and not alone_singles
            row = []
            for a in range(1, n):
                w = 1 + max(worst[fa][a], worst[True][n - a])
                row.append((a, w, n + total[fa][a] + total[True][n - a]))
            w = min(r[1] for r in row)
            row = [r for r in row if r[1] == w]
            worst[failed].append(w)
            total[failed].append(min(r[2] for r in row))
            options[failed].append(row)
    return options


def merge(units: Units, found) -> list[str]:
    """Name a parent instead of all of its (two or more) children: no proper subset
    of them fixes."""
    found = set(found)
    changed = True
    while changed:
        changed = False
        for u in list(found):
            p = units.parent(u)
            kids = set(units.children(p)) if p in units.pos else set()
            if len(kids) > 1 and kids <= found:
                found = (found - kids) | {p}
                changed = True
                break
    return sorted(found, key=units.order)


class Bisection:
    """Steps 1-6 over a search's `State`: the descent (`_minimise`, or the one `run` is given),
    sub-units (`_refine`), pruning (`_prune`), each culprit's evidence; the kind-level
    hypotheses (`kinds`) where the evidence says the divergence is spread."""

    def __init__(self, state: State, kinds: KindHypotheses):
        self.state = state
        self.units = state.units
        self.kinds = kinds
        # Trying single units alone saves trials, but a moe with three or more sub-units
        # then needs failing trials that cover all but one of them (see `_refine`).
        self.alone_singles = all(len(self.units.children(u)) <= 2 for u in self.units.names)
        self.options = plan_lengths(len(self.units.names), self.alone_singles)

    def run(self, descend: Callable[[tuple], list[str]] | None = None) -> SearchResult:
        """The search; `descend(units)`: a 1-minimal subset of every unit that fixes, in place
        of the bisection (`_minimise`)."""
        state, units = self.state, self.units
        early = aligned(state)
        if early is None:
            early = unreachable(state)
        if early is not None:
            return early
        first = self.kinds.first()
        if first is not None:
            systematic = self.kinds.systematic(first[0], first[1], need_all=False)
            if systematic is not None:
                return systematic
        try:
            found = self._hypothesis(state.evidence.moved, "checkpoint diff")
            if found is None and self.kinds.narrowed:
                found = self._hypothesis(self.kinds.narrowed, "kinds narrowed")
            if found is None:
                found = descend(units.names) if descend is not None else self._minimise(units.names, frozenset(), top=True)
        except _Systematic as named:
            return named.result
        found = merge(units, found)
        if is_diffuse(units, found):
            systematic = self.kinds.systematic((), "the minimal set needs every layer", need_all=False)
            if systematic is not None:
                return systematic
            reason = (
                f"no set smaller than one touching every layer ({len(found)} units) brings "
                f"{state.metric} {state.under}: the divergence is spread out"
            )
            return diffuse(state, found, reason)
        state.found = found
        found = self._refine(found)
        found = self._prune(found)
        state.found = found
        culprits = [state.culprit(u) for u in found]
        if len(found) == 1:
            reason = f"swapping {found[0]} alone brings {state.metric} {state.under}"
        else:
            reason = (
                f"swapping {', '.join(found)} together brings {state.metric} {state.under}; "
                "leaving any one of them in the engine does not"
            )
        return state.result("culprits", culprits, reason)

    def _hypothesis(self, units, role: str) -> list[str] | None:
        """Before the descent, a set the evidence already points at, swapped together: the
        units the checkpoint diff found holding weights of another layer (`moved`: two layers'
        blocks exchanged, a layer index shifted), or the units of the kinds tried first in the
        layers whose share was not ruled out (`narrowed`: a config value only some layers
        read, such as a sliding window); merged into their parent where every child is one.
        When that fixes, the culprits are a 1-minimal subset of them. One trial more than the
        descent when it does not fix; far fewer when it does (every sub-unit of an exchanged
        block differs, which the descent finds one by one)."""
        units = merge(self.units, [u for u in units if u in self.units.pos])
        if not units or len(units) >= len(self.units.cands) or not self.state.fixes(units, role):
            return None
        return self._minimise(tuple(sorted(units, key=self.units.pos.__getitem__)), frozenset())

    def _minimise(self, items: tuple, held: frozenset, top: bool = False) -> list[str]:
        """A 1-minimal subset M of `items` such that held + M fixes.

        Precondition: held + items fixes and held alone does not. A part that fails
        stays swapped (in `failed`) while the rest is bisected, so the rest never needs
        a trial of its own to confirm it, and failing trials cover every unit ruled out
        so far. A single unit is tried alone when `self.alone_singles` (then a fix names
        it at once). The unit found last is tried alone; only if that does not fix are
        the failed parts minimised in turn (several culprits).

        `top` (the search over every unit): when the unit found last does not fix alone
        and the set known to fix still touches every layer, the kind-level hypotheses are
        tried before the failed parts are minimised (`KindHypotheses.systematic`; raises `_Systematic`
        when they name a kind). A single culprit never gets here, so it pays nothing.
        """
        failed: list[str] = []
        unsure = False  # a unit tried alone failed: held + failed may fix without `part`
        part = tuple(items)
        while len(part) > 1:
            a, b = self._split(part, bool(failed))
            alone = self.alone_singles and len(a) == 1
            if self.state.fixes(held | set(a) if alone else held | set(failed) | set(a)):
                if alone:
                    return list(a)
                part = a
            else:
                failed += a
                part = b
                unsure |= alone
        # held + failed + part fixes.
        if not failed or self.state.fixes(held | set(part)):
            return list(part)
        if top and self.units.every_layer(failed + list(part)):
            named = self.kinds.systematic((), "no single unit fixes it and the smallest set seen to fix touches every layer",
                                          need_all=True)
            if named is not None:
                raise _Systematic(named)
        found = self._minimise(tuple(sorted(failed, key=self.units.pos.__getitem__)), held | set(part))
        if unsure and self.state.fixes(held | set(found)):
            return found
        return found + list(part)

    def _split(self, items: tuple, failed: bool) -> tuple[tuple, tuple]:
        """(a, b): a (a prefix) is tried next; b is kept if a does not fix.

        The size of a keeps the worst case and then the sum of trials least (see
        `plan_lengths`); among equal sizes the cut prefers a layer boundary, then a
        candidate boundary, then the half holding the unit with the largest local error
        first.
        """
        units, ev = self.units, self.state.evidence
        n, i = len(items), units.pos.get(items[0], -1)
        if units.names[i : i + n] != items:  # not a run of the unit list (not expected)
            return items[: n // 2], items[n // 2 :]
        options = self.options[failed][n]
        best_total = min(t for _, _, t in options)

        def key(option):
            a, _, t = option
            lt, rt = units.top[units.names[i + a - 1]], units.top[units.names[i + a]]
            rank_a = min((ev.local_rank.get(u, math.inf) for u in items[:a]), default=math.inf)
            rank_b = min((ev.local_rank.get(u, math.inf) for u in items[a:]), default=math.inf)
            sus_a = any(u in ev.suspects for u in items[:a])
            sus_b = any(u in ev.suspects for u in items[a:])
            return (
                t > best_total,
                units.layer(lt) == units.layer(rt),
                lt == rt,
                sus_b and not sus_a,
                not rank_a < rank_b,
                abs(2 * a - n),
            )

        a = min(options, key=key)[0]
        return items[:a], items[a:]

    def _refine(self, found) -> list[str]:
        """Step 4 for a parent found whole: if a proper subset of its children fixes in
        its place (the rest of the found set held swapped), name that subset instead.

        Usually free: failing trials already run often prove that no proper subset of
        the children fixes (each maximal one lies inside a failing trial).
        """
        out = list(found)
        todo = [u for u in out if self.units.children(u)]
        while todo:
            c = todo.pop(0)
            kids = self.units.children(c)
            if all(k in self.state.evidence.moved for k in kids):  # each child holds another layer's weights: all differ
                continue
            held = frozenset(out) - {c}
            if all(self._known_to_fail(held | (set(kids) - {k})) for k in kids):
                continue
            if not self.state.fixes(held | set(kids)):
                continue
            sub = self._minimise(tuple(kids), held)
            sub = merge(self.units, sub)
            if sub == [c]:
                continue
            out = sorted([u for u in out if u != c] + sub, key=self.units.order)
            todo += [u for u in sub if self.units.children(u)]
        return out

    def _prune(self, found) -> list[str]:
        """Step 4b: drop a culprit the others fix without. Under a monotone metric the set is
        1-minimal already; a metric that saturates is not monotone (with a second fault
        unswapped, every probe near the first reads the same huge value, so the bisection
        cannot tell its units apart), and a unit that happened to be in the same half is
        kept. Each culprit is left out once, in a trial of exactly the others (free where
        that set was tried already: a failing larger set proves nothing here)."""
        out = list(found)
        if len(out) < 2:
            return out
        for u in list(out):
            rest = [v for v in out if v != u]
            seen = self.state.seen(rest)
            if self.state.fixed(seen) if seen is not None else self.state.fixes(rest, "prune"):
                out = rest
        return out

    def _known_to_fail(self, units) -> bool:
        """Some trial already run swapped all of `units` (or their parents) and did not fix."""
        need = [[u] + self.units.ancestors(u) for u in units]
        for t in self.state.runner.trials:
            if not self.state.fixed(t):
                swapped = set(t.swapped)
                if all(swapped.intersection(chain) for chain in need):
                    return True
        return False

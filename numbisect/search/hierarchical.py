"""The hierarchical strategy (the default): bisection over one list of units to a 1-minimal
set that fixes (steps 3-4 of numbisect.search.search), then its sub-units, then pruning."""

from __future__ import annotations

import math

from numbisect.model.units import children, parent
from numbisect.search.trials import SearchResult, _Systematic


class Bisection:
    """Steps 3-4: bisection to a 1-minimal set, sub-units, pruning (mixed into `_Search`)."""

    def _minimal(self) -> SearchResult:
        early = self._start()
        if early is not None:
            return early
        first = self._kinds_first()
        if first is not None:
            systematic = self._systematic(first[0], first[1], need_all=False)
            if systematic is not None:
                return systematic
        try:
            found = self._hypothesis(self.moved, "checkpoint diff")
            if found is None and self.narrowed:
                found = self._hypothesis(self.narrowed, "kinds narrowed")
            if found is not None:
                pass
            elif self.strategy == "ddmin":
                found = self._ddmin(self.units)
            else:
                found = self._minimise(self.units, frozenset(), top=True)
        except _Systematic as named:
            return named.result
        found = self._merge(found)
        if self._is_diffuse(found):
            systematic = self._systematic((), "the minimal set needs every layer", need_all=False)
            if systematic is not None:
                return systematic
            reason = (
                f"no set smaller than one touching every layer ({len(found)} units) brings "
                f"{self.metric} {self._under}: the divergence is spread out"
            )
            return self._diffuse(found, reason)
        self.found = found
        found = self._refine(found)
        found = self._prune(found)
        self.found = found
        culprits = [self._culprit(u) for u in found]
        if len(found) == 1:
            reason = f"swapping {found[0]} alone brings {self.metric} {self._under}"
        else:
            reason = (
                f"swapping {', '.join(found)} together brings {self.metric} {self._under}; "
                "leaving any one of them in the engine does not"
            )
        return self._result("culprits", culprits, reason)

    def _hypothesis(self, units, role: str) -> list[str] | None:
        """Before the descent, a set the evidence already points at, swapped together: the
        units the checkpoint diff found holding weights of another layer (`moved`: two layers'
        blocks exchanged, a layer index shifted), or the units of the kinds tried first in the
        layers whose share was not ruled out (`narrowed`: a config value only some layers
        read, such as a sliding window); merged into their parent where every child is one.
        When that fixes, the culprits are a 1-minimal subset of them. One trial more than the
        descent when it does not fix; far fewer when it does (every sub-unit of an exchanged
        block differs, which the descent finds one by one)."""
        units = self._merge([u for u in units if u in self.pos])
        if not units or len(units) >= len(self.cands) or not self._fixes(units, role):
            return None
        return self._minimise(tuple(sorted(units, key=self.pos.__getitem__)), frozenset())

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
        tried before the failed parts are minimised (`_systematic`; raises `_Systematic`
        when they name a kind). A single culprit never gets here, so it pays nothing.
        """
        failed: list[str] = []
        unsure = False  # a unit tried alone failed: held + failed may fix without `part`
        part = tuple(items)
        while len(part) > 1:
            a, b = self._split(part, bool(failed))
            alone = self.alone_singles and len(a) == 1
            if self._fixes(held | set(a) if alone else held | set(failed) | set(a)):
                if alone:
                    return list(a)
                part = a
            else:
                failed += a
                part = b
                unsure |= alone
        # held + failed + part fixes.
        if not failed or self._fixes(held | set(part)):
            return list(part)
        if top and self._every_layer(failed + list(part)):
            named = self._systematic((), "no single unit fixes it and the smallest set seen to fix touches every layer",
                                     need_all=True)
            if named is not None:
                raise _Systematic(named)
        found = self._minimise(tuple(sorted(failed, key=self.pos.__getitem__)), held | set(part))
        if unsure and self._fixes(held | set(found)):
            return found
        return found + list(part)

    def _split(self, items: tuple, failed: bool) -> tuple[tuple, tuple]:
        """(a, b): a (a prefix) is tried next; b is kept if a does not fix.

        The size of a keeps the worst case and then the sum of trials least (see
        `_plan_lengths`); among equal sizes the cut prefers a layer boundary, then a
        candidate boundary, then the half holding the unit with the largest local error
        first.
        """
        n, i = len(items), self.pos.get(items[0], -1)
        if self.units[i : i + n] != items:  # not a run of the unit list (not expected)
            return items[: n // 2], items[n // 2 :]
        options = self.options[failed][n]
        best_total = min(t for _, _, t in options)

        def key(option):
            a, _, t = option
            left, right = self.units[i + a - 1], self.units[i + a]
            lt, rt = self.top[left], self.top[right]
            rank_a = min((self.local_rank.get(u, math.inf) for u in items[:a]), default=math.inf)
            rank_b = min((self.local_rank.get(u, math.inf) for u in items[a:]), default=math.inf)
            sus_a = any(u in self.suspects for u in items[:a])
            sus_b = any(u in self.suspects for u in items[a:])
            return (
                t > best_total,
                self.g.nodes[lt]["layer"] == self.g.nodes[rt]["layer"],
                lt == rt,
                sus_b and not sus_a,
                not rank_a < rank_b,
                abs(2 * a - n),
            )

        a = min(options, key=key)[0]
        return items[:a], items[a:]

    def _merge(self, found) -> list[str]:
        """Name a parent instead of all of its (two or more) children: no proper subset
        of them fixes."""
        found = set(found)
        changed = True
        while changed:
            changed = False
            for u in list(found):
                p = parent(self.g, u)
                kids = set(children(self.g, p)) if p in self.pos else set()
                if len(kids) > 1 and kids <= found:
                    found = (found - kids) | {p}
                    changed = True
                    break
        return sorted(found, key=self._order)

    def _refine(self, found) -> list[str]:
        """Step 4 for a parent found whole: if a proper subset of its children fixes in
        its place (the rest of the found set held swapped), name that subset instead.

        Usually free: failing trials already run often prove that no proper subset of
        the children fixes (each maximal one lies inside a failing trial).
        """
        out = list(found)
        todo = [u for u in out if children(self.g, u)]
        while todo:
            c = todo.pop(0)
            kids = children(self.g, c)
            if all(k in self.moved for k in kids):  # each child holds another layer's weights: all differ
                continue
            held = frozenset(out) - {c}
            if all(self._known_to_fail(held | (set(kids) - {k})) for k in kids):
                continue
            if not self._fixes(held | set(kids)):
                continue
            sub = self._minimise(tuple(kids), held)
            sub = self._merge(sub)
            if sub == [c]:
                continue
            out = sorted([u for u in out if u != c] + sub, key=self._order)
            todo += [u for u in sub if children(self.g, u)]
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
            seen = self.runner.peek(self._swap_set(rest))
            if (seen.value <= self.thr) if seen is not None else self._fixes(rest, "prune"):
                out = rest
        return out

    def _known_to_fail(self, units) -> bool:
        """Some trial already run swapped all of `units` (or their parents) and did not fix."""
        need = [[u] + self._ancestors(u) for u in units]
        for t in self.runner.trials:
            if not t.value <= self.thr:
                swapped = set(t.swapped)
                if all(swapped.intersection(chain) for chain in need):
                    return True
        return False

"""What every strategy of the search reads: the units it can name (`Units`), what is known of
them before any trial (`Evidence`), and the `State` of one search: the trial runner, the
threshold and the verdict rule, `State.fixed` (a trial fixes it when its value is at or under
the threshold), the rule's only home. A strategy is a function or class of its own that takes
a `State` (numbisect.search.hierarchical, .ddmin, .linear, .kinds, .diffuse). Pure data and
arithmetic on unit names: no torch."""

from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx

from numbisect.model.units import children, parent
from numbisect.search.trials import Culprit, SearchResult, Trial, TrialRunner


class Units:
    """The search's view of the unit graph: the candidates (`cands`), every unit it can name in
    the order it tries them (`names`, with each one's position `pos` and candidate `top`), and
    the units of each kind (`by_kind`; `kinds`: the kinds found in two or more layers)."""

    def __init__(self, graph: nx.DiGraph, candidates):
        self.graph = graph
        # A candidate inside another candidate is searched as part of it.
        cands = list(dict.fromkeys(candidates))
        self.cands = [c for c in cands if not any(a in cands for a in self.ancestors(c))]
        self.top: dict[str, str] = {}  # unit searched -> the candidate it belongs to
        self.names = self._unit_list()
        self.pos = {u: i for i, u in enumerate(self.names)}
        self.by_kind: dict[str, list[str]] = {}
        for u in self.names:
            self.by_kind.setdefault(self.kind(u), []).append(u)
        self.kinds = [k for k, us in self.by_kind.items() if len(self.layers(us)) >= 2]

    def _unit_list(self) -> tuple[str, ...]:
        """Every unit the search can name: each candidate preceded by its sub-units
        (children before their parent, so a tried prefix never swaps a parent without
        its children); candidates from the last layer to the first, in execution order
        within a layer, so the first splits separate layer ranges and every trial's
        earliest swapped layer is as late as it can be (the layers before it are
        replayed by prefix reuse, and their order within the list costs no trials: a
        single fault takes the same bound wherever it sits)."""
        layered = [d["order"] for _, d in self.graph.nodes(data=True) if d.get("layer") is not None]
        first_layer = min(layered, default=0)

        def key(c):
            layer = self.layer(c)
            if layer is None:
                layer = -1 if self.order(c) < first_layer else 1 << 30
            return (-layer, self.order(c))

        def post_order(u):
            out = []
            for k in children(self.graph, u):
                out += post_order(k)
            return out + [u]

        units: list[str] = []
        for c in sorted(self.cands, key=key):
            for u in post_order(c):
                self.top[u] = c
                units.append(u)
        return tuple(units)

    def ancestors(self, name: str) -> list[str]:
        out, node = [], parent(self.graph, name)
        while node is not None and node != "model":
            out.append(node)
            node = parent(self.graph, node)
        return out

    def children(self, name: str) -> list[str]:
        return children(self.graph, name)

    def parent(self, name: str) -> str | None:
        return parent(self.graph, name)

    def order(self, name: str) -> int:
        return self.graph.nodes[name]["order"]

    def kind(self, name: str) -> str:
        return self.graph.nodes[name]["kind"]

    def layer(self, name: str) -> int | None:
        return self.graph.nodes[name]["layer"]

    def layers(self, names) -> set[int]:
        return {self.layer(n) for n in names} - {None}

    def every_layer(self, units) -> bool:
        """`units` (with their candidates) touch every layer, and there are two or more."""
        all_layers = self.layers(self.cands)
        return len(all_layers) >= 2 and self.layers({self.top[u] for u in units}) >= all_layers

    def swap_set(self, units) -> frozenset:
        """The units to swap, less any whose ancestor is swapped too."""
        s = set(units)
        return frozenset(u for u in s if not any(a in s for a in self.ancestors(u)))

    def complement_set(self, unit: str) -> list[str]:
        """Every candidate swapped except `unit` (for a sub-unit: its siblings swapped)."""
        swapped: list[str] = []
        node = unit
        while node not in self.cands:
            up = self.parent(node)
            swapped += [k for k in self.children(up) if k != node]
            node = up
        return [c for c in self.cands if c != node] + swapped


@dataclass
class Evidence:
    """What is known before any trial (see `numbisect.search.search.search`): units whose
    checkpoint weights differ (`suspect_units`; `suspects` adds their ancestors: the half
    holding one's block goes first), kinds that read a config value that differs, units whose
    weights came from another layer (`moved`), and each unit's rank by local error."""

    suspect_units: list[str]
    suspects: set[str]
    suspect_kinds: list[str]
    moved: set[str]
    local_rank: dict[str, int]

    @classmethod
    def of(cls, units: Units, suspects=(), suspect_kinds=(), moved=(), local_rank=None) -> "Evidence":
        g = units.graph
        return cls(
            suspect_units=[s for s in suspects if s in g],
            suspects={a for s in suspects if s in g for a in (s, *units.ancestors(s))},
            suspect_kinds=list(dict.fromkeys(suspect_kinds)),
            moved={s for s in moved if s in g},
            local_rank=local_rank or {},
        )


@dataclass
class State:
    """One search: the units, the trial runner, the threshold and the verdict rule (`fixed`),
    and what the answer reports of its progress."""

    units: Units
    runner: TrialRunner
    threshold: float
    strategy: str
    metric: str
    evidence: Evidence
    baseline: float | None = None
    all_swapped: float | None = None
    found: list[str] = field(default_factory=list)  # culprits established so far, for a "budget" result
    best: list[str] | None = None  # the smallest set seen to fix, ditto

    def fixed(self, trial: Trial) -> bool:
        """The verdict rule: this trial's set fixes it (its value at or under the threshold; a
        NaN never does)."""
        return trial.value <= self.threshold

    def trial(self, units, role: str) -> Trial:
        """The trial with `units` swapped (run once; an earlier one is reused)."""
        return self.runner.run(self.units.swap_set(units), role)

    def seen(self, units) -> Trial | None:
        """The trial with `units` swapped if one was run already; never runs one."""
        return self.runner.peek(self.units.swap_set(units))

    def fixes(self, units, role: str = "probe") -> bool:
        """Swapping `units` fixes it (a trial); the smallest such set seen is kept for `best`."""
        trial = self.trial(units, role)
        fixed = self.fixed(trial)
        if fixed and (self.best is None or len(trial.swapped) < len(self.best)):
            self.best = list(trial.swapped)
        return fixed

    @property
    def under(self) -> str:
        """How a sentence says "fixed": at a threshold of 0 (bitwise equal) "under 0" reads wrong."""
        return "to 0" if self.threshold == 0 else f"under {self.threshold:g}"

    def culprit(self, unit: str, run: bool = True) -> Culprit:
        """A culprit's evidence: the value with only it swapped, and with every other candidate
        swapped (`run=False`: only from trials already run)."""
        def look(units, role):
            return self.trial(units, role) if run else self.seen(units)

        alone = look([unit], "evidence-alone")
        comp = look(self.units.complement_set(unit), "evidence-complement")
        return Culprit(
            unit=unit,
            kind=self.units.kind(unit),
            alone=alone.value if alone is not None else None,
            complement=comp.value if comp is not None else None,
            local_rank=self.evidence.local_rank.get(unit),
        )

    def result(self, verdict, culprits, reason, contributions=None, systematic=None, diffuse_kinds=None) -> SearchResult:
        return SearchResult(
            verdict=verdict,
            culprits=culprits,
            baseline=self.baseline,
            all_swapped=self.all_swapped,
            threshold=self.threshold,
            strategy=self.strategy,
            trials_used=self.runner.used,
            stop_reason=reason,
            contributions=contributions or {},
            systematic=systematic,
            diffuse_kinds=diffuse_kinds,
        )


def aligned(state: State) -> SearchResult | None:
    """The baseline trial (nothing swapped); "aligned" when it already fixes it."""
    trial = state.trial((), "baseline")
    state.baseline = trial.value
    if state.fixed(trial):
        reason = (f"baseline {state.metric} {trial.value:.3g} is already "
                  f"{'0' if state.threshold == 0 else state.under}")
        return state.result("aligned", [], reason)
    return None


def unreachable(state: State) -> SearchResult | None:
    """Every candidate swapped; "unreachable" when that still does not fix it."""
    trial = state.trial(state.units.cands, "all-swapped")
    state.all_swapped = trial.value
    if not state.fixed(trial):
        reason = (f"swapping every candidate still leaves {state.metric} at {trial.value:.3g} "
                  f"(threshold {state.threshold:g})")
        return state.result("unreachable", [], reason)
    return None

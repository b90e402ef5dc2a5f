"""Search: which swapped units make the engine agree with the reference.

A trial swaps a set of engine units for the reference's and measures the judged metric
(lower is better; "fixed" means value <= threshold). Trials are the unit of cost, so a
`TrialRunner` counts and caches them, and can be pre-loaded with the trials of an
interrupted run. This module is pure algorithm: no torch, no model.

The hierarchical strategy (the default):

1. Baseline trial (nothing swapped); already under the threshold -> "aligned".
2. Every candidate swapped; still over the threshold -> "unreachable".
3. Find a 1-minimal set of units whose swap fixes it, by bisection over one list: the
   candidates from the last layer to the first (lm_head and the final norm before the
   last layer, the embedding after the first; execution order within a layer), each
   preceded by its sub-units (router, experts, shared_expert before their moe). Only
   prefixes of a range are tried, so a parent is never swapped without its children,
   and the splits go layer ranges first, then units, then sub-units. Later layers
   first: a trial's earliest swapped layer then stays as late as the search allows, so
   prefix reuse (`numbisect.patching.prefix`) replays every layer before it. A half that does not fix stays swapped while
   the other half is bisected, so that half needs no trial of its own (a single unit
   is tried alone, unless some unit has three or more sub-units); the unit found is
   then tried alone, and only if that does not fix are the failed halves minimised
   in turn with it held swapped (several culprits; group testing as in ddmin /
   QuickXplain). Under a monotone metric the result is 1-minimal: leaving any one
   culprit in the engine breaks the fix.
   Before the descent, a set the evidence points at is tried as one hypothesis
   (`Bisection._hypothesis`): the units the checkpoint diff found holding another layer's
   weights (`moved`), or, after kind-level hypotheses that fixed but were not kind-wide,
   their units in the layers not ruled out (`narrowed`); when it fixes, the culprits are a
   1-minimal subset of it.
4. Sub-units: a parent all of whose (two or more) children were found is named
   instead of them; a parent found whole is replaced by a proper subset of its
   children that fixes in its place, if one does (usually settled by trials already
   run, at no cost). Then a culprit the others fix without is dropped (`_prune`: the
   set is 1-minimal even where the metric saturated during the bisection).
5. Evidence per culprit: the value with only it swapped ("alone") and with every other
   candidate swapped ("complement": what it contributes on its own).
6. A minimal set that needs a unit from every layer (or every candidate) is "diffuse":
   no culprit is named and each layer's contribution is measured instead.
7. Kind-level hypotheses (`_Search._kinds`): every unit of a kind swapped, as `--swap
   KIND` does. A kind needed in (more than half of) its layers is a systematic culprit,
   the same difference in every layer (a kernel, a config value). They are tried as
   soon as the evidence says the divergence is spread, not after step 3: before it when
   the checkpoint diff names a config value a kind reads, or weights that differ in most
   layers of a kind; in step 3 when the unit found last does not fix alone (so not a
   single culprit) and the smallest set seen to fix touches every layer; after step 3
   when its minimal set needs every layer. When no kind is named, the search goes on
   from where it was, with the trials already run.

A single faulty unit among n (candidates plus their sub-units) costs at most
ceil(log2 n) + 1 trials in step 3 (the split sizes come from `_plan_lengths`), so
ceil(log2 n) + 4 in all, evidence included; it never reaches step 7. A kind wrong in
every one of L layers, with K kinds found in two or more layers, costs at most
ceil(log2 n) + 6 + K + L (the descent until its unit fails alone, every kind together,
each of the two middle layers left out, each kind alone until one fixes, each layer's
share).

"linear" swaps one unit at a time (the benchmark baseline); "ddmin" is Zeller's delta
debugging over the same list, followed by steps 4-6.
"""

from __future__ import annotations

import networkx as nx

from numbisect.model.units import children, parent
from numbisect.search.ddmin import DeltaDebugging
from numbisect.search.diffuse import Diffuse
from numbisect.search.hierarchical import Bisection
from numbisect.search.kinds import KindHypotheses
from numbisect.search.linear import Linear
from numbisect.search.trials import (  # noqa: F401 (the search's API: numbisect.search.search.Trial, ...)
    BudgetExhausted,
    Culprit,
    Evaluate,
    SearchResult,
    Trial,
    TrialRunner,
    _json_float,
    _Systematic,
)

STRATEGIES = ("hierarchical", "linear", "ddmin")
VERDICTS = ("aligned", "culprits", "diffuse", "unreachable", "budget")


# --- the search ---------------------------------------------------------------------------


def default_candidates(graph: nx.DiGraph) -> list[str]:
    """Top-level swappable units in execution order: the children of the model and of
    each layer, but not the layers themselves nor sub-units (the search reaches those)."""
    out = []
    for name, d in graph.nodes(data=True):
        if name == "model" or d["kind"] == "layer":
            continue
        up = parent(graph, name)
        if up == "model" or graph.nodes[up]["kind"] == "layer":
            out.append(name)
    return sorted(out, key=lambda n: graph.nodes[n]["order"])


def search(
    graph: nx.DiGraph,
    candidates: list[str],
    runner: TrialRunner,
    threshold: float,
    strategy: str = "hierarchical",
    local_rank: dict[str, int] | None = None,
    *,
    metric: str = "k3-mean",
    suspects=(),
    suspect_kinds=(),
    moved=(),
) -> SearchResult:
    """Find the smallest set of units whose swap brings the metric under `threshold`.

    `candidates` are the top-level units to start from (see `default_candidates`);
    sub-units are reached through the unit graph. `metric` only names the value in
    `stop_reason`. `suspects`: units known to differ from the reference before any trial
    (their checkpoint weights differ); when the search splits a run of units, the half
    holding one is tried first, before the local-error ranking decides; when they cover
    more than half of the layers of a kind, the kind-level hypotheses come first (see
    `_Search._kinds_first`). `suspect_kinds`: kinds that read a config value that differs
    (every unit of them does): the kind-level hypotheses come first, those kinds first.
    `moved`: suspects whose weights the checkpoint diff found in another layer (two layers'
    blocks exchanged, a layer index shifted): each differs on its own, so their spread over
    the layers of a kind is no sign of a kind-wide difference (they never put the kind-level
    hypotheses first).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if not candidates:
        raise ValueError("no candidate units to search")
    missing = [c for c in candidates if c not in graph]
    if missing:
        raise ValueError(f"candidates not in the unit graph: {', '.join(missing)}")
    return _Search(graph, list(candidates), runner, threshold, strategy, local_rank, metric, suspects,
                   suspect_kinds, moved).run()


def _plan_lengths(n_max: int, alone_singles: bool) -> dict[bool, list[list[tuple[int, int, int]]]]:
    """For each segment length n, the sizes a of the part to try next, with their
    (worst-case, summed) trial counts for finding and confirming a single fault;
    `options[True]` when some earlier part already failed.

    A unit found by elimination still needs its trial alone, one more. With
    `alone_singles` a single unit is tried alone, so when it fixes it needs no more;
    otherwise (see `_Search._minimise`) every unit found after a failed part does.
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


class _Search(Bisection, DeltaDebugging, Linear, KindHypotheses, Diffuse):
    """One search: the state every strategy reads (units, trials, threshold) and what they share;
    each strategy's steps live in a module of their own (hierarchical, ddmin, linear, kinds,
    diffuse)."""

    def __init__(self, graph, candidates, runner, threshold, strategy, local_rank, metric, suspects=(),
                 suspect_kinds=(), moved=()):
        self.g = graph
        self.suspect_units = [s for s in suspects if s in graph]
        self.moved = {s for s in moved if s in graph}
        self.narrowed: list[str] = []  # kind-level hypotheses that failed: their units in the layers not ruled out
        self.suspect_kinds = list(dict.fromkeys(suspect_kinds))
        # A suspect's ancestors are suspects too: the half holding its block goes first.
        self.suspects = {a for s in suspects if s in graph for a in (s, *self._ancestors(s))}
        self.runner = runner
        self.thr = threshold
        # How a sentence says "fixed": at a threshold of 0 (bitwise equal) "under 0" reads wrong.
        self._under = "to 0" if threshold == 0 else f"under {threshold:g}"
        self.strategy = strategy
        self.local_rank = local_rank or {}
        self.metric = metric
        self.baseline: float | None = None
        self.all_swapped: float | None = None
        self.found: list[str] = []  # culprits established so far, for a "budget" result
        self.best: list[str] | None = None  # the smallest set seen to fix, ditto
        # A candidate inside another candidate is searched as part of it.
        cands = list(dict.fromkeys(candidates))
        self.cands = [c for c in cands if not any(a in cands for a in self._ancestors(c))]
        self.top: dict[str, str] = {}  # unit searched -> the candidate it belongs to
        self.units = self._unit_list()
        self.pos = {u: i for i, u in enumerate(self.units)}
        # Trying single units alone saves trials, but a moe with three or more sub-units
        # then needs failing trials that cover all but one of them (see `_refine`).
        self.alone_singles = all(len(children(self.g, u)) <= 2 for u in self.units)
        self.options = _plan_lengths(len(self.units), self.alone_singles)
        # Kind-level hypotheses (`_systematic`): every unit of a kind found in two or more layers.
        self.by_kind: dict[str, list[str]] = {}
        for u in self.units:
            self.by_kind.setdefault(self._kind(u), []).append(u)
        self.kinds = [k for k, us in self.by_kind.items() if len(self._layers(us)) >= 2]
        self.systematic_tried: dict[bool, SearchResult | None] = {}  # need_all -> result, once tried

    # -- units --------------------------------------------------------------------------

    def _ancestors(self, name: str) -> list[str]:
        out, node = [], parent(self.g, name)
        while node is not None and node != "model":
            out.append(node)
            node = parent(self.g, node)
        return out

    def _unit_list(self) -> tuple[str, ...]:
        """Every unit the search can name: each candidate preceded by its sub-units
        (children before their parent, so a tried prefix never swaps a parent without
        its children); candidates from the last layer to the first, in execution order
        within a layer, so the first splits separate layer ranges and every trial's
        earliest swapped layer is as late as it can be (the layers before it are
        replayed by prefix reuse, and their order within the list costs no trials: a
        single fault takes the same bound wherever it sits)."""
        layered = [d["order"] for _, d in self.g.nodes(data=True) if d.get("layer") is not None]
        first_layer = min(layered, default=0)

        def key(c):
            layer = self.g.nodes[c]["layer"]
            if layer is None:
                layer = -1 if self._order(c) < first_layer else 1 << 30
            return (-layer, self._order(c))

        def post_order(u):
            out = []
            for k in children(self.g, u):
                out += post_order(k)
            return out + [u]

        units: list[str] = []
        for c in sorted(self.cands, key=key):
            for u in post_order(c):
                self.top[u] = c
                units.append(u)
        return tuple(units)

    def _swap_set(self, units) -> frozenset:
        """The units to swap, less any whose ancestor is swapped too."""
        s = set(units)
        return frozenset(u for u in s if not any(a in s for a in self._ancestors(u)))

    def _run(self, units, role: str) -> Trial:
        return self.runner.run(self._swap_set(units), role)

    def _fixes(self, units, role: str = "probe") -> bool:
        trial = self._run(units, role)
        fixed = trial.value <= self.thr
        if fixed and (self.best is None or len(trial.swapped) < len(self.best)):
            self.best = list(trial.swapped)
        return fixed

    def _order(self, name: str) -> int:
        return self.g.nodes[name]["order"]

    def _kind(self, name: str) -> str:
        return self.g.nodes[name]["kind"]

    # -- driving ------------------------------------------------------------------------

    def run(self) -> SearchResult:
        try:
            if self.strategy == "linear":
                return self._linear()
            return self._minimal()
        except BudgetExhausted:
            culprits = [self._culprit(u, run=False) for u in self.found]
            reason = f"max trials ({self.runner.max_trials}) reached before an answer"
            if self.found:
                reason += f"; culprits found so far: {', '.join(self.found)}"
            elif self.best is not None and len(self.best) < len(self.cands):
                reason += f"; smallest set seen to fix it: {', '.join(self.best)}"
            return self._result("budget", culprits, reason)

    def _start(self) -> SearchResult | None:
        """Baseline and all-swapped trials; the result if they settle it."""
        aligned = self._baseline()
        return aligned if aligned is not None else self._all_swapped()

    def _baseline(self) -> SearchResult | None:
        """The baseline trial (nothing swapped); "aligned" when it is already under the threshold."""
        base = self._run((), "baseline").value
        self.baseline = base
        if base <= self.thr:
            reason = f"baseline {self.metric} {base:.3g} is already {'0' if self.thr == 0 else self._under}"
            return self._result("aligned", [], reason)
        return None

    def _all_swapped(self) -> SearchResult | None:
        """Every candidate swapped; "unreachable" when that still does not fix it."""
        full = self._run(self.cands, "all-swapped").value
        self.all_swapped = full
        if not full <= self.thr:
            return self._result(
                "unreachable",
                [],
                f"swapping every candidate still leaves {self.metric} at {full:.3g} (threshold {self.thr:g})",
            )
        return None


    def _result(self, verdict, culprits, reason, contributions=None, systematic=None, diffuse_kinds=None) -> SearchResult:
        return SearchResult(
            verdict=verdict,
            culprits=culprits,
            baseline=self.baseline,
            all_swapped=self.all_swapped,
            threshold=self.thr,
            strategy=self.strategy,
            trials_used=self.runner.used,
            stop_reason=reason,
            contributions=contributions or {},
            systematic=systematic,
            diffuse_kinds=diffuse_kinds,
        )


    # -- verdicts and evidence ----------------------------------------------------------

    def _layers(self, names) -> set[int]:
        return {self.g.nodes[n]["layer"] for n in names} - {None}


    def _every_layer(self, units) -> bool:
        """`units` (with their candidates) touch every layer, and there are two or more."""
        all_layers = self._layers(self.cands)
        return len(all_layers) >= 2 and self._layers({self.top[u] for u in units}) >= all_layers


    def _complement_set(self, unit: str) -> list[str]:
        """Every candidate swapped except `unit` (for a sub-unit: its siblings swapped)."""
        swapped: list[str] = []
        node = unit
        while node not in self.cands:
            up = parent(self.g, node)
            swapped += [k for k in children(self.g, up) if k != node]
            node = up
        return [c for c in self.cands if c != node] + swapped

    def _culprit(self, unit: str, run: bool = True) -> Culprit:
        if run:
            alone = self._run([unit], "evidence-alone")
            comp = self._run(self._complement_set(unit), "evidence-complement")
        else:
            alone = self.runner.peek(self._swap_set([unit]))
            comp = self.runner.peek(self._swap_set(self._complement_set(unit)))
        return Culprit(
            unit=unit,
            kind=self._kind(unit),
            alone=alone.value if alone is not None else None,
            complement=comp.value if comp is not None else None,
            local_rank=self.local_rank.get(unit),
        )



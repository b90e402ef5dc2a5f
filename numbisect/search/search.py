"""Search: which swapped units make the engine agree with the reference.

A trial swaps a set of engine units for the reference's and measures the judged metric
(lower is better; "fixed" means value <= threshold). Trials are the unit of cost, so a
`TrialRunner` counts and caches them, and can be pre-loaded with the trials of an
interrupted run. This module is pure algorithm: no torch, no model.

One search is a `State` (numbisect.search.state: the units, the trial runner, the threshold,
and the verdict rule `State.fixed`, written there only) that each strategy takes: the
hierarchical one (numbisect.search.hierarchical, `Bisection`), ddmin's descent
(numbisect.search.ddmin), linear (numbisect.search.linear), the kind-level hypotheses
(numbisect.search.kinds, `KindHypotheses`) and the diffuse answer (numbisect.search.diffuse).

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
   (`hierarchical.Bisection._hypothesis`): the units the checkpoint diff found holding another layer's
   weights (`moved`), or, after kind-level hypotheses that fixed but were not kind-wide,
   their units in the layers not ruled out (`narrowed`); when it fixes, the culprits are a
   1-minimal subset of it.
4. Sub-units: a parent all of whose (two or more) children were found is named
   instead of them; a parent found whole is replaced by a proper subset of its
   children that fixes in its place, if one does (usually settled by trials already
   run, at no cost). Then a culprit the others fix without is dropped (`Bisection._prune`: the
   set is 1-minimal even where the metric saturated during the bisection).
5. Evidence per culprit: the value with only it swapped ("alone") and with every other
   candidate swapped ("complement": what it contributes on its own).
6. A minimal set that needs a unit from every layer (or every candidate) is "diffuse":
   no culprit is named and each layer's contribution is measured instead.
7. Kind-level hypotheses (`kinds.KindHypotheses`): every unit of a kind swapped, as `--swap
   KIND` does. A kind needed in (more than half of) its layers is a systematic culprit,
   the same difference in every layer (a kernel, a config value), when the kinds named are
   a proper subset of the kinds; when only every kind together fixes it, nothing was
   localised and the answer is "diffuse" with each kind's contribution (`diffuse_kinds`). They are tried as
   soon as the evidence says the divergence is spread, not after step 3: before it when
   the checkpoint diff names a config value a kind reads, or weights that differ in most
   layers of a kind; in step 3 when the unit found last does not fix alone (so not a
   single culprit) and the smallest set seen to fix touches every layer; after step 3
   when its minimal set needs every layer. When no kind is named, the search goes on
   from where it was, with the trials already run.

A single faulty unit among n (candidates plus their sub-units) costs at most
ceil(log2 n) + 1 trials in step 3 (the split sizes come from `hierarchical.plan_lengths`), so
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

from numbisect.model.units import parent
from numbisect.search.ddmin import ddmin
from numbisect.search.hierarchical import Bisection
from numbisect.search.kinds import KindHypotheses
from numbisect.search.linear import linear
from numbisect.search.state import Evidence, State, Units
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
    `KindHypotheses.first`). `suspect_kinds`: kinds that read a config value that differs
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
    units = Units(graph, list(candidates))
    evidence = Evidence.of(units, suspects, suspect_kinds, moved, local_rank)
    state = State(units, runner, threshold, strategy, metric, evidence)
    try:
        if strategy == "linear":
            return linear(state)
        descend = (lambda items: ddmin(state, items)) if strategy == "ddmin" else None
        return Bisection(state, KindHypotheses(state)).run(descend)
    except BudgetExhausted:
        return _out_of_budget(state)


def _out_of_budget(state: State) -> SearchResult:
    """The "budget" answer: the culprits established so far, with the evidence already run,
    else the smallest set seen to fix it."""
    culprits = [state.culprit(u, run=False) for u in state.found]
    reason = f"max trials ({state.runner.max_trials}) reached before an answer"
    if state.found:
        reason += f"; culprits found so far: {', '.join(state.found)}"
    elif state.best is not None and len(state.best) < len(state.units.cands):
        reason += f"; smallest set seen to fix it: {', '.join(state.best)}"
    return state.result("budget", culprits, reason)

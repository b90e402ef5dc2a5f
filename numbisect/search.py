"""Search: which swapped units make the engine agree with the reference.

A trial swaps a set of engine units for the reference's and measures the judged metric
(lower is better; "fixed" means value <= threshold). Trials are the unit of cost, so a
`TrialRunner` counts and caches them, and can be pre-loaded with the trials of an
interrupted run. This module is pure algorithm: no torch, no model.

The hierarchical strategy (the default):

1. Baseline trial (nothing swapped); already under the threshold -> "aligned".
2. Every candidate swapped; still over the threshold -> "unreachable".
3. Find a minimal set of candidates whose swap fixes it: bisection over the candidates
   ordered by (kind, layer), so the first splits separate kinds and later ones layer
   ranges. When half A does not fix, half B is assumed to and recursed into without a
   trial of its own; only if that optimistic path ends in a unit that does not fix does
   the search fall back to the several-culprit path (minimise one half with the other
   held swapped, then the other with the found part held), as in ddmin / QuickXplain.
   Split points come from a small dynamic programme over worst-case trial counts, so a
   single faulty unit among n (candidates plus their sub-units) costs at most
   ceil(log2 n) + 4 trials in all, evidence included.
4. Descend into the sub-units of each culprit (router / experts / shared_expert of a
   moe), with the rest of the found set held swapped; if no proper subset of the
   children fixes it, the parent itself is the culprit.
5. Evidence per culprit: the value with only it swapped ("alone") and with every other
   candidate swapped ("complement": what it contributes on its own).
6. A minimal set that needs a unit from every layer (or every candidate) is "diffuse":
   no culprit is named and each layer's contribution is measured instead.

"linear" swaps one unit at a time (the benchmark baseline); "ddmin" is Zeller's
delta debugging over the candidates, followed by steps 4-6.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Iterable

import networkx as nx

from numbisect.units import children

STRATEGIES = ("hierarchical", "linear", "ddmin")
VERDICTS = ("aligned", "culprits", "diffuse", "unreachable", "budget")

# One trial: the judged metric (and every other metric) with exactly these units swapped.
Evaluate = Callable[[frozenset], "tuple[float, dict]"]


# --- trials -------------------------------------------------------------------------------


@dataclass
class Trial:
    index: int  # 0-based order in which trials were run (resumed ones keep theirs)
    swapped: tuple[str, ...]  # sorted unit names
    value: float  # the judged metric (lower is better)
    metrics: dict  # everything the trial measured
    duration_s: float
    role: str  # baseline, all-swapped, probe, descent, evidence-alone, evidence-complement, contribution
    resumed: bool = False  # came from a resume log, not re-run

    def to_dict(self) -> dict:
        d = asdict(self)
        d["swapped"] = list(self.swapped)
        d["value"] = _json_float(self.value)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Trial":
        value = d["value"]
        return cls(
            index=int(d["index"]),
            swapped=tuple(sorted(d["swapped"])),
            value=math.nan if value is None else float(value),
            metrics=dict(d.get("metrics") or {}),
            duration_s=float(d.get("duration_s", 0.0)),
            role=str(d.get("role", "probe")),
            resumed=bool(d.get("resumed", False)),
        )


class BudgetExhausted(Exception):
    """A new trial was needed but `max_trials` trials have been used."""


class TrialRunner:
    """Runs trials through `evaluate`, once per swapped set, and keeps them in order.

    `on_trial(trial)` is called after every new trial (the CLI appends it to a JSONL
    log). `resumed` trials (from such a log) are reused by swapped-set lookup and never
    re-run; they count toward `max_trials`.
    """

    def __init__(
        self,
        evaluate: Evaluate,
        max_trials: int | None = None,
        on_trial: Callable[[Trial], None] | None = None,
        resumed: Iterable[Trial] = (),
    ):
        self.evaluate = evaluate
        self.max_trials = max_trials
        self.on_trial = on_trial
        self.trials: list[Trial] = []
        self._cache: dict[frozenset, Trial] = {}
        self.new_count = 0
        for t in resumed:
            t = replace(t, resumed=True)
            self.trials.append(t)
            self._cache.setdefault(frozenset(t.swapped), t)

    @property
    def used(self) -> int:
        """Trials that count toward `max_trials`: new ones and resumed ones."""
        return len(self.trials)

    def peek(self, swapped: Iterable[str]) -> Trial | None:
        """The earlier trial of this swapped set, if any; never runs one."""
        return self._cache.get(frozenset(swapped))

    def run(self, swapped: Iterable[str], role: str = "probe") -> Trial:
        key = frozenset(swapped)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        if self.max_trials is not None and self.used >= self.max_trials:
            raise BudgetExhausted(f"max trials ({self.max_trials}) reached")
        start = time.perf_counter()
        value, metrics = self.evaluate(key)
        trial = Trial(
            index=max((t.index for t in self.trials), default=-1) + 1,
            swapped=tuple(sorted(key)),
            value=float(value),
            metrics=dict(metrics or {}),
            duration_s=time.perf_counter() - start,
            role=role,
        )
        self.trials.append(trial)
        self._cache[key] = trial
        self.new_count += 1
        if self.on_trial is not None:
            self.on_trial(trial)
        return trial


# --- results ------------------------------------------------------------------------------


@dataclass
class Culprit:
    unit: str
    kind: str
    alone: float | None  # value with only this unit swapped (None: not measured, budget hit)
    complement: float | None  # value with every OTHER candidate swapped = its contribution
    local_rank: int | None  # rank by local error (1 = largest), if a ranking was given

    def to_dict(self) -> dict:
        d = asdict(self)
        d["alone"] = _json_float(self.alone)
        d["complement"] = _json_float(self.complement)
        return d


@dataclass
class SearchResult:
    verdict: str  # one of VERDICTS
    culprits: list[Culprit]
    baseline: float | None  # None only when the budget ran out before the baseline
    all_swapped: float | None
    threshold: float
    strategy: str
    trials_used: int
    stop_reason: str  # one human sentence
    contributions: dict[str, dict] = field(default_factory=dict)  # group -> {"alone", "complement"}

    def __bool__(self) -> bool:
        """True when an answer was established (aligned or culprits named)."""
        return self.verdict in ("aligned", "culprits")

    def to_dict(self) -> dict:
        return {
            "verdict": self.verdict,
            "culprits": [c.to_dict() for c in self.culprits],
            "baseline": _json_float(self.baseline),
            "all_swapped": _json_float(self.all_swapped),
            "threshold": self.threshold,
            "strategy": self.strategy,
            "trials_used": self.trials_used,
            "stop_reason": self.stop_reason,
            "contributions": {
                g: {k: _json_float(v) for k, v in d.items()} for g, d in self.contributions.items()
            },
        }


def _json_float(v: float | None) -> float | None:
    return None if v is None or math.isnan(v) else v


# --- the search ---------------------------------------------------------------------------


def default_candidates(graph: nx.DiGraph) -> list[str]:
    """Top-level swappable units in execution order: the children of the model and of
    each layer, but not the layers themselves nor sub-units (reached by descent)."""
    out = []
    for name, d in graph.nodes(data=True):
        if name == "model" or d["kind"] == "layer":
            continue
        parent = _parent(graph, name)
        if parent == "model" or graph.nodes[parent]["kind"] == "layer":
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
) -> SearchResult:
    """Find the smallest set of units whose swap brings the metric under `threshold`.

    `candidates` are the top-level units to start from (see `default_candidates`);
    sub-units are reached through the unit graph. `metric` only names the value in
    `stop_reason`.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if not candidates:
        raise ValueError("no candidate units to search")
    missing = [c for c in candidates if c not in graph]
    if missing:
        raise ValueError(f"candidates not in the unit graph: {', '.join(missing)}")
    return _Search(graph, list(candidates), runner, threshold, strategy, local_rank, metric).run()


class _NotFixing(Exception):
    """Internal: an optimistic branch ended in a set that does not fix."""


@dataclass
class _Cost:
    """Worst-case and summed trial counts of finding a single fault within some units."""

    worst_v: int  # when the set is known to fix
    worst_u: int  # when it is only assumed to
    answers: int  # distinct single-fault answers (the unit and its sub-units)
    total_v: int  # trials summed over those answers, known to fix
    total_u: int  # ... assumed to


class _Search:
    def __init__(self, graph, candidates, runner, threshold, strategy, local_rank, metric):
        self.g = graph
        self.cands = candidates
        self.runner = runner
        self.thr = threshold
        self.strategy = strategy
        self.local_rank = local_rank or {}
        self.metric = metric
        self.baseline: float | None = None
        self.all_swapped: float | None = None
        self.found: list[str] = []  # the current best answer, for a "budget" result
        self._item_costs: dict[str, _Cost] = {}
        self._planners: list[_Planner] = []
        self._top: tuple[str, ...] | None = None
        kinds_seen: list[str] = []
        for c in candidates:
            if self.g.nodes[c]["kind"] not in kinds_seen:
                kinds_seen.append(self.g.nodes[c]["kind"])
        self._kind_rank = {k: i for i, k in enumerate(kinds_seen)}
        layered = [d["order"] for _, d in graph.nodes(data=True) if d.get("layer") is not None]
        self._first_layer = min(layered, default=0)

    # -- driving ------------------------------------------------------------------------

    def run(self) -> SearchResult:
        try:
            if self.strategy == "linear":
                return self._linear()
            return self._minimal(ddmin=self.strategy == "ddmin")
        except BudgetExhausted:
            found = self.found
            culprits = [self._culprit(u, run=False) for u in found]
            what = f"; best set so far: {', '.join(found)}" if found else ""
            return self._result(
                "budget", culprits, f"max trials ({self.runner.max_trials}) reached before an answer{what}"
            )

    def _minimal(self, ddmin: bool) -> SearchResult:
        early = self._start()
        if early is not None:
            return early
        if ddmin:
            found = self._ddmin(self._ordered(self.cands))
            verified = True
        else:
            found, verified = self._minimise(self._top_order(), frozenset(), True, lazy=True)
        self.found = list(found)
        refined: dict[str, list[str] | None] = {}  # unit -> its sub-units, None: the unit itself
        if not verified:
            # A single unit reached optimistically: its sub-units' trials can prove it
            # (and name the sub-unit) before a trial of the unit alone is spent.
            (c,) = found
            sub = self._descend(c, frozenset()) if children(self.g, c) else None
            refined[c] = sub
            if sub is None and not self._fixes({c}, "probe"):
                refined = {}
                found, _ = self._minimise(self._top_order(), frozenset(), True)
                self.found = list(found)
        if self._is_diffuse(found):
            reason = (
                f"no set smaller than one touching every layer ({len(found)} units) brings "
                f"{self.metric} under {self.thr:g}: the divergence is spread out"
            )
            return self._diffuse(found, reason)
        final: list[str] = []
        current = list(found)
        for c in found:
            if c in refined:
                sub = refined[c]
            else:
                held = frozenset(current) - {c}
                sub = self._descend(c, held) if children(self.g, c) else None
            if sub is not None:
                current = [u for u in current if u != c] + sub
                self.found = list(current)
            final += sub if sub is not None else [c]
        final = sorted(final, key=self._order)
        self.found = final
        culprits = [self._culprit(u) for u in final]
        if len(final) == 1:
            reason = f"swapping {final[0]} alone brings {self.metric} under {self.thr:g}"
        else:
            reason = (
                f"swapping {', '.join(final)} together brings {self.metric} under {self.thr:g}; "
                "leaving any one of them in the engine does not"
            )
        return self._result("culprits", culprits, reason)

    def _start(self) -> SearchResult | None:
        """Baseline and all-swapped trials; the result if they settle it."""
        base = self.runner.run((), "baseline").value
        self.baseline = base
        if base <= self.thr:
            return self._result("aligned", [], f"baseline {self.metric} {base:.3g} is already under {self.thr:g}")
        full = self.runner.run(self.cands, "all-swapped").value
        self.all_swapped = full
        if not full <= self.thr:
            return self._result(
                "unreachable",
                [],
                f"swapping every candidate still leaves {self.metric} at {full:.3g} (threshold {self.thr:g})",
            )
        return None

    def _result(self, verdict, culprits, reason, contributions=None) -> SearchResult:
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
        )

    def _fixes(self, swapped, role: str) -> bool:
        return self.runner.run(swapped, role).value <= self.thr

    # -- minimising ---------------------------------------------------------------------

    def _minimise(self, items, held: frozenset, verified: bool, lazy: bool = False, top=None):
        """A 1-minimal subset M of `items` such that held + M fixes.

        Precondition: held + items fixes, known (`verified`) or assumed. An assumed set
        that turns out not to fix raises `_NotFixing`. With `lazy`, a single unit reached
        optimistically is returned untested, as (M, False). `top` forces the first split.
        """
        items = tuple(items)
        if len(items) == 1:
            if not verified and not lazy:
                if not self._fixes(held | set(items), "probe"):
                    raise _NotFixing
                verified = True
            return list(items), verified
        a, b = top if top is not None else self._split(items)
        if self._fixes(held | set(a), "probe"):
            return self._minimise(a, held, True, lazy)
        try:
            return self._minimise(b, held, False, lazy)
        except _NotFixing:
            if not verified:
                raise
        # held + a does not fix, and b's optimistic path failed somewhere below.
        if self._fixes(held | set(b), "probe"):
            return self._minimise(b, held, True)  # cached trials make the re-walk free
        found_a, _ = self._minimise(a, held | set(b), True)
        found_b, _ = self._minimise(b, held | set(found_a), True)
        return found_a + found_b, True

    def _descend(self, parent: str, held: frozenset) -> list[str] | None:
        """The sub-units of `parent` that fix it with `held` swapped, or None if no proper
        subset of its children does (the parent itself is then the culprit)."""
        kids = children(self.g, parent)
        if not kids:
            return None
        top = (tuple(kids[:-1]), (kids[-1],)) if len(kids) > 1 else None
        try:
            found, _ = self._minimise(kids, held, False, top=top)
        except _NotFixing:
            # Every maximal proper subset already failed (true when <= 2 children), or
            # all children together fail: by monotonicity, no proper subset fixes.
            if len(kids) <= 2 or not self._fixes(held | set(kids), "descent"):
                return None
            found, _ = self._minimise(kids, held, True, top=top)
        if set(found) == set(kids):
            return None
        out: list[str] = []
        for s in found:
            sub = self._descend(s, held | (set(found) - {s})) if children(self.g, s) else None
            out += sub if sub is not None else [s]
        return out

    def _ddmin(self, items) -> list[str]:
        """Zeller's ddmin: a 1-minimal subset of `items` that fixes (all of them do)."""
        current = list(items)
        n = 2
        while len(current) >= 2:
            size = len(current)
            chunks = [current[i * size // n : (i + 1) * size // n] for i in range(n)]
            chunks = [c for c in chunks if c]
            for chunk in chunks:
                if self._fixes(chunk, "probe"):
                    current, n = chunk, 2
                    break
            else:
                for chunk in chunks if n > 2 else []:
                    rest = [u for u in current if u not in chunk]
                    if self._fixes(rest, "probe"):
                        current, n = rest, max(n - 1, 2)
                        break
                else:
                    if n >= size:
                        break
                    n = min(size, 2 * n)
                    continue
            self.found = list(current)
        return current

    # -- planning the splits ------------------------------------------------------------

    def _order(self, name: str) -> int:
        return self.g.nodes[name]["order"]

    def _ordered(self, names, by_kind: bool = True) -> tuple[str, ...]:
        """By kind (in order of first appearance), then layer, then execution order;
        or, with `by_kind=False`, in execution order."""

        def key(n):
            d = self.g.nodes[n]
            layer = d["layer"]
            if layer is None:
                layer = -1 if d["order"] < self._first_layer else 1 << 30
            return (self._kind_rank.get(d["kind"], len(self._kind_rank)), layer, d["order"])

        return tuple(sorted(names, key=key if by_kind else self._order))

    def _top_order(self) -> tuple[str, ...]:
        """The candidates in (kind, layer) order, unless execution order needs fewer
        trials in the worst case (it can, when sub-units make some units costly)."""
        if self._top is None:
            by_kind = self._ordered(self.cands)
            by_exec = self._ordered(self.cands, by_kind=False)
            if len(by_kind) > 1 and self._seg(by_exec).worst_v < self._seg(by_kind).worst_v:
                self._top = by_exec
            else:
                self._top = by_kind
        return self._top

    def _item(self, name: str) -> _Cost:
        """Cost of finding a single fault inside one unit (itself or a sub-unit), as the
        descent in `_descend` does it."""
        if name in self._item_costs:
            return self._item_costs[name]
        kids = children(self.g, name)
        if not kids:
            cost = _Cost(0, 1, 1, 0, 1)
        elif len(kids) == 1:
            k = self._item(kids[0])
            worst = 1 + k.worst_v
            total = k.answers + k.total_v + 1
            cost = _Cost(worst, worst + 1, 1 + k.answers, total, total + 1)
        else:
            a = self._seg(tuple(kids[:-1]))
            last = self._item(kids[-1])
            parent = 2 + (len(kids) > 2)
            worst = max(1 + a.worst_v, 1 + last.worst_u, parent)
            total = a.answers + a.total_v + last.answers + last.total_u + parent
            cost = _Cost(worst, worst + 1, 1 + a.answers + last.answers, total, total + 1)
        self._item_costs[name] = cost
        return cost

    def _planner(self, items: tuple) -> tuple["_Planner", int, int]:
        for p in self._planners:
            i = p.pos.get(items[0])
            if i is not None and p.base[i : i + len(items)] == items:
                return p, i, i + len(items)
        p = _Planner(self, items)
        self._planners.append(p)
        return p, 0, len(items)

    def _seg(self, items: tuple) -> _Cost:
        if len(items) == 1:
            return self._item(items[0])
        p, i, j = self._planner(items)
        return p.seg(i, j)

    def _split(self, items: tuple) -> tuple[tuple, tuple]:
        """(a, b): a is tried next, b is assumed if a does not fix."""
        p, i, j = self._planner(items)
        (ai, aj), (bi, bj) = p.plan(i, j)[2:]
        return p.base[ai:aj], p.base[bi:bj]

    def _kind(self, name: str) -> str:
        return self.g.nodes[name]["kind"]

    # -- verdicts and evidence ----------------------------------------------------------

    def _layers(self, names) -> set[int]:
        return {self.g.nodes[n]["layer"] for n in names} - {None}

    def _is_diffuse(self, found) -> bool:
        if len(found) < 2:
            return False
        if set(found) >= set(self.cands):
            return True
        all_layers = self._layers(self.cands)
        return len(all_layers) >= 2 and self._layers(found) >= all_layers

    def _diffuse(self, found, reason: str) -> SearchResult:
        groups: dict[str, list[str]] = {}
        for layer in sorted(self._layers(self.cands)):
            groups[f"layers.{layer}"] = [c for c in self.cands if self.g.nodes[c]["layer"] == layer]
        for c in found:
            if self.g.nodes[c]["layer"] is None:
                groups[c] = [c]
        contributions = {}
        for name, units in groups.items():
            alone = self.runner.run(units, "contribution").value
            rest = [c for c in self.cands if c not in units]
            contributions[name] = {"alone": alone, "complement": self.runner.run(rest, "contribution").value}
        return self._result("diffuse", [], reason, contributions)

    def _complement_set(self, unit: str) -> list[str]:
        """Every candidate swapped except `unit` (for a sub-unit: its siblings swapped)."""
        swapped: list[str] = []
        node = unit
        while node not in self.cands:
            parent = _parent(self.g, node)
            if parent is None or parent == "model":
                break
            swapped += [k for k in children(self.g, parent) if k != node]
            node = parent
        return [c for c in self.cands if c != node] + swapped

    def _culprit(self, unit: str, run: bool = True) -> Culprit:
        get = self.runner.run if run else (lambda s, role: self.runner.peek(s))
        alone = get([unit], "evidence-alone")
        comp = get(self._complement_set(unit), "evidence-complement")
        return Culprit(
            unit=unit,
            kind=self._kind(unit),
            alone=alone.value if alone is not None else None,
            complement=comp.value if comp is not None else None,
            local_rank=self.local_rank.get(unit),
        )

    # -- linear -------------------------------------------------------------------------

    def _linear(self) -> SearchResult:
        base = self.runner.run((), "baseline").value
        self.baseline = base
        if base <= self.thr:
            return self._result("aligned", [], f"baseline {self.metric} {base:.3g} is already under {self.thr:g}")
        fixing: list[str] = []

        def visit(unit):
            if self._fixes([unit], "probe"):
                fixing.append(unit)
                self.found = list(fixing)
            for k in children(self.g, unit):
                visit(k)

        for c in sorted(self.cands, key=self._order):
            visit(c)
        # Name the most specific units: drop a unit when one of its sub-units fixes too.
        found = [u for u in fixing if not any(v != u and _contains(self.g, u, v) for v in fixing)]
        self.found = found
        if found:
            culprits = [self._culprit(u) for u in found]
            return self._result(
                "culprits",
                culprits,
                f"swapping {' or '.join(found)} alone brings {self.metric} under {self.thr:g}",
            )
        full = self.runner.run(self.cands, "all-swapped").value
        self.all_swapped = full
        if not full <= self.thr:
            return self._result(
                "unreachable",
                [],
                f"swapping every candidate still leaves {self.metric} at {full:.3g} (threshold {self.thr:g})",
            )
        reason = f"no single unit brings {self.metric} under {self.thr:g} alone; swapping every candidate does"
        return self._diffuse(list(self.cands), reason)


class _Planner:
    """Best splits of the segments of one ordered list of units (dynamic programming).

    A segment's cost is the worst-case number of trials to find and confirm a single
    faulty unit in it; it is the same whether the segment is known to fix or only
    assumed to, once it holds two units or more.
    """

    FULL = 40  # up to this many units every split point is tried; beyond, the middle ones

    def __init__(self, search: "_Search", base: tuple):
        self.s = search
        self.base = base
        self.pos = {u: i for i, u in enumerate(base)}
        self.items = [search._item(u) for u in base]
        self.answers = [0]
        for c in self.items:
            self.answers.append(self.answers[-1] + c.answers)
        g = search.g
        self.kind = [g.nodes[u]["kind"] for u in base]
        self.layer = [g.nodes[u]["layer"] for u in base]
        self.rank = [search.local_rank.get(u, math.inf) for u in base]
        self.weight = [2 ** c.worst_u for c in self.items]
        self.memo: dict[tuple[int, int], tuple] = {}
        self.rmin: dict[tuple[int, int], float] = {}

    def seg(self, i: int, j: int) -> _Cost:
        if j - i == 1:
            return self.items[i]
        worst, total = self.plan(i, j)[:2]
        return _Cost(worst, worst, self.answers[j] - self.answers[i], total, total)

    def min_rank(self, i: int, j: int) -> float:
        if (i, j) not in self.rmin:
            self.rmin[(i, j)] = min(self.rank[i:j])
        return self.rmin[(i, j)]

    def plan(self, i: int, j: int) -> tuple[int, int, tuple[int, int], tuple[int, int]]:
        """(worst, total, a, b) for segment [i, j): split into a (tried first) and b, by
        (worst-case trials, summed trials), then preferring kind boundaries, then layer
        boundaries, then the half holding the unit with the largest local error first."""
        if (i, j) in self.memo:
            return self.memo[(i, j)]
        n = j - i
        if n <= self.FULL:
            points = range(i + 1, j)
        else:  # near the weighted middle only, to stay fast on deep models
            half, acc, mid = sum(self.weight[i:j]) / 2, 0, i + 1
            for k in range(i, j):
                acc += self.weight[k]
                if acc >= half:
                    mid = min(max(k + 1, i + 1), j - 1)
                    break
            points = range(max(i + 1, mid - 4), min(j - 1, mid + 4) + 1)
        ranked = bool(self.s.local_rank)
        best = None
        for k in points:
            kind_edge = self.kind[k - 1] != self.kind[k]
            layer_edge = self.layer[k - 1] != self.layer[k]
            for a, b in (((i, k), (k, j)), ((k, j), (i, k))):
                ca, cb = self.seg(*a), self.seg(*b)
                worst = 1 + max(ca.worst_v, cb.worst_u)
                total = ca.answers + ca.total_v + cb.answers + cb.total_u
                first = ranked and self.min_rank(*a) < self.min_rank(*b)
                key = (worst, total, not kind_edge, not layer_edge, not first, a[0] != i)
                if best is None or key < best[0]:
                    best = (key, (worst, total, a, b))
        self.memo[(i, j)] = best[1]
        return best[1]


def _parent(g: nx.DiGraph, name: str) -> str | None:
    for u, _, d in g.in_edges(name, data=True):
        if d["rel"] == "contains":
            return u
    return None


def _contains(g: nx.DiGraph, outer: str, inner: str) -> bool:
    node = _parent(g, inner)
    while node is not None:
        if node == outer:
            return True
        node = _parent(g, node)
    return False

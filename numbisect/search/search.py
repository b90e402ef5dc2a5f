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

import math
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Iterable

import networkx as nx

from numbisect.model.units import children

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
    role: str  # baseline, all-swapped, probe, prune, evidence-alone, evidence-complement, contribution
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


class _Systematic(Exception):
    """Ends the descent: the kind-level hypotheses named a culprit (`result`)."""

    def __init__(self, result: "SearchResult"):
        super().__init__(result.stop_reason)
        self.result = result


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
        self._new = 0
        for t in resumed:
            t = replace(t, resumed=True)
            self.trials.append(t)
            self._cache.setdefault(frozenset(t.swapped), t)

    @property
    def new_count(self) -> int:
        """Trials run by this runner (not resumed)."""
        return self._new

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
        self._new += 1
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
    systematic: dict | None = None  # a kind-level culprit (`_Search._systematic`)

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
            **({"systematic": self.systematic} if self.systematic is not None else {}),
        }


def _json_float(v: float | None) -> float | None:
    return None if v is None or math.isnan(v) else v


# --- the search ---------------------------------------------------------------------------


def default_candidates(graph: nx.DiGraph) -> list[str]:
    """Top-level swappable units in execution order: the children of the model and of
    each layer, but not the layers themselves nor sub-units (the search reaches those)."""
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
    suspects=(),
    suspect_kinds=(),
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
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if not candidates:
        raise ValueError("no candidate units to search")
    missing = [c for c in candidates if c not in graph]
    if missing:
        raise ValueError(f"candidates not in the unit graph: {', '.join(missing)}")
    return _Search(graph, list(candidates), runner, threshold, strategy, local_rank, metric, suspects,
                   suspect_kinds).run()


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


class _Search:
    def __init__(self, graph, candidates, runner, threshold, strategy, local_rank, metric, suspects=(),
                 suspect_kinds=()):
        self.g = graph
        self.suspect_units = [s for s in suspects if s in graph]
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
        out, node = [], _parent(self.g, name)
        while node is not None and node != "model":
            out.append(node)
            node = _parent(self.g, node)
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
        base = self._run((), "baseline").value
        self.baseline = base
        if base <= self.thr:
            reason = f"baseline {self.metric} {base:.3g} is already {'0' if self.thr == 0 else self._under}"
            return self._result("aligned", [], reason)
        full = self._run(self.cands, "all-swapped").value
        self.all_swapped = full
        if not full <= self.thr:
            return self._result(
                "unreachable",
                [],
                f"swapping every candidate still leaves {self.metric} at {full:.3g} (threshold {self.thr:g})",
            )
        return None

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
            if self.strategy == "ddmin":
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

    def _result(self, verdict, culprits, reason, contributions=None, systematic=None) -> SearchResult:
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
        )

    # -- minimising ---------------------------------------------------------------------

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
                p = _parent(self.g, u)
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

    # -- verdicts and evidence ----------------------------------------------------------

    def _layers(self, names) -> set[int]:
        return {self.g.nodes[n]["layer"] for n in names} - {None}

    def _is_diffuse(self, found) -> bool:
        if len(found) < 2:
            return False
        tops = {self.top[u] for u in found}
        if tops >= set(self.cands):
            return True
        all_layers = self._layers(self.cands)
        return len(all_layers) >= 2 and self._layers(tops) >= all_layers

    def _every_layer(self, units) -> bool:
        """`units` (with their candidates) touch every layer, and there are two or more."""
        all_layers = self._layers(self.cands)
        return len(all_layers) >= 2 and self._layers({self.top[u] for u in units}) >= all_layers

    def _kinds_first(self) -> tuple[list[str], str] | None:
        """Kinds to try before the descent, from what is known before any trial: kinds
        that read a config value that differs (`suspect_kinds`), else kinds whose units'
        weights differ (`suspects`) in two or more layers and more than half of that
        kind's; None when there are none (one damaged unit is searched as usual)."""
        kinds = [k for k in self.suspect_kinds if k in self.kinds]
        if kinds:
            return kinds, f"the engine's config differs in a value every {', '.join(kinds)} unit reads"
        spread = []
        for k in self.kinds:
            hit = self._layers(u for u in self.suspect_units if self._kind(u) == k)
            if len(hit) >= 2 and 2 * len(hit) > len(self._layers(self.by_kind[k])):
                spread.append(k)
        if spread:
            return spread, f"the engine's weights differ in the {', '.join(spread)} units of most layers"
        return None

    @staticmethod
    def _middle_out(layers: list[int]) -> list[int]:
        """Layers from the middle outwards. A spread that looks systematic during the descent
        but is not is usually a culprit at each end (it needs the first layer and another):
        its middle layers are not needed, so trying them first rules it out soonest."""
        return sorted(layers, key=lambda x: (abs(2 * x - layers[0] - layers[-1]), x))

    def _systematic(self, first, trigger: str, need_all: bool) -> SearchResult | None:
        """Kind-level hypotheses, tried at most once per rule (see `_kinds`): the result, or
        None. When the lenient rule said None the strict one would too (it is never rerun)."""
        if need_all and self.systematic_tried.get(False, True) is None:
            return None
        if need_all not in self.systematic_tried:
            self.systematic_tried[need_all] = self._kinds(list(first), trigger, need_all)
        return self.systematic_tried[need_all]

    def _kinds(self, first: list[str], trigger: str, need_all: bool) -> SearchResult | None:
        """A kind-level culprit: the same difference in every layer (a kernel, or a config
        value, that every unit of a kind reads). Tried when the evidence says the divergence
        is spread (`trigger`, one of three): before the descent when the checkpoint diff says
        so (`_kinds_first`); during it, as soon as no single unit fixes it and the smallest
        set seen to fix touches every layer (`_minimise`); after it, when the minimal set
        needs every layer. Trials run here are kept: when no kind is named the descent goes
        on and reuses them (a resumed log replays this phase from its trials too).

        The rule: the kinds are a systematic culprit when each is needed in more than half
        of its layers (and at least two), and they are not every kind there is (that names
        the whole model: bf16 rounding noise spread over every unit, which is diffuse). During the descent (`need_all`) each must be
        needed in every one of its layers: the descent has not yet shown that the minimal
        set needs every layer, and a fault in some layers only is better named unit by unit
        (the descent goes on and does that; if its minimal set then needs every layer, the
        lenient rule is tried after it, from the trials already run).

        The hypotheses: every unit of a kind swapped, as `--swap KIND` does (the `first`
        kinds first, and together first when there are several: the kinds that read one
        config value); when no single kind is enough, kinds added in the order of how much
        each alone helped, then each dropped again that is not needed. Before the single
        kinds not in `first` (and before any combination), every unit of every kind
        together: when that does not fix, no set of kinds does (one trial rules them out);
        then the same with one of the two middle layers (`need_all`: each in turn) or the
        middle half of the layers left in the engine: when that fixes, the rule cannot
        hold (one or two more trials, and the usual end when the descent's evidence was a
        culprit at each end, or culprits in a few layers that include the first).

        Evidence, per kind and layer: the value with every unit of the named kinds swapped
        but that layer's units of that kind (its share; above the threshold: that layer is
        needed). One trial per kind and layer, not per unit (a layer has two norms). The
        shares stop as soon as the rule cannot hold (then None), so a named kind has every
        layer's share.
        """
        first = [k for k in first if k in self.kinds]
        kinds = first + [k for k in self.kinds if k not in first]
        if not kinds:
            return None

        def units_of(ks):
            return [u for k in ks for u in self.by_kind[k]]

        tried: dict[str, float] = {}  # each kind alone: value

        def fixes(ks) -> bool:
            if len(ks) > 1:
                return self._fixes(units_of(ks), "kinds")
            tried[ks[0]] = self._run(units_of(ks), "kind").value
            return tried[ks[0]] <= self.thr

        chosen = None
        if len(first) > 1 and fixes(first):  # the kinds that read one config value, together
            chosen = first
        for i, k in enumerate(kinds if chosen is None else ()):
            if i == len(first) and len(kinds) > 1:
                every = units_of(kinds)
                if not self._fixes(every, "kinds"):
                    return None
                # The two middle layers one at a time (`need_all`), or the middle half of the
                # layers, left in the engine: if that still fixes, the kinds cannot be needed
                # in enough layers.
                layers = self._middle_out(sorted(self._layers(every)))
                screens = [{x} for x in layers[:2]] if need_all else [set(layers[: (len(layers) + 1) // 2])]
                for middle in screens:
                    if self._fixes([u for u in every if self.g.nodes[u]["layer"] not in middle], "kinds screen"):
                        return None
            if fixes([k]):
                chosen = [k]
                break
        if chosen is None and len(kinds) > 1:
            order = sorted(kinds, key=lambda k: tried[k])
            for i in range(2, len(order) + 1):
                if fixes(order[:i]):
                    chosen = order[:i]
                    break
        for k in list(chosen or []):  # drop a kind the others fix without
            rest = [j for j in chosen if j != k]
            if rest and fixes(rest):
                chosen = rest
        if not chosen:
            return None
        units = units_of(chosen)
        if len(kinds) > 1 and all(k in chosen or self._covered(self.by_kind[k], set(units)) for k in kinds):
            return None  # every kind, in every layer: the whole model, which is diffuse (rounding noise everywhere)
        value = self._run(units, "kinds").value
        shares: dict[str, dict[str, float | None]] = {}
        needed: dict[str, list[int]] = {}
        for k in chosen:
            layers = sorted(self._layers(self.by_kind[k]))
            shares[k], needed[k] = {}, []
            for done, layer in enumerate(self._middle_out(layers), 1):
                left = {u for u in self.by_kind[k] if self.g.nodes[u]["layer"] == layer}
                v = self._run([x for x in units if x not in left], "kind share").value
                shares[k][f"layers.{layer}"] = _json_float(v)
                if not v <= self.thr:
                    needed[k].append(layer)
                can_be = len(layers) - (done - len(needed[k]))  # layers not yet ruled out
                if can_be < 2 or 2 * can_be <= len(layers) or (need_all and can_be < len(layers)):
                    return None
        shares = {k: dict(sorted(d.items(), key=lambda kv: int(kv[0].rpartition(".")[2]))) for k, d in shares.items()}
        layers = sorted({layer for k in chosen for layer in needed[k]})
        reason = (
            f"swapping every {', '.join(chosen)} unit ({len(units)} units) brings {self.metric} {self._under}, "
            f"and each layer's is needed in {len(layers)} of {len(self._layers(self.cands))} layers: a systematic "
            "culprit, the same difference in every layer (a kernel or a config value those units all read)"
        )
        info = {"kinds": list(chosen), "units": len(units), "layers": len(layers), "value": _json_float(value),
                "per_kind": {k: _json_float(v) for k, v in tried.items()}, "per_layer": shares, "trigger": trigger}
        return self._result("culprits", [], reason, systematic=info)

    def _covered(self, units: list[str], swapped: set[str]) -> bool:
        """Each of `units` is swapped, itself or through all of its sub-units (a moe block
        through its router, experts and shared expert)."""
        def done(u):
            kids = children(self.g, u)
            return u in swapped or bool(kids) and all(done(k) for k in kids)

        return all(done(u) for u in units)

    def _diffuse(self, found, reason: str) -> SearchResult:
        groups: dict[str, list[str]] = {}
        for layer in sorted(self._layers(self.cands)):
            groups[f"layers.{layer}"] = [c for c in self.cands if self.g.nodes[c]["layer"] == layer]
        for c in sorted({self.top[u] for u in found}, key=self._order):
            if self.g.nodes[c]["layer"] is None:
                groups[c] = [c]
        contributions = {}
        for name, units in groups.items():
            alone = self._run(units, "contribution").value
            rest = [c for c in self.cands if c not in units]
            contributions[name] = {"alone": alone, "complement": self._run(rest, "contribution").value}
        return self._result("diffuse", [], reason, contributions)

    def _complement_set(self, unit: str) -> list[str]:
        """Every candidate swapped except `unit` (for a sub-unit: its siblings swapped)."""
        swapped: list[str] = []
        node = unit
        while node not in self.cands:
            parent = _parent(self.g, node)
            swapped += [k for k in children(self.g, parent) if k != node]
            node = parent
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

    # -- linear -------------------------------------------------------------------------

    def _linear(self) -> SearchResult:
        base = self._run((), "baseline").value
        self.baseline = base
        if base <= self.thr:
            reason = f"baseline {self.metric} {base:.3g} is already {'0' if self.thr == 0 else self._under}"
            return self._result("aligned", [], reason)
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
        full = self._run(self.cands, "all-swapped").value
        self.all_swapped = full
        if not full <= self.thr:
            return self._result(
                "unreachable",
                [],
                f"swapping every candidate still leaves {self.metric} at {full:.3g} (threshold {self.thr:g})",
            )
        reason = (
            f"no single unit brings {self.metric} {self._under} alone; swapping every candidate does"
        )
        return self._diffuse(list(self.cands), reason)


def _parent(g: nx.DiGraph, name: str) -> str | None:
    for u, _, d in g.in_edges(name, data=True):
        if d["rel"] == "contains":
            return u
    return None

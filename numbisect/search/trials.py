"""Trials and results: one trial (`Trial`), the runner that counts, caches and resumes them
(`TrialRunner`), and what a search returns (`Culprit`, `SearchResult`). Pure data."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Iterable

# One trial: the judged metric (and every other metric) with exactly these units swapped.
Evaluate = Callable[[frozenset], "tuple[float, dict]"]


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
    systematic: dict | None = None  # a kind-level culprit (`KindHypotheses.systematic`)
    # diffuse because only every kind together fixes it: kinds, units, layers, value, per_kind
    # ({kind: {"alone", "complement"}}), per_layer (each kind's share per layer), trigger
    diffuse_kinds: dict | None = None

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
            **({"diffuse_kinds": self.diffuse_kinds} if self.diffuse_kinds is not None else {}),
        }


def _json_float(v: float | None) -> float | None:
    return None if v is None or math.isnan(v) else v

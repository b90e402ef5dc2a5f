"""Search: planted faults with known locations, judged by a fake monotone oracle.

The oracle: value(S) = noise floor + the contribution of every faulty unit left in the
engine (a unit counts as swapped if it or an ancestor is in S). The noise floor is
below the threshold, so swapping every faulty unit fixes it.
"""

import itertools
import json
import math
import random
import subprocess
import sys

import pytest

from numbisect.search import (
    BudgetExhausted,
    Trial,
    TrialRunner,
    default_candidates,
    search,
)
from numbisect.units import build_units, children, unit_graph

THR = 1e-3
FLOOR = 1e-5
HIT = 1e-2  # a planted fault: ten times the threshold


def model(num_layers=4, ffn="moe", subs=("router", "experts")):
    g = unit_graph(build_units(num_layers, [ffn] * num_layers, subs))
    return g, default_candidates(g)


def every_unit(g, cands):
    out = []

    def visit(u):
        out.append(u)
        for k in children(g, u):
            visit(k)

    for c in cands:
        visit(c)
    return out


def ancestors(g, u):
    chain = []
    while u != "model":
        chain.append(u)
        u = next(p for p, _, d in g.in_edges(u, data=True) if d["rel"] == "contains")
    return chain


class Oracle:
    """Counts its calls; `faults` maps a unit to what it adds while left in the engine."""

    def __init__(self, g, faults, floor=FLOOR):
        self.faults = {f: (HIT if isinstance(faults, (list, tuple, set)) else faults[f]) for f in faults}
        self.chains = {f: ancestors(g, f) for f in self.faults}
        self.floor = floor
        self.calls: list[frozenset] = []

    def value(self, swapped):
        return self.floor + sum(v for f, v in self.faults.items() if not set(self.chains[f]) & set(swapped))

    def __call__(self, swapped):
        self.calls.append(frozenset(swapped))
        return self.value(swapped), {"k3_mean": self.value(swapped)}


def run(g, cands, faults, strategy="hierarchical", **kw):
    oracle = Oracle(g, faults)
    result = search(g, cands, TrialRunner(oracle, **kw), THR, strategy)
    assert len(set(oracle.calls)) == len(oracle.calls), "a swapped set was evaluated twice"
    return result, oracle


def names(result):
    return [c.unit for c in result.culprits]


# --- a single fault: named exactly, within ceil(log2 n) + 4 trials ------------------------

CONFIGS = {
    "dense-2": (2, "mlp", ()),
    "moe-4": (4, "moe", ("router", "experts")),
    "moe-8": (8, "moe", ("router", "experts")),
    "moe-4-shared": (4, "moe", ("router", "experts", "shared_expert")),
    "moe-8-shared": (8, "moe", ("router", "experts", "shared_expert")),
}


@pytest.mark.parametrize("config", CONFIGS)
def test_single_fault_found_everywhere_within_bound(config):
    g, cands = model(*CONFIGS[config])
    units = every_unit(g, cands)
    bound = math.ceil(math.log2(len(units))) + 4
    worst = 0
    for fault in units:
        result, oracle = run(g, cands, [fault])
        assert result.verdict == "culprits", fault
        assert names(result) == [fault]
        assert result.trials_used == len(oracle.calls) <= bound, fault
        worst = max(worst, len(oracle.calls))
    assert worst <= bound


def test_bound_of_the_four_layer_moe_is_nine_trials():
    g, cands = model(4)
    assert len(cands) == 19 and len(every_unit(g, cands)) == 27
    for fault in ["embed", "lm_head", "layers.2.moe.experts", "layers.0.moe.router", "layers.3.moe"]:
        result, oracle = run(g, cands, [fault])
        assert names(result) == [fault]
        assert len(oracle.calls) <= 9


def test_fault_needing_router_and_experts_names_the_moe():
    g, cands = model(4)
    result, _ = run(g, cands, ["layers.2.moe.router", "layers.2.moe.experts"])
    assert result.verdict == "culprits"
    assert names(result) == ["layers.2.moe"]


def test_two_of_three_sub_units_are_named_not_the_moe():
    g, cands = model(4, subs=("router", "experts", "shared_expert"))
    result, _ = run(g, cands, ["layers.1.moe.router", "layers.1.moe.shared_expert"])
    assert names(result) == ["layers.1.moe.router", "layers.1.moe.shared_expert"]


def test_culprit_carries_alone_and_complement():
    g, cands = model(4)
    result, _ = run(g, cands, ["layers.2.moe.experts"])
    (c,) = result.culprits
    assert c.kind == "experts"
    assert c.alone == pytest.approx(FLOOR)  # swapping it alone fixes everything
    assert c.complement == pytest.approx(FLOOR + HIT)  # leaving it in costs its whole share
    assert result.baseline == pytest.approx(FLOOR + HIT)
    assert result.all_swapped == pytest.approx(FLOOR)
    assert result.stop_reason == "swapping layers.2.moe.experts alone brings k3-mean under 0.001"
    json.dumps(result.to_dict())


def test_trials_are_logged_with_their_role():
    g, cands = model(4)
    log = []
    oracle = Oracle(g, ["layers.2.attn"])
    search(g, cands, TrialRunner(oracle, on_trial=log.append), THR)
    roles = [t.role for t in log]
    assert roles[:2] == ["baseline", "all-swapped"] and roles[-1] == "evidence-complement"
    assert [t.index for t in log] == list(range(len(log))) and len(log) == len(oracle.calls)
    assert log[0].swapped == () and log[0].metrics == {"k3_mean": pytest.approx(FLOOR + HIT)}


def test_a_nan_trial_counts_as_not_fixed_and_writes_as_null():
    runner = TrialRunner(lambda s: (math.nan, {}))
    g, cands = model(1)
    result = search(g, cands, runner, THR)
    assert result.verdict == "unreachable"
    assert json.loads(json.dumps(runner.trials[0].to_dict()))["value"] is None
    assert math.isnan(Trial.from_dict(runner.trials[0].to_dict()).value)


# --- several faults -----------------------------------------------------------------------


def test_two_faults_in_different_layers_both_found():
    g, cands = model(4)
    result, _ = run(g, cands, ["layers.1.attn", "layers.3.moe.experts"])
    assert result.verdict == "culprits"
    assert names(result) == ["layers.1.attn", "layers.3.moe.experts"]
    attn, experts = result.culprits
    # Each alone leaves the other's share; each left in alone costs its own share.
    assert attn.alone == pytest.approx(FLOOR + HIT)
    assert attn.complement == pytest.approx(FLOOR + HIT)
    assert experts.alone == pytest.approx(FLOOR + HIT)


def test_three_faults_found():
    g, cands = model(4)
    faults = ["embed", "layers.0.moe.router", "layers.2.attn"]
    result, _ = run(g, cands, faults)
    assert result.verdict == "culprits"
    assert names(result) == faults


class AnyOf:
    """A monotone oracle that is not a sum: fixed when every unit of some clause is swapped."""

    def __init__(self, g, clauses):
        self.clauses = clauses
        self.chains = {u: ancestors(g, u) for c in clauses for u in c}
        self.calls: list[frozenset] = []

    def value(self, swapped):
        ok = any(all(set(self.chains[u]) & set(swapped) for u in c) for c in self.clauses)
        return FLOOR if ok else HIT

    def __call__(self, swapped):
        self.calls.append(frozenset(swapped))
        return self.value(swapped), {}


@pytest.mark.parametrize("strategy", ["hierarchical", "ddmin"])
@pytest.mark.parametrize("subs", [("router", "experts"), ("router", "experts", "shared_expert")])
def test_random_faults_give_a_one_minimal_most_specific_set(strategy, subs):
    """Any monotone oracle: the named set fixes it, leaving any one culprit in does not,
    and no culprit could be replaced by a proper subset of its sub-units."""
    g, cands = model(4, subs=subs)
    units = every_unit(g, cands)
    rng = random.Random(0)
    for i in range(150):
        if i % 2:
            faults = {u: rng.choice([HIT, 6e-4, 3e-4]) for u in rng.sample(units, rng.randint(1, 4))}
            oracle = Oracle(g, faults)
        else:
            oracle = AnyOf(g, [rng.sample(units, rng.randint(1, 3)) for _ in range(rng.randint(1, 3))])
        result = search(g, cands, TrialRunner(oracle), THR, strategy)
        assert len(set(oracle.calls)) == len(oracle.calls)
        if result.verdict == "aligned":
            assert oracle.value([]) <= THR
            continue
        if result.verdict == "diffuse":
            assert not result.culprits and result.contributions
            continue
        assert result.verdict == "culprits"
        found = names(result)
        assert oracle.value(found) <= THR, found
        for u in found:
            rest = [v for v in found if v != u]
            assert oracle.value(rest) > THR, (found, u)
            kids = children(g, u)
            for k in range(1, len(kids) if len(kids) > 1 else 0):
                for sub in itertools.combinations(kids, k):
                    assert oracle.value(rest + list(sub)) > THR, (found, u, sub)


# --- verdicts without culprits ------------------------------------------------------------


def test_no_fault_is_aligned_after_one_trial():
    g, cands = model(4)
    result, oracle = run(g, cands, [])
    assert result.verdict == "aligned"
    assert len(oracle.calls) == 1 and result.trials_used == 1
    assert result.culprits == []


def test_diffuse_when_every_layer_is_needed():
    g, cands = model(4)
    # Attention in layers 0 and 2, the MoE in layers 1 and 3: every layer is needed, and
    # no kind is wrong in more than half of its layers, so it is no kind-level culprit.
    faults = ["layers.0.attn", "layers.1.moe", "layers.2.attn", "layers.3.moe"]
    result, _ = run(g, cands, faults)
    assert result.verdict == "diffuse"
    assert result.culprits == [] and result.systematic is None
    assert sorted(result.contributions) == [f"layers.{i}" for i in range(4)]
    for c in result.contributions.values():
        assert c["alone"] == pytest.approx(FLOOR + 3 * HIT)  # three other layers left
        assert c["complement"] == pytest.approx(FLOOR + 1 * HIT)  # this layer's share
    assert "every layer" in result.stop_reason


@pytest.mark.parametrize("kinds", [("attn",), ("post_attn_norm",), ("attn", "moe"), ("experts",)])
def test_a_kind_wrong_in_every_layer_is_a_systematic_culprit(kinds):
    """The same fault in every layer (a kernel, a config value) is named as its kind(s), with
    each kind alone and each unit's share as evidence, not as 'diffuse'."""
    g, cands = model(4)
    faults = [f"layers.{i}.{k}" if k != "experts" else f"layers.{i}.moe.experts" for i in range(4) for k in kinds]
    result, _ = run(g, cands, faults)
    unit_kinds = sorted({g.nodes[f]["kind"] for f in faults})
    assert result.verdict == "culprits" and result.culprits == []
    sy = result.systematic
    assert sorted(sy["kinds"]) == unit_kinds
    assert sy["value"] == pytest.approx(FLOOR) and sy["layers"] == 4
    for k in unit_kinds:  # leaving any one faulty unit unswapped keeps exactly its fault
        faulty = {u: v for u, v in sy["per_unit"][k].items() if u in faults}
        assert len(faulty) == 4 and all(v == pytest.approx(FLOOR + HIT) for v in faulty.values())
    assert "systematic" in result.stop_reason
    assert result.to_dict()["systematic"] == sy


def test_a_kind_wrong_in_half_of_the_layers_is_not_systematic():
    g, cands = model(4)
    result, _ = run(g, cands, ["layers.0.attn", "layers.3.attn", "layers.1.moe", "layers.2.moe"])
    assert result.systematic is None


def test_unreachable_when_swapping_everything_is_not_enough():
    g, cands = model(4)
    oracle = Oracle(g, ["layers.1.attn"], floor=2 * THR)
    result = search(g, cands, TrialRunner(oracle), THR)
    assert result.verdict == "unreachable"
    assert len(oracle.calls) == 2
    assert result.all_swapped == pytest.approx(2 * THR)


def test_budget_exhaustion_returns_budget():
    g, cands = model(4)
    result, oracle = run(g, cands, ["layers.2.moe.experts"], max_trials=5)
    assert result.verdict == "budget"
    assert len(oracle.calls) == 5 and result.trials_used == 5
    assert "max trials (5)" in result.stop_reason
    json.dumps(result.to_dict())


def test_runner_refuses_past_max_trials():
    runner = TrialRunner(lambda s: (0.0, {}), max_trials=1)
    runner.run(["a"])
    assert runner.run(["a"]).index == 0  # a cache hit costs nothing
    with pytest.raises(BudgetExhausted):
        runner.run(["b"])


# --- cache and resume ---------------------------------------------------------------------


def test_runner_caches_by_swapped_set():
    calls = []
    runner = TrialRunner(lambda s: (calls.append(s) or 1.0, {}))
    first = runner.run(["b", "a"], role="probe")
    again = runner.run(("a", "b"), role="evidence-alone")
    assert again is first and first.swapped == ("a", "b") and first.role == "probe"
    assert len(calls) == 1 and runner.new_count == 1 and runner.used == 1


class Interrupted(Exception):
    pass


def test_resume_reruns_nothing_and_finds_the_same_culprits():
    g, cands = model(4)
    faults = ["layers.1.attn", "layers.3.moe.experts"]
    full, full_oracle = run(g, cands, faults)

    # An interrupted run: evaluate dies after 6 trials; the log holds those six.
    log: list[str] = []
    oracle = Oracle(g, faults)

    def dying(swapped):
        if len(oracle.calls) == 6:
            raise Interrupted
        return oracle(swapped)

    with pytest.raises(Interrupted):
        search(g, cands, TrialRunner(dying, on_trial=lambda t: log.append(json.dumps(t.to_dict()))), THR)
    done = [Trial.from_dict(json.loads(line)) for line in log]
    assert len(done) == 6

    again = Oracle(g, faults)
    runner = TrialRunner(again, resumed=done)
    result = search(g, cands, runner, THR)
    assert names(result) == names(full)
    assert not {frozenset(t.swapped) for t in done} & set(again.calls)
    assert len(done) + len(again.calls) == len(full_oracle.calls)
    assert [t.index for t in runner.trials] == list(range(len(runner.trials)))
    assert all(t.resumed for t in runner.trials[:6]) and not any(t.resumed for t in runner.trials[6:])


# --- linear and ddmin ---------------------------------------------------------------------


@pytest.mark.parametrize("fault", ["layers.2.moe.experts", "layers.2.moe", "lm_head", "embed"])
def test_linear_names_the_same_culprit(fault):
    g, cands = model(4)
    hier, hier_oracle = run(g, cands, [fault])
    result, oracle = run(g, cands, [fault], strategy="linear")
    assert result.verdict == "culprits"
    assert names(result) == names(hier) == [fault]
    n = len(every_unit(g, cands))
    assert len(oracle.calls) == n + 2  # baseline, every unit alone, one complement
    assert len(hier_oracle.calls) < len(oracle.calls) / 3
    assert result.culprits[0].alone == pytest.approx(FLOOR)


def test_linear_without_a_single_culprit_is_diffuse():
    g, cands = model(2)
    result, _ = run(g, cands, ["layers.0.attn", "layers.1.attn"], strategy="linear")
    assert result.verdict == "diffuse" and result.culprits == []


def test_ddmin_finds_single_and_double_faults():
    g, cands = model(4)
    result, _ = run(g, cands, ["layers.2.moe.experts"], strategy="ddmin")
    assert names(result) == ["layers.2.moe.experts"]
    result, _ = run(g, cands, ["layers.0.attn", "layers.2.moe"], strategy="ddmin")
    assert names(result) == ["layers.0.attn", "layers.2.moe"]


# --- inputs and the API -------------------------------------------------------------------


def test_local_rank_is_reported_and_a_misleading_one_keeps_the_bound():
    g, cands = model(4)
    units = every_unit(g, cands)
    misleading = {u: i + 1 for i, u in enumerate(reversed(units))}
    for fault in units:
        oracle = Oracle(g, [fault])
        result = search(g, cands, TrialRunner(oracle), THR, local_rank=misleading)
        assert names(result) == [fault] and len(oracle.calls) <= 9
        assert result.culprits[0].local_rank == misleading[fault]


def test_default_candidates_are_the_top_level_units():
    g, cands = model(1)
    assert cands == [
        "embed",
        "layers.0.input_norm",
        "layers.0.attn",
        "layers.0.post_attn_norm",
        "layers.0.moe",
        "final_norm",
        "lm_head",
    ]


def test_bad_inputs_are_refused():
    g, cands = model(1)
    runner = TrialRunner(lambda s: (0.0, {}))
    with pytest.raises(ValueError, match="unknown strategy"):
        search(g, cands, runner, THR, strategy="random")
    with pytest.raises(ValueError, match="not in the unit graph"):
        search(g, ["layers.7.attn"], runner, THR)


def test_search_imports_no_torch():
    code = "import sys, numbisect.search; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"

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

from numbisect.model.units import build_units, children, unit_graph
from numbisect.search.search import (
    BudgetExhausted,
    Trial,
    TrialRunner,
    default_candidates,
    search,
)

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
    for k in unit_kinds:  # leaving one layer's units of the kind unswapped keeps exactly its fault
        assert sy["per_layer"][k] == {f"layers.{i}": pytest.approx(FLOOR + HIT) for i in range(4)}
    assert "systematic" in result.stop_reason
    assert result.to_dict()["systematic"] == sy


def test_noise_in_every_unit_of_every_kind_is_diffuse_with_each_kinds_contribution():
    """The natural pair's shape: every unit of every layer differs a little (bf16 rounding), so
    only every kind together fixes it. Nothing is localised: "diffuse", not a systematic culprit
    of "attn, moe, norm", with each kind's contribution (alone; every other kind swapped)."""
    g, cands = model(4)
    faults = [u for u in every_unit(g, cands) if g.nodes[u]["layer"] is not None and not children(g, u)]
    result, oracle = run(g, cands, faults)
    assert result.verdict == "diffuse" and result.culprits == [] and result.systematic is None
    assert "spread over the whole model" in result.stop_reason and "systematic" not in result.stop_reason
    dk = result.diffuse_kinds
    assert sorted(dk["kinds"]) == ["attn", "moe", "norm"] and dk["layers"] == 4
    share = {"attn": 4, "moe": 8, "norm": 8}  # faulty units of each kind (a moe: router and experts)
    for k, n in share.items():
        assert dk["per_kind"][k]["alone"] == pytest.approx(FLOOR + (20 - n) * HIT)
        assert dk["per_kind"][k]["complement"] == pytest.approx(FLOOR + n * HIT)
    assert sorted(result.contributions) == ["final_norm"] + [f"layers.{i}" for i in range(4)]
    assert result.to_dict()["diffuse_kinds"] == dk
    json.dumps(result.to_dict())


def test_every_kind_needed_in_a_few_layers_is_localised_not_diffuse():
    """Three culprits of three kinds: every kind is needed, but not in most of its layers, so
    the search goes on and names the units."""
    g, cands = model(4)
    faults = ["layers.0.attn", "layers.1.input_norm", "layers.3.moe.experts"]
    result, _ = run(g, cands, faults)
    assert result.verdict == "culprits" and names(result) == faults and result.diffuse_kinds is None


def test_a_fault_in_every_layer_of_a_moe_is_still_systematic():
    """A proper subset of the kinds (the moe, with its router and experts) names a culprit."""
    g, cands = model(4)
    faults = [f"layers.{i}.moe.{s}" for i in range(4) for s in ("router", "experts")]
    result, _ = run(g, cands, faults)
    assert result.verdict == "culprits" and result.systematic["kinds"] == ["moe"]
    assert result.diffuse_kinds is None


KIND_ROLES = {"kind", "kinds", "kinds screen", "kind share"}


def kinds_with_two_layers(g, units):
    layers: dict[str, set] = {}
    for u in units:
        if g.nodes[u]["layer"] is not None:
            layers.setdefault(g.nodes[u]["kind"], set()).add(g.nodes[u]["layer"])
    return [k for k, ls in layers.items() if len(ls) >= 2]


@pytest.mark.parametrize("config", ["dense-2", "moe-4", "moe-8", "moe-4-shared"])
def test_single_faults_never_pay_for_the_kind_level_hypotheses(config):
    """The kinds are tried only once a single culprit is ruled out: a single fault's trials
    are those of the descent alone (ceil(log2 n) + 4 at most, test above)."""
    g, cands = model(*CONFIGS[config])
    for fault in every_unit(g, cands):
        runner = TrialRunner(Oracle(g, [fault]))
        result = search(g, cands, runner, THR)
        assert names(result) == [fault] and result.systematic is None
        assert not {t.role for t in runner.trials} & KIND_ROLES, fault


EVERY_LAYER = [("dense-2", "attn"), ("dense-2", "mlp"), ("moe-4", "attn"), ("moe-4", "post_attn_norm"),
               ("moe-4", "moe.experts"), ("moe-4", "moe.router"), ("moe-8", "attn"), ("moe-8", "input_norm"),
               ("moe-4-shared", "moe.shared_expert")]


@pytest.mark.parametrize("config,unit", EVERY_LAYER)
def test_a_fault_in_every_layer_is_named_as_its_kind_within_the_bound(config, unit):
    """Tried as soon as the descent's unit fails alone: at most ceil(log2 n) + 6 + K + L
    trials (K kinds found in two or more layers, L layers), where the diffuse descent took
    41-97 on four layers (measured before this bound)."""
    g, cands = model(*CONFIGS[config])
    layers = CONFIGS[config][0]
    units = every_unit(g, cands)
    faults = [f"layers.{i}.{unit}" for i in range(layers)]
    oracle = Oracle(g, faults)
    result = search(g, cands, TrialRunner(oracle), THR)
    kind = g.nodes[faults[0]]["kind"]
    assert result.verdict == "culprits" and result.systematic["kinds"] == [kind]
    assert result.systematic["layers"] == layers
    assert result.systematic["per_layer"][kind] == {f"layers.{i}": pytest.approx(FLOOR + HIT) for i in range(layers)}
    assert "touches every layer" in result.systematic["trigger"]
    bound = math.ceil(math.log2(len(units))) + 6 + len(kinds_with_two_layers(g, units)) + layers
    assert len(oracle.calls) == result.trials_used <= bound


def test_weights_that_differ_in_every_layer_are_tried_as_a_kind_first():
    """The checkpoint diff says every layer's post-attention norm differs: the kind goes
    first, so baseline, all-swapped, the kind, and one share per layer."""
    g, cands = model(4)
    faults = [f"layers.{i}.post_attn_norm" for i in range(4)]
    oracle = Oracle(g, faults)
    result = search(g, cands, TrialRunner(oracle), THR, suspects=faults)
    assert result.systematic["kinds"] == ["norm"] and result.systematic["layers"] == 4
    assert "weights differ" in result.systematic["trigger"]
    assert len(oracle.calls) == 2 + 1 + 4


def test_a_config_value_two_kinds_read_is_tried_as_those_kinds_together():
    g, cands = model(4)
    faults = [f"layers.{i}.{k}" for i in range(4) for k in ("input_norm", "attn")]
    oracle = Oracle(g, faults)
    result = search(g, cands, TrialRunner(oracle), THR, suspect_kinds=["norm", "attn"])
    sy = result.systematic
    assert sy["kinds"] == ["norm", "attn"] and "config" in sy["trigger"]
    assert sy["per_kind"] == {"norm": pytest.approx(FLOOR + 4 * HIT), "attn": pytest.approx(FLOOR + 4 * HIT)}
    # baseline, all-swapped, both kinds, each alone (neither is enough), one share per kind and layer
    assert len(oracle.calls) == 2 + 1 + 2 + 8


def test_a_harmless_config_difference_costs_a_few_trials_and_the_unit_is_still_named():
    g, cands = model(4)
    result, oracle = run(g, cands, ["layers.0.attn"])
    again = Oracle(g, ["layers.0.attn"])
    named = search(g, cands, TrialRunner(again), THR, suspect_kinds=["router"])
    assert names(named) == names(result) == ["layers.0.attn"] and named.systematic is None
    assert len(again.calls) <= len(oracle.calls) + 4


def test_one_damaged_unit_does_not_bring_the_kinds_first():
    g, cands = model(4)
    runner = TrialRunner(Oracle(g, ["layers.2.post_attn_norm"]))
    result = search(g, cands, runner, THR, suspects=["layers.2.post_attn_norm"])
    assert names(result) == ["layers.2.post_attn_norm"]
    assert not {t.role for t in runner.trials} & KIND_ROLES


def test_a_kind_wrong_in_three_of_four_layers_is_still_named_unit_by_unit():
    """The trigger fires (the descent's set touches every layer) but the kind is not needed
    in every layer: the descent goes on and names the three units, as before."""
    g, cands = model(4)
    faults = ["layers.0.attn", "layers.1.attn", "layers.2.attn"]
    result, _ = run(g, cands, faults)
    assert result.systematic is None and names(result) == faults


def test_a_culprit_at_each_end_costs_two_kind_trials():
    """The descent cannot tell a culprit in the first and the last layer from a systematic
    one; every kind swapped with a middle layer left in the engine fixes it, which rules
    the kinds out after two trials."""
    g, cands = model(4)
    runner = TrialRunner(Oracle(g, ["layers.0.attn", "layers.3.moe.experts"]))
    result = search(g, cands, runner, THR)
    assert names(result) == ["layers.0.attn", "layers.3.moe.experts"]
    assert [t.role for t in runner.trials if t.role in KIND_ROLES] == ["kinds", "kinds screen"]


def test_resume_in_the_middle_of_the_kind_level_hypotheses():
    g, cands = model(4)
    faults = [f"layers.{i}.attn" for i in range(4)]
    full = TrialRunner(Oracle(g, faults))
    want = search(g, cands, full, THR)
    start = next(t.index for t in full.trials if t.role in KIND_ROLES)
    for cut in (start + 1, start + 3, len(full.trials) - 2):
        log: list[str] = []
        oracle = Oracle(g, faults)

        def dying(swapped):
            if len(oracle.calls) == cut:
                raise Interrupted
            return oracle(swapped)

        with pytest.raises(Interrupted):
            search(g, cands, TrialRunner(dying, on_trial=lambda t: log.append(json.dumps(t.to_dict()))), THR)
        done = [Trial.from_dict(json.loads(line)) for line in log]
        again = Oracle(g, faults)
        result = search(g, cands, TrialRunner(again, resumed=done), THR)
        assert result.systematic == want.systematic and result.trials_used == want.trials_used
        assert len(again.calls) == len(full.trials) - cut
        assert not {frozenset(t.swapped) for t in done} & set(again.calls)


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
    code = "import sys, numbisect.search.search; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


class _Saturating:
    """Two planted faults, `b` far larger than `a`: while `b` is left in the engine every value
    is about 1e3 whatever else is swapped (it saturates); with `b` swapped, `a` adds HIT, and
    each swapped set reads the floor times a jitter of up to 150 (a swapped-in reference unit
    rounding differently), so a set can read above the threshold while a smaller one does not:
    the metric is not monotone, as real k3 near its floor is not."""

    def __init__(self, g, a, b, seed):
        self.ca, self.cb, self.seed = ancestors(g, a), ancestors(g, b), seed

    def _u(self, tag, s) -> float:
        import hashlib

        return int(hashlib.sha256(f"{tag}{self.seed}{','.join(sorted(s))}".encode()).hexdigest()[:8], 16) / 2**32

    def value(self, swapped):
        s = set(swapped)
        if not set(self.cb) & s:
            return 1e3 * (1 + self._u("b", s))
        return FLOOR * (1 + 150 * self._u("j", s) ** 3) + (0.0 if set(self.ca) & s else HIT)

    def __call__(self, swapped):
        return self.value(swapped), {"k3_mean": self.value(swapped)}


def test_culprits_are_one_minimal_where_the_metric_is_not_monotone():
    # Each culprit named is needed: the others swapped without it do not fix. Without the
    # final pruning step, 12 of these 300 draws named a unit the others fix without.
    g, cands = model(4)
    units = [n for n in g.nodes if n.startswith("layers.")]
    checked = 0
    for seed in range(300):
        rnd = random.Random(seed)
        a, b = rnd.sample(units, 2)
        if a.startswith(b + ".") or b.startswith(a + ".") or a == b:
            continue
        oracle = _Saturating(g, a, b, seed)
        found = [c.unit for c in search(g, cands, TrialRunner(oracle), THR, "hierarchical").culprits]
        for c in found:
            assert oracle.value([x for x in found if x != c]) > THR, (seed, a, b, found, c)
        checked += 1
    assert checked > 200

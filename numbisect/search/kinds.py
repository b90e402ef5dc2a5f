"""Kind-level hypotheses (step 7 of numbisect.search.search): every unit of a kind swapped, as
`--swap KIND` does; a kind needed in most of its layers is a systematic culprit."""

from __future__ import annotations

from numbisect.search.diffuse import diffuse
from numbisect.search.state import State, Units
from numbisect.search.trials import SearchResult, _json_float

# What a systematic culprit is in the search's own words; a caller that knows better (the
# checkpoint diff found the units' weights in other layers) replaces it.
KIND_WIDE = "a kernel or a config value those units all read"


def middle_out(layers: list[int]) -> list[int]:
    """Layers from the middle outwards. A spread that looks systematic during the descent
    but is not is usually a culprit at each end (it needs the first layer and another):
    its middle layers are not needed, so trying them first rules it out soonest."""
    return sorted(layers, key=lambda x: (abs(2 * x - layers[0] - layers[-1]), x))


def covered(units: Units, names: list[str], swapped: set[str]) -> bool:
    """Each of `names` is swapped: itself, an enclosing unit (a moe block's router with the
    block), or all of its sub-units (a moe block through its router, experts and shared
    expert)."""
    def done(u):
        kids = units.children(u)
        if u in swapped or any(a in swapped for a in units.ancestors(u)):
            return True
        return bool(kids) and all(done(k) for k in kids)

    return all(done(u) for u in names)


class KindHypotheses:
    """Step 7 over a search's `State`: tried at most once per rule (`systematic`). When they
    name nothing, `narrowed` holds the units of the kinds that fixed in the layers not ruled
    out, for the descent to try first (numbisect.search.hierarchical)."""

    def __init__(self, state: State):
        self.state = state
        self.units = state.units
        self.narrowed: list[str] = []
        self.tried: dict[bool, SearchResult | None] = {}  # need_all -> result, once tried

    def first(self) -> tuple[list[str], str] | None:
        """Kinds to try before the descent, from what is known before any trial: kinds
        that read a config value that differs (`suspect_kinds`), else kinds whose units'
        weights differ (`suspects`) in two or more layers and more than half of that
        kind's, not counting units whose weights came from another layer (`moved`: an
        exchange of two layers' blocks is two culprits, not a kind-wide difference); None
        when there are none (one damaged unit is searched as usual)."""
        ev, units = self.state.evidence, self.units
        kinds = [k for k in ev.suspect_kinds if k in units.kinds]
        if kinds:
            return kinds, f"the engine's config differs in a value every {', '.join(kinds)} unit reads"
        spread = []
        for k in units.kinds:
            hit = units.layers(u for u in ev.suspect_units if units.kind(u) == k and u not in ev.moved)
            if len(hit) >= 2 and 2 * len(hit) > len(units.layers(units.by_kind[k])):
                spread.append(k)
        if spread:
            return spread, f"the engine's weights differ in the {', '.join(spread)} units of most layers"
        return None

    def systematic(self, first, trigger: str, need_all: bool) -> SearchResult | None:
        """Kind-level hypotheses, tried at most once per rule (see `_kinds`): the result, or
        None. When the lenient rule said None the strict one would too (it is never rerun)."""
        if need_all and self.tried.get(False, True) is None:
            return None
        if need_all not in self.tried:
            self.tried[need_all] = self._kinds(list(first), trigger, need_all)
        return self.tried[need_all]

    def _kinds(self, first: list[str], trigger: str, need_all: bool) -> SearchResult | None:
        """A kind-level culprit: the same difference in every layer (a kernel, or a config
        value, that every unit of a kind reads). Tried when the evidence says the divergence
        is spread (`trigger`, one of three): before the descent when the checkpoint diff says
        so (`first`); during it, as soon as no single unit fixes it and the smallest set seen
        to fix touches every layer (`Bisection._minimise`); after it, when the minimal set
        needs every layer. Trials run here are kept: when no kind is named the descent goes
        on and reuses them (a resumed log replays this phase from its trials too).

        The rule: the kinds are a systematic culprit when each is needed in more than half
        of its layers (and at least two), and they are a proper subset of the kinds there are
        (kinds inside a chosen one, a moe's router and experts, count as chosen). When only
        every kind together fixes it and the rule holds, nothing was singled out: the answer
        is "diffuse" with each kind's contribution (`_every_kind`; bf16 rounding spread over
        every unit reads so). During the descent (`need_all`) each must be
        needed in every one of its layers: the descent has not yet shown that the minimal
        set needs every layer, and a fault in some layers only is better named unit by unit
        (the descent goes on and does that; if its minimal set then needs every layer, the
        lenient rule is tried after it, from the trials already run).

        The steps: the kinds that fix together (`_fixing_kinds`), less any the others fix
        without (`_drop_unneeded`); every unit of them swapped; each layer's share
        (`_shares`); the answer (`_named`, or `_every_kind`).
        """
        first = [k for k in first if k in self.units.kinds]
        kinds = first + [k for k in self.units.kinds if k not in first]
        if not kinds:
            return None
        alone: dict[str, float] = {}  # each kind alone: value
        chosen = self._fixing_kinds(first, kinds, alone, need_all)
        if chosen is not None:
            chosen = self._drop_unneeded(chosen, alone)
        if not chosen:
            return None
        units = self._units_of(chosen)
        # Every kind there is (a kind whose units sit inside a chosen kind's, a moe's router and
        # experts, counts as chosen): nothing was singled out. If each is needed in most layers
        # too (the shares below), the divergence is diffuse, not a kind-level culprit.
        whole = len(kinds) > 1 and all(k in chosen or covered(self.units, self.units.by_kind[k], set(units))
                                       for k in kinds)
        value = self.state.trial(units, "kinds").value
        shares = self._shares(chosen, units, need_all)
        if shares is None:
            return None
        per_layer, needed = shares
        n_layers = len({layer for k in chosen for layer in needed[k]})
        if whole:
            return self._every_kind(chosen, units, value, alone, per_layer, n_layers, trigger)
        return self._named(chosen, units, value, alone, per_layer, n_layers, trigger)

    def _units_of(self, kinds) -> list[str]:
        return [u for k in kinds for u in self.units.by_kind[k]]

    def _try(self, kinds: list[str], alone: dict[str, float]) -> bool:
        """Every unit of `kinds` swapped fixes it; a single kind's value is kept in `alone`."""
        if len(kinds) > 1:
            return self.state.fixes(self._units_of(kinds), "kinds")
        trial = self.state.trial(self._units_of(kinds), "kind")
        alone[kinds[0]] = trial.value
        return self.state.fixed(trial)

    def _fixing_kinds(self, first, kinds, alone, need_all) -> list[str] | None:
        """Kinds that fix together, or None: the `first` kinds together first when there are
        several (the kinds that read one config value); else each kind alone, the `first` ones
        first; else kinds added in the order of how much each alone helped. Before the single
        kinds not in `first`, the screen (`_ruled_out`) may say no set of kinds can hold."""
        if len(first) > 1 and self._try(first, alone):
            return first
        for i, k in enumerate(kinds):
            if i == len(first) and len(kinds) > 1 and self._ruled_out(kinds, need_all):
                return None
            if self._try([k], alone):
                return [k]
        if len(kinds) > 1:
            order = sorted(kinds, key=lambda k: alone[k])
            for i in range(2, len(order) + 1):
                if self._try(order[:i], alone):
                    return order[:i]
        return None

    def _ruled_out(self, kinds, need_all: bool) -> bool:
        """Every unit of every kind together: when that does not fix, no set of kinds does (one
        trial rules them out). Then the same with one of the two middle layers (`need_all`: each
        in turn) or the middle half of the layers left in the engine: when that still fixes,
        the kinds cannot be needed in enough layers (one or two more trials, and the usual end
        when the descent's evidence was a culprit at each end, or culprits in a few layers that
        include the first)."""
        every = self._units_of(kinds)
        if not self.state.fixes(every, "kinds"):
            return True
        layers = middle_out(sorted(self.units.layers(every)))
        screens = [{x} for x in layers[:2]] if need_all else [set(layers[: (len(layers) + 1) // 2])]
        for middle in screens:
            if self.state.fixes([u for u in every if self.units.layer(u) not in middle], "kinds screen"):
                return True
        return False

    def _drop_unneeded(self, chosen: list[str], alone) -> list[str]:
        """Drop a kind the others fix without, each in turn."""
        for k in list(chosen):
            rest = [j for j in chosen if j != k]
            if rest and self._try(rest, alone):
                chosen = rest
        return chosen

    def _shares(self, chosen, units, need_all) -> tuple[dict, dict] | None:
        """Evidence, per kind and layer: the value with every unit of the chosen kinds swapped
        but that layer's units of that kind (its share; when it does not fix, that layer is
        needed). One trial per kind and layer, not per unit (a layer has two norms), middle
        layers first. (shares, needed layers) per kind; None as soon as the rule cannot hold,
        with `narrowed` set to the units not ruled out (where to look first), so a named kind
        has every layer's share."""
        state, by_kind = self.state, self.units.by_kind
        shares: dict[str, dict[str, float | None]] = {}
        needed: dict[str, list[int]] = {}
        ruled: set[tuple[str, int]] = set()  # (kind, layer) whose share showed it is not needed
        for k in chosen:
            layers = sorted(self.units.layers(by_kind[k]))
            shares[k], needed[k] = {}, []
            for done, layer in enumerate(middle_out(layers), 1):
                left = {u for u in by_kind[k] if self.units.layer(u) == layer}
                trial = state.trial([x for x in units if x not in left], "kind share")
                shares[k][f"layers.{layer}"] = _json_float(trial.value)
                if not state.fixed(trial):
                    needed[k].append(layer)
                else:
                    ruled.add((k, layer))
                can_be = len(layers) - (done - len(needed[k]))  # layers not yet ruled out
                if can_be < 2 or 2 * can_be <= len(layers) or (need_all and can_be < len(layers)):
                    # not kind-wide; the units not ruled out are where to look first
                    self.narrowed = [u for u in units if (self.units.kind(u), self.units.layer(u)) not in ruled]
                    return None
        shares = {k: dict(sorted(d.items(), key=lambda kv: int(kv[0].rpartition(".")[2]))) for k, d in shares.items()}
        return shares, needed

    def _named(self, chosen, units, value, alone, shares, n_layers, trigger) -> SearchResult:
        """The systematic culprit: the chosen kinds, each alone, each layer's share."""
        state = self.state
        reason = (
            f"swapping every {', '.join(chosen)} unit ({len(units)} units) brings {state.metric} {state.under}, "
            f"and each layer's is needed in {n_layers} of {len(self.units.layers(self.units.cands))} layers: a "
            f"systematic culprit, the same difference in every layer ({KIND_WIDE})"
        )
        info = {"kinds": list(chosen), "units": len(units), "layers": n_layers, "value": _json_float(value),
                "per_kind": {k: _json_float(v) for k, v in alone.items()}, "per_layer": shares, "trigger": trigger}
        return state.result("culprits", [], reason, systematic=info)

    def _every_kind(self, chosen, units, value, alone, shares, n_layers, trigger) -> SearchResult:
        """Only every kind together fixes it, each needed in most layers: diffuse (bf16 rounding
        in every unit, say), with each kind's contribution: alone (only that kind swapped) and
        complement (every other kind swapped, that one left in the engine)."""
        state, by_kind = self.state, self.units.by_kind
        per_kind = {}
        for k in chosen:
            value_alone = alone[k] if k in alone else state.trial(by_kind[k], "kind").value
            rest = [u for j in chosen if j != k for u in by_kind[j]]
            per_kind[k] = {"alone": _json_float(value_alone),
                           "complement": _json_float(state.trial(rest, "kinds").value)}
        reason = (
            f"only every kind together ({', '.join(chosen)}: {len(units)} units) brings {state.metric} {state.under}, "
            f"no proper subset of the kinds does, and each is needed in {n_layers} of "
            f"{len(self.units.layers(self.units.cands))} layers: the divergence is spread over the whole model "
            "(diffuse, such as rounding in every unit), not one kernel or config value"
        )
        kinds = {"kinds": list(chosen), "units": len(units), "layers": n_layers, "value": _json_float(value),
                 "per_kind": per_kind, "per_layer": shares, "trigger": trigger}
        return diffuse(state, units, reason, kinds=kinds)

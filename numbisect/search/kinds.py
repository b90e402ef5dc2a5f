"""Kind-level hypotheses (step 7 of numbisect.search.search): every unit of a kind swapped, as
`--swap KIND` does; a kind needed in most of its layers is a systematic culprit."""

from __future__ import annotations

from numbisect.model.units import children
from numbisect.search.trials import SearchResult, _json_float

# What a systematic culprit is in the search's own words; a caller that knows better (the
# checkpoint diff found the units' weights in other layers) replaces it.
KIND_WIDE = "a kernel or a config value those units all read"


class KindHypotheses:
    """Step 7: kind-level hypotheses (mixed into `_Search`)."""

    def _kinds_first(self) -> tuple[list[str], str] | None:
        """Kinds to try before the descent, from what is known before any trial: kinds
        that read a config value that differs (`suspect_kinds`), else kinds whose units'
        weights differ (`suspects`) in two or more layers and more than half of that
        kind's, not counting units whose weights came from another layer (`moved`: an
        exchange of two layers' blocks is two culprits, not a kind-wide difference); None
        when there are none (one damaged unit is searched as usual)."""
        kinds = [k for k in self.suspect_kinds if k in self.kinds]
        if kinds:
            return kinds, f"the engine's config differs in a value every {', '.join(kinds)} unit reads"
        spread = []
        for k in self.kinds:
            hit = self._layers(u for u in self.suspect_units if self._kind(u) == k and u not in self.moved)
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
        of its layers (and at least two), and they are a proper subset of the kinds there are
        (kinds inside a chosen one, a moe's router and experts, count as chosen). When only
        every kind together fixes it and the rule holds, nothing was singled out: the answer
        is "diffuse" with each kind's contribution (`_every_kind`; bf16 rounding spread over
        every unit reads so). During the descent (`need_all`) each must be
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
        # Every kind there is (a kind whose units sit inside a chosen kind's, a moe's router and
        # experts, counts as chosen): nothing was singled out. If each is needed in most layers
        # too (the shares below), the divergence is diffuse, not a kind-level culprit.
        whole = len(kinds) > 1 and all(k in chosen or self._covered(self.by_kind[k], set(units)) for k in kinds)
        value = self._run(units, "kinds").value
        shares: dict[str, dict[str, float | None]] = {}
        needed: dict[str, list[int]] = {}
        ruled: set[tuple[str, int]] = set()  # (kind, layer) whose share showed it is not needed
        for k in chosen:
            layers = sorted(self._layers(self.by_kind[k]))
            shares[k], needed[k] = {}, []
            for done, layer in enumerate(self._middle_out(layers), 1):
                left = {u for u in self.by_kind[k] if self.g.nodes[u]["layer"] == layer}
                v = self._run([x for x in units if x not in left], "kind share").value
                shares[k][f"layers.{layer}"] = _json_float(v)
                if not v <= self.thr:
                    needed[k].append(layer)
                else:
                    ruled.add((k, layer))
                can_be = len(layers) - (done - len(needed[k]))  # layers not yet ruled out
                if can_be < 2 or 2 * can_be <= len(layers) or (need_all and can_be < len(layers)):
                    # not kind-wide; the units not ruled out are where to look first
                    self.narrowed = [u for u in units if (self._kind(u), self.g.nodes[u]["layer"]) not in ruled]
                    return None
        shares = {k: dict(sorted(d.items(), key=lambda kv: int(kv[0].rpartition(".")[2]))) for k, d in shares.items()}
        layers = sorted({layer for k in chosen for layer in needed[k]})
        if whole:
            return self._every_kind(chosen, units, value, tried, shares, len(layers), trigger)
        reason = (
            f"swapping every {', '.join(chosen)} unit ({len(units)} units) brings {self.metric} {self._under}, "
            f"and each layer's is needed in {len(layers)} of {len(self._layers(self.cands))} layers: a systematic "
            f"culprit, the same difference in every layer ({KIND_WIDE})"
        )
        info = {"kinds": list(chosen), "units": len(units), "layers": len(layers), "value": _json_float(value),
                "per_kind": {k: _json_float(v) for k, v in tried.items()}, "per_layer": shares, "trigger": trigger}
        return self._result("culprits", [], reason, systematic=info)

    def _every_kind(self, chosen, units, value, tried, shares, n_layers, trigger) -> SearchResult:
        """Only every kind together fixes it, each needed in most layers: diffuse (bf16 rounding
        in every unit, say), with each kind's contribution: alone (only that kind swapped) and
        complement (every other kind swapped, that one left in the engine)."""
        per_kind = {}
        for k in chosen:
            alone = tried[k] if k in tried else self._run(self.by_kind[k], "kind").value
            rest = [u for j in chosen if j != k for u in self.by_kind[j]]
            per_kind[k] = {"alone": _json_float(alone), "complement": _json_float(self._run(rest, "kinds").value)}
        reason = (
            f"only every kind together ({', '.join(chosen)}: {len(units)} units) brings {self.metric} {self._under}, "
            f"no proper subset of the kinds does, and each is needed in {n_layers} of {len(self._layers(self.cands))} "
            "layers: the divergence is spread over the whole model (diffuse, such as rounding in every unit), "
            "not one kernel or config value"
        )
        kinds = {"kinds": list(chosen), "units": len(units), "layers": n_layers, "value": _json_float(value),
                 "per_kind": per_kind, "per_layer": shares, "trigger": trigger}
        return self._diffuse(units, reason, kinds=kinds)

    def _covered(self, units: list[str], swapped: set[str]) -> bool:
        """Each of `units` is swapped: itself, an enclosing unit (a moe block's router with the
        block), or all of its sub-units (a moe block through its router, experts and shared
        expert)."""
        def done(u):
            kids = children(self.g, u)
            if u in swapped or any(a in swapped for a in self._ancestors(u)):
                return True
            return bool(kids) and all(done(k) for k in kids)

        return all(done(u) for u in units)

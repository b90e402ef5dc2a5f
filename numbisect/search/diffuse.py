"""A diffuse answer (step 6 of numbisect.search.search): a minimal set that needs a unit from
every layer names no culprit; each layer's contribution is measured instead."""

from __future__ import annotations

from numbisect.search.state import State, Units
from numbisect.search.trials import SearchResult


def is_diffuse(units: Units, found) -> bool:
    """`found` (two or more units) holds every candidate, or touches every layer."""
    if len(found) < 2:
        return False
    tops = {units.top[u] for u in found}
    if tops >= set(units.cands):
        return True
    all_layers = units.layers(units.cands)
    return len(all_layers) >= 2 and units.layers(tops) >= all_layers


def diffuse(state: State, found, reason: str, kinds: dict | None = None) -> SearchResult:
    """Each layer's contribution (and each unit outside the layers that `found` holds):
    alone (only its units swapped) and complement (every other candidate swapped).
    `kinds`: the kind-level evidence when only every kind together fixes it."""
    units = state.units
    groups: dict[str, list[str]] = {}
    for layer in sorted(units.layers(units.cands)):
        groups[f"layers.{layer}"] = [c for c in units.cands if units.layer(c) == layer]
    for c in sorted({units.top[u] for u in found}, key=units.order):
        if units.layer(c) is None:
            groups[c] = [c]
    contributions = {}
    for name, group in groups.items():
        alone = state.trial(group, "contribution").value
        rest = [c for c in units.cands if c not in group]
        contributions[name] = {"alone": alone, "complement": state.trial(rest, "contribution").value}
    return state.result("diffuse", [], reason, contributions, diffuse_kinds=kinds)

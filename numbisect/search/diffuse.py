"""A diffuse answer (step 6): a minimal set that needs a unit from every layer names no culprit;
each layer's contribution is measured instead."""

from __future__ import annotations

from numbisect.search.trials import SearchResult


class Diffuse:
    """Step 6: the diffuse answer (mixed into `_Search`)."""

    def _is_diffuse(self, found) -> bool:
        if len(found) < 2:
            return False
        tops = {self.top[u] for u in found}
        if tops >= set(self.cands):
            return True
        all_layers = self._layers(self.cands)
        return len(all_layers) >= 2 and self._layers(tops) >= all_layers

    def _diffuse(self, found, reason: str, kinds: dict | None = None) -> SearchResult:
        """Each layer's contribution (and each unit outside the layers that `found` holds):
        alone (only its units swapped) and complement (every other candidate swapped).
        `kinds`: the kind-level evidence when only every kind together fixes it."""
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
        return self._result("diffuse", [], reason, contributions, diffuse_kinds=kinds)

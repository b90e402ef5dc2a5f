"""`RoutingProbe`: installed on a backend for one forward, it records the expert ids the
backend really handed its experts (per MoE layer, per sample) and, for a replay, replaces
them by given ids (numbisect.pipeline.routing explains where it sits and how replay works)."""

from __future__ import annotations

import torch

from numbisect.common.errors import BackendError
from numbisect.model.arch.base import RouterSpec
from numbisect.model.router import router_units, weights_for
from numbisect.patching.ledger import installed


def experts_differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[T] bool: rows whose expert sets differ (order ignored)."""
    return (a.long().sort(dim=1).values != b.long().sort(dim=1).values).any(dim=1)


class RoutingProbe:
    """Records the expert ids a backend uses per MoE layer and sample; replays given ids.

    `replay`: router unit -> per-sample [T, k] ids to force (units not in it run freely).
    Use `install()` just before the forward and call what it returns after it (or let an
    arrangement install it: numbisect.patching.arrangement.arranged).
    """

    def __init__(self, backend, spec: RouterSpec, samples, replay: dict | None = None):
        self.backend = backend
        self.spec = spec
        self.lens = [len(s.ids) for s in samples]
        self.replay = replay or {}
        self.units = router_units(backend)
        self.ids: dict[str, list[torch.Tensor]] = {u: [] for u in self.units}
        self.replaced: dict[str, int] = {u: 0 for u in self.replay}  # tokens whose ids were replaced

    def _targets(self, unit: str, call: int, rows: int) -> tuple[list[int], list[int]]:
        """Samples covered by this call and their lengths; checks the row count."""
        bs = self.backend.batch_size  # samples per call of the backend's model
        first = call * bs
        idx = list(range(first, min(first + bs, len(self.lens))))
        lens = [self.lens[i] for i in idx]
        width = max(lens) if lens else 0
        if not idx or rows != width * len(idx):
            raise BackendError(f"routing probe on {unit}: call {call} has {rows} tokens, expected samples {idx} of lengths {lens}")
        return idx, lens

    def route(self, unit: str, call: int, logits: torch.Tensor, w: torch.Tensor, ids: torch.Tensor):
        """The (weights, ids) router `unit` hands its experts at its `call`-th call, from the
        backend's own: recorded, and where replayed replaced (weights from `logits`)."""
        idx, lens = self._targets(unit, call, ids.shape[0])
        width = max(lens)
        new_ids = ids
        if unit in self.replay:
            want = ids.clone()
            for j, (s, n) in enumerate(zip(idx, lens)):
                want[j * width : j * width + n] = self.replay[unit][s].to(ids.dtype)
            diff = experts_differ(want, ids)
            if bool(diff.any()):
                new_ids = torch.where(diff[:, None], want, ids)
                new_w = weights_for(logits, new_ids, self.spec).to(w.dtype)
                w = torch.where(diff[:, None], new_w, w)
                self.replaced[unit] += int(diff.sum())
        for j, n in enumerate(lens):
            self.ids[unit].append(new_ids[j * width : j * width + n].detach().to("cpu", torch.int64, copy=True))
        return w, new_ids

    def install(self):
        """Install the probe on its backend; returns the callable that takes it out."""
        return installed(lambda ledger: self.backend.install_routing_probe(self, ledger))

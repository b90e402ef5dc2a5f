"""Sparse attention's token selection as a backend records or replays it: `SelectionProbe`
(installed on a backend for one forward), the canonical selection mask of an indexer unit,
and the ids a replay hands the attention (numbisect.pipeline.selection explains the rest)."""

from __future__ import annotations

import math

import torch

from numbisect.common.errors import BackendError
from numbisect.patching.ledger import installed


def indexer_units(backend) -> list[str]:
    return [u.name for u in backend.units if u.kind == "indexer"]


def selection_mask(ids: torch.Tensor, first_row: int, width: int) -> torch.Tensor:
    """[rows, width] float32: 1 at the keys each query (at position first_row + r) picked,
    among the causal ones (key <= query position)."""
    ids = ids.detach().to("cpu", torch.int64).reshape(ids.shape[0], -1)
    rows = ids.shape[0]
    pos = torch.arange(first_row, first_row + rows)[:, None]
    ok = (ids >= 0) & (ids <= pos) & (ids < width)
    out = torch.zeros(rows, width + 1, dtype=torch.float32)
    out.scatter_(1, torch.where(ok, ids, torch.full_like(ids, width)), 1.0)
    return out[:, :width]


def replay_ids(ids: torch.Tensor, masks: list[torch.Tensor]) -> torch.Tensor:
    """`ids` [B, S, k] with each query whose picks differ from `masks[b]` ([n_b, n_b]) given
    the mask's keys instead (a query with fewer than k keys repeats its last one: the
    attention scatters them into a set)."""
    out = ids.clone()
    for b, m in enumerate(masks):
        have = selection_mask(ids[b, : m.shape[0]], 0, m.shape[0])
        for t in (have != m).any(dim=1).nonzero().flatten().tolist():
            keys = m[t].nonzero().flatten()
            if keys.numel() == 0:
                continue
            row = torch.cat([keys, keys[-1:].expand(max(0, ids.shape[-1] - keys.numel()))])[: ids.shape[-1]]
            out[b, t] = row.to(ids.dtype)
    return out


class SelectionProbe:
    """Records the keys each indexer picked, and its scores, per sample."""

    def __init__(self, backend, samples, replay: dict | None = None):
        self.backend = backend
        self.replay = replay or {}  # indexer unit -> per-sample [n, n] masks to hand the attention
        self.lens = [len(s.ids) for s in samples]
        self.units = indexer_units(backend)
        self.masks: dict[str, list[torch.Tensor]] = {u: [] for u in self.units}
        self.scores: dict[str, list[torch.Tensor]] = {u: [] for u in self.units}
        self.calls: dict[str, int] = {u: 0 for u in self.units}

    def record(self, unit: str, scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """One call of indexer `unit`: `scores` [B, S, S] (masked keys very negative or -inf),
        `ids` [B, S, k] the keys it returned; B samples of this call, right-padded. Returns
        the ids the attention gets: `ids`, or under replay the replayed picks."""
        bs = self.backend.batch_size
        first = self.calls[unit] * bs
        self.calls[unit] += 1
        if unit in self.replay:
            ids = replay_ids(ids, [self.replay[unit][first + j] for j in range(ids.shape[0])])
        for j in range(scores.shape[0]):
            if first + j >= len(self.lens):
                raise BackendError(f"selection probe on {unit}: more calls than samples ({len(self.lens)})")
            n = self.lens[first + j]
            s = scores[j, :n, :n].detach().to("cpu", torch.float64, copy=True)
            s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), -math.inf)
            self.scores[unit].append(s)
            self.masks[unit].append(selection_mask(ids[j, :n], 0, n))
        return ids

    def install(self):
        """Install the probe on its backend; returns the callable that takes it out."""
        return installed(lambda ledger: self.backend.install_selection_probe(self, ledger))

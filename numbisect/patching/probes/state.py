"""Linear attention's recurrent state as a backend records it: `StateProbe` (installed on a
backend for one forward) and the points at which states are measured (chunk boundaries,
a sample's prefix). numbisect.pipeline.recurrent explains the comparison."""

from __future__ import annotations

import torch

from numbisect.common.errors import BackendError
from numbisect.model.trace import Sample
from numbisect.patching.ledger import installed

CHUNK = 64  # chunk size of transformers' torch_chunk_gated_delta_rule and of vLLM's chunked delta rule


MAX_BOUNDARIES = 8  # chunk boundaries measured per sample (one more forward per side each)


def linear_units(backend) -> list[str]:
    """The units that carry a recurrent state: attention of the arch map's `linear` variant."""
    return [u.name for u in backend.units if u.kind == "attn" and getattr(u, "variant", "") == "linear"]


def boundaries(n: int, chunk: int = CHUNK, cap: int = MAX_BOUNDARIES) -> list[int]:
    """Token counts at which the state is measured before the sample's end: multiples of
    `chunk` below `n`, at most `cap` of them evenly spread (the last one kept)."""
    return spread(list(range(chunk, n, chunk)), cap)


def spread(b: list[int], cap: int = MAX_BOUNDARIES) -> list[int]:
    """At most `cap` of the sorted boundaries `b`, evenly spread (the first and last kept)."""
    if len(b) > cap:
        b = sorted({b[round(i * (len(b) - 1) / (cap - 1))] for i in range(cap)}) if cap > 1 else b[-1:]
    return b


def points(samples: list[Sample], chunk: int = CHUNK, cap: int = MAX_BOUNDARIES) -> list[tuple[int, int]]:
    """(sample, tokens) for every state measured: each chunk boundary, then the sample's end."""
    out = []
    for i, s in enumerate(samples):
        n = len(s.ids)
        out += [(i, L) for L in (boundaries(n, chunk, cap) if s.images is None else [])]
        out.append((i, n))
    return out


def prefix(s: Sample, L: int) -> Sample:
    """The sample's first L tokens, as a prompt of its own (the sample itself when L is its length)."""
    if L >= len(s.ids):
        return s
    return Sample(prompt_ids=list(s.ids[:L]), completion_ids=[], line=s.line)


class StateProbe:
    """Records, per linear unit, its recurrent state after the last token of each forward."""

    def __init__(self, backend):
        self.backend = backend
        self.units = linear_units(backend)
        self.last: dict[str, torch.Tensor] = {}
        self.source = ""  # where the backend reads the state (set by its install)
        # Decode mode: the token counts after which a call's state is kept as well (`steps`);
        # each call says how many tokens it ran (a prefill: the prompt; a step: one).
        self.at: set[int] = set()
        self.steps: dict[str, dict[int, torch.Tensor]] = {}
        self._seen: dict[str, int] = {}  # unit -> tokens its calls ran in this forward

    def record(self, unit: str, state: torch.Tensor, tokens: int | None = None) -> None:
        """One call of `unit`'s recurrence: `state` [heads, k_dim, v_dim] (or [1, ...]) after
        the call's last token. A later call of the same forward (a prefill in steps, a decode
        step) replaces it; with `tokens` (the call's token count) the state is also kept in
        `steps` when the tokens run so far are one of `at`."""
        if state.dim() == 4:
            if state.shape[0] != 1:
                raise BackendError(f"state probe on {unit}: {state.shape[0]} sequences in one call (expected one sample)")
            state = state[0]
        state = state.detach().to("cpu", copy=True)
        self.last[unit] = state
        if tokens is not None:
            seen = self._seen[unit] = self._seen.get(unit, 0) + int(tokens)
            if seen in self.at:
                self.steps.setdefault(unit, {})[seen] = state

    def take(self) -> dict[str, torch.Tensor]:
        """The states of the forward that just ran; the probe is then empty."""
        out, self.last = self.last, {}
        self._seen = {}
        return out

    def take_steps(self) -> dict[str, dict[int, torch.Tensor]]:
        """Per unit, the states kept at `at` token counts in the forward that just ran
        (`take` is still to be called for its last states)."""
        out, self.steps = self.steps, {}
        return out

    def install(self):
        """Install the probe on its backend; returns the callable that takes it out."""
        return installed(lambda ledger: self.backend.install_state_probe(self, ledger))

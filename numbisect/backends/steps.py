"""Decode-mode captures: put the calls of one prefill plus one-token steps back in token order.

In decode mode a sample of T = P + C tokens runs as one prefill of the P prompt tokens,
then one step per completion token, each feeding one token. So a module's hook fires
once per step, and the canonical capture (`[T, ...]`, as in prefill mode) is the
concatenation of those calls. The last completion token is never fed in a rollout (its
successor is never sampled); the backends run one extra forced step so that its
activations are captured too, and drop the logits of that step (they would predict
position T, outside the trace).

The logits (`lm_head`, T-1 rows for positions 0..T-2) arrive in another order on vLLM:
the prefill step's sampled row (position P-1), then the prompt log-prob rows (positions
0..P-2, when P > 1), then one row per decode step (positions P, P+1, ...).

1. `spans(...)` gives, per unit, the token positions each successive call covers.
2. `Steps.take(name, rows)` is called at each hook call and returns its positions
   (used to teacher-force the right rows of the reference's input too).
3. `Steps.stitch(name, calls)` concatenates the captured calls in position order and
   checks that they cover exactly the canonical rows.
"""

from __future__ import annotations

import torch

from numbisect.common.errors import BackendError
from numbisect.model.units import PREFILL_ONLY_KINDS


def vllm_logit_spans(P: int, T: int) -> list[tuple[int, int]]:
    """Positions of vLLM's successive logits calls for a forced decode of T tokens (plus one)."""
    out = [(P - 1, P)]
    if P > 1:
        out.append((0, P - 1))
    out += [(p, p + 1) for p in range(P, T)]
    return out


class Steps:
    """Per-unit cursor over the calls of one decode-mode sample."""

    def __init__(self, T: int, logit_spans: list[tuple[int, int]] | None = None):
        self.T = T
        self.logit_spans = logit_spans
        self._next: dict[str, int] = {}  # unit -> next position (sequential units)
        self._calls: dict[str, int] = {}  # unit -> calls seen (lm_head)

    def take(self, name: str, rows: int) -> tuple[int, int]:
        """The positions [start, stop) of this call of unit `name`, which has `rows` rows."""
        if name == "lm_head" and self.logit_spans is not None:
            k = self._calls.get(name, 0)
            self._calls[name] = k + 1
            if k >= len(self.logit_spans):
                return (self.T, self.T + rows)  # nothing canonical
            a, b = self.logit_spans[k]
            if b - a != rows:
                raise BackendError(f"decode mode: logits call {k} has {rows} rows, expected {b - a} (positions {a}..{b - 1})")
            return a, b
        a = self._next.get(name, 0)
        self._next[name] = a + rows
        return a, a + rows

    def stitch(self, name: str, calls: list[tuple[int, int, torch.Tensor]], index: int) -> torch.Tensor:
        """Concatenate `(start, stop, tensor)` calls into the canonical rows of `name`."""
        limit = self.T - 1 if name == "lm_head" else self.T
        kept = sorted(((a, b, t) for a, b, t in calls if a < limit), key=lambda c: c[0])
        pos = 0
        parts = []
        for a, b, t in kept:
            if a != pos:
                raise BackendError(
                    f"decode mode: captures of {name} for sample {index} do not line up (a call at position {a}, expected {pos})"
                )
            b = min(b, limit)
            parts.append(t[: b - a])
            pos = b
        if pos != limit:
            raise BackendError(f"decode mode: captures of {name} for sample {index} cover {pos} of {limit} positions")
        return torch.cat(parts)


def decode_captures(engine, names) -> list[str]:
    """The units of `names` a decode-mode forward captures: all but those on the prefill path
    only (`units.PREFILL_ONLY_KINDS`: they would cover the prompt's positions alone), which
    the report then shows without a decode-mode value."""
    return [n for n in names if engine.unit(n).kind not in PREFILL_ONLY_KINDS]

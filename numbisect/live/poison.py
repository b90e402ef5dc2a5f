"""Poison control for the weight-sync check: a sync that never wrote a tensor cannot pass.

The per-tensor check (numbisect.live.weights) compares what the engine holds with what the
reference holds now. A tensor the sync skipped still holds what the engine held before;
when that was already the reference's value (the sync pushed weights the engine had, or
an optimizer step that left a tensor unchanged), the skipped tensor comes out `ok`. Poison
control takes that case away (`Probe.poisoned`, `Probe.check_sync(sync, poison=True)`):

1. the engine's tensors are read back in the checkpoint's names (kept: what it held, to
   put back), and every one the reference names is overwritten with seeded random values
   (`poison_values`: each tensor's own mean and spread, differing from both what the engine
   held and the reference's value) through vLLM's own reload (numbisect.live.sync.push,
   which redoes the packing of each CPU GEMM weight, then the MoE experts' prepacking): the
   copies the kernels read hold the poison too. Each is read back again: one still equal
   to the reference's value, or to what it held (the reload never reached it), refuses
   the check (`PoisonError`), the engine put back as found first;
2. the user's sync runs;
3. the weight check, with the poison as the step before it (`POISON_LABEL`): a tensor
   still holding the poison is `unwritten` ("still the weights of poison (seed 0)");
4. the engine's tensors still holding the poison are put back to what they held before
   (one reload of every tensor: the ones the sync wrote as it wrote them, read back, the
   others as they were), so the engine ends as the sync alone would have left it; after a
   correct sync nothing is pushed, and the engine holds exactly what the sync wrote. A
   sync that raises: every tensor put back as found, the error raised on.

Costs one copy of the engine's weights (the read-back) for the block, one reload for the
poison and, when the sync missed something, one more. What poison cannot reach: buffers
(rotary caches: `buffer differs` stays the functional check's), and engine tensors of no
reference name (`WeightCheck.unmapped`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from numbisect.live.errors import LiveError

POISON_LABEL = "poison (seed {seed})"


class PoisonError(LiveError):
    """The poison did not reach a tensor (or could not be pushed): the check could not tell
    a tensor the sync never wrote; the engine was put back as found."""


def poison_values(current: dict[str, torch.Tensor], avoid: dict[str, set[str]], seed: int, digest) -> dict[str, torch.Tensor]:
    """Seeded random tensors, one per tensor of `current` (the engine's, read back), in its
    shape and dtype: normal around the tensor's mean with its spread (at least 10% of
    the mean's size and 1e-2: a norm weight of ones gets values around one), so an
    unwritten unit still computes finite numbers. `avoid`: per name, digests the poison
    must not have (the reference's value, what the engine held); `digest`: the digest."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in sorted(current):
        t = current[name]
        x = t.detach().float()
        mean = float(x.mean()) if x.numel() else 0.0
        spread = max(float(x.std()) if x.numel() > 1 else 0.0, 0.1 * abs(mean), 1e-2)
        p = (torch.randn(t.shape, generator=g) * spread + mean).to(t.dtype)
        while p.numel() and digest(p) in avoid.get(name, ()):  # (random values equal to these: never seen)
            p = (p.float() + spread).to(t.dtype)
        out[name] = p
    return out


@dataclass
class Poisoned:
    """One poisoned sync (`Probe.poisoned`): filled in as the block runs and ends."""

    seed: int
    label: str  # the poison's step in the weight history: what an unwritten tensor "still holds"
    tensors: int = 0  # tensors poisoned
    seconds: float = 0.0  # reading back, poisoning, reading back again
    check: object = None  # the WeightCheck after the sync (None until the block ends)
    left: list[str] = field(default_factory=list)  # tensors the sync left holding the poison
    restored: bool = False  # whether those were put back to what they held before
    restore_seconds: float = 0.0
    digests: dict[str, str] = field(default_factory=dict)  # name -> the poison's digest, read back

    def to_dict(self) -> dict:
        return {"seed": self.seed, "label": self.label, "tensors": self.tensors, "seconds": round(self.seconds, 4),
                "left": self.left, "restored": self.restored, "restore_seconds": round(self.restore_seconds, 4)}


def still_poisoned(now: dict[str, str], poisoned: Poisoned) -> list[str]:
    """The tensors whose digests `now` (the engine's, read back) are the poison's still."""
    return sorted(n for n, d in now.items() if poisoned.digests.get(n) == d)


def put_back(now: dict[str, torch.Tensor], saved: dict[str, torch.Tensor], names) -> dict[str, torch.Tensor]:
    """What to push so the engine holds `now` except `names`, which get `saved`'s values."""
    names = set(names)
    return {n: (saved[n] if n in names else t) for n, t in now.items() if n in saved}


def timed(t0: float) -> float:
    return time.perf_counter() - t0

"""Poison control for the weight-sync check: a sync that never wrote a tensor cannot pass.

The per-tensor check (numbisect.live.weights) compares what the engine holds with what the
reference holds now. A tensor the sync skipped still holds what the engine held before;
when that was already the reference's value (the sync pushed weights the engine had, or
an optimizer step that left a tensor unchanged), the skipped tensor comes out `ok`. Poison
control takes that case away (`Probe.poisoned`, `Probe.check_sync(sync, poison=True)`):

1. the engine's tensors are read back in the checkpoint's names (kept: what it held, to
   put back), and every one the reference names is overwritten with seeded random values
   (`poison_against`, `poison_tensor`: each tensor's own mean and spread, differing byte
   for byte from both what the engine held and the reference's value, the reference read
   one layer at a time) through vLLM's own reload (numbisect.live.sync.push, which redoes
   the packing of each CPU GEMM weight, then the MoE experts' prepacking): the copies the
   kernels read hold the poison too. Each is read back again, as the kernels read it
   (`read_poison`): one still equal to the reference's value, or to what it held (the
   reload never reached it), refuses the check (`PoisonError`), the engine put back as
   found first;
2. the user's sync runs;
3. the weight check, with the poison as the step before it (`POISON_LABEL`): a tensor
   still holding the poison is `unwritten` ("still the weights of poison (seed 0)");
4. the engine's tensors still holding the poison are put back to what they held before
   (one reload of every tensor: the ones the sync wrote as it wrote them, read back, the
   others as they were), so the engine ends as the sync alone would have left it; after a
   correct sync nothing is pushed, and the engine holds exactly what the sync wrote. A
   sync that raises: every tensor put back as found, the error raised on.

Costs one copy of the engine's weights (the read-back) for the block, one reload for the
poison and, when the sync missed something, one more; the model's bytes hashed twice
besides the check's own two passes (the reference's values, the poison read back: what the
engine held and the poison are compared byte for byte, not hashed). benchmarks/live_cost.py
measures a cycle against a forward plus a sync (docs/measurements.md). What poison cannot reach: buffers
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


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold the same bytes (dtype, shape and every byte: what equal
    digests say, without hashing either)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(*(t.detach().to("cpu").contiguous().view(-1).view(torch.uint8) for t in (a, b)))


def _holds(p: torch.Tensor, avoid, digest) -> bool:
    """Whether `p` holds one of `avoid`: digests (compared with `digest(p)`, computed once),
    tensors (cast to p's dtype, compared byte for byte), None (nothing)."""
    mine = None
    for a in avoid:
        if isinstance(a, torch.Tensor):
            if same_bytes(p, a.to(p.dtype)):
                return True
        elif a is not None:
            mine = digest(p) if mine is None else mine
            if mine == a:
                return True
    return False


def poison_tensor(t: torch.Tensor, avoid, g: torch.Generator, digest=None) -> torch.Tensor:
    """Seeded random values in `t`'s shape and dtype (`t`: the engine's tensor, read back):
    normal around its mean with its spread (at least 10% of the mean's size and 1e-2: a norm
    weight of ones gets values around one), so an unwritten unit still computes finite
    numbers. `avoid`: what the poison must not hold (the reference's value, what the engine
    held), as tensors (compared byte for byte in t's dtype: no hashing) or digests (`digest`)."""
    x = t.detach().float()
    mean = float(x.mean()) if x.numel() else 0.0
    spread = max(float(x.std()) if x.numel() > 1 else 0.0, 0.1 * abs(mean), 1e-2)
    p = torch.randn(t.shape, generator=g).mul_(spread).add_(mean).to(t.dtype)
    while p.numel() and _holds(p, avoid, digest):  # (random values equal to these: never seen)
        p = (p.float() + spread).to(t.dtype)
    return p


def poison_values(current: dict[str, torch.Tensor], avoid: dict[str, set], seed: int, digest) -> dict[str, torch.Tensor]:
    """`poison_tensor` of every tensor of `current` (the engine's, read back), in sorted
    names from one generator seeded `seed`. `avoid`: per name, what its poison must not
    hold (digests by `digest`, or tensors)."""
    g = torch.Generator().manual_seed(seed)
    return {name: poison_tensor(current[name], avoid.get(name, ()), g, digest) for name in sorted(current)}


def poison_against(layers, saved: dict[str, torch.Tensor], seed: int, digest) -> tuple[dict, dict[str, str]]:
    """(poison, target) for every tensor of `saved` (the engine's, read back) that the
    reference names, its tensors given one layer at a time (`layers`: a ReferenceReader's):
    each poison (`poison_tensor`, one generator seeded `seed`, in the reference's order)
    differs byte for byte from what the engine held and from the reference's value in the
    engine's dtype; `target`: the digest of that value (what a tensor the poison never
    reached may read back). Only one layer of the reference's tensors at a time."""
    g = torch.Generator().manual_seed(seed)
    poison, target = {}, {}
    for _, tensors in layers:
        for name in sorted(tensors):
            if name in saved:
                ref = tensors[name].to("cpu", saved[name].dtype)  # a trainer's tensor on an accelerator read here
                target[name] = digest(ref)
                poison[name] = poison_tensor(saved[name], (saved[name], ref), g)
    return poison, target


def read_poison(units, saved: dict[str, torch.Tensor], target: dict[str, str], digest) -> tuple[dict[str, str], list[str]]:
    """The engine's tensors read back after the poison, unit by unit (`units`: its
    UnitReader): (the digest of each tensor of `saved`, the ones the poison did not reach:
    not read back, holding what the engine held before (byte for byte) or the reference's
    value (`target`))."""
    got, missed = {}, []
    for _, tensors in units:
        for name, t in tensors.items():
            if name in saved:
                got[name] = digest(t)
                if got[name] == target.get(name) or same_bytes(t, saved[name]):
                    missed.append(name)
    return got, sorted(missed + [n for n in saved if n not in got])


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

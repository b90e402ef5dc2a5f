"""A trigger fed the training loop's own per-batch numbers: when the trainer and the
rollout engine disagree, it fires, and (optionally) runs the weight check and a comparison.

1. Each batch, `feed(trainer_logprobs, rollout_logprobs, mask)` computes the batch's
   mismatch: the mean per-token k3 of log r = logp_trainer - logp_rollout over the masked
   (response) tokens, as verl's `rollout_corr` k3 does (numbisect.pipeline.metrics.k3_of). Or
   `feed_value(x)`: a number the framework logged already (verl's k3, TRL's
   `sampling/sampling_logp_difference`).
2. It fires when the value is above `threshold`, at least `cooldown` batches after its
   last fire, and at most `max_fires` times. A NaN or inf value fires too (a broken batch
   is not "under the threshold").
3. On a fire it calls `on_fire(fire)`; `probe_action(probe, out_dir)` makes one that runs
   the weight check and, when the batch's token ids were fed, a comparison on them, and
   writes both reports under `out_dir` (numbered by the fire).

A batch with no token to compare (empty, or its mask all false) is no evidence either way:
it warns (`EmptyBatchWarning`), neither fires nor counts as under the threshold, and its
value is recorded as NaN (`skipped` lists its step). Every input the trigger cannot use
(log-probs that are not numbers of one shape, a mask that is not booleans, a threshold,
cooldown or max_fires of the wrong type) is an `InputError` of one line.

A batch that does not fire costs a subtraction, an exp and a mean over the batch's
tokens: nothing is kept but a few numbers per fire.
"""

from __future__ import annotations

import math
import numbers
import os
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch

from numbisect.common.errors import InputError
from numbisect.pipeline.metrics import k3_of
from numbisect.report.document import write_json_atomic


@dataclass
class Fire:
    """One firing: the batch it fired on and why."""

    step: int  # the batch's index, counted from 0 (or the step the caller gave)
    value: float  # the batch's mismatch
    threshold: float
    samples: list | None = None  # the batch's token ids, when fed (a comparison can run on them)
    results: dict = field(default_factory=dict)  # what on_fire put there (paths of reports, verdicts)

    def to_dict(self) -> dict:
        return {"step": self.step, "value": self.value, "threshold": self.threshold, "results": self.results}


class EmptyBatchWarning(UserWarning):
    """A batch with no token to compare (empty, or fully masked): not counted."""


def _numbers(x, what: str) -> torch.Tensor:
    """`x` (a tensor, nested lists of numbers) as float64; anything else one InputError."""
    if isinstance(x, (str, bytes)):
        raise InputError(f"{what}: expected numbers (a tensor or nested lists), got {type(x).__name__}")
    try:
        t = torch.as_tensor(x, dtype=torch.float64)
    except (ValueError, TypeError, RuntimeError, OverflowError) as e:
        raise InputError(f"{what}: not numbers of one shape ({str(e).splitlines()[0][:120]})") from None
    return t


def _mask(mask, shape) -> torch.Tensor:
    if isinstance(mask, (str, bytes)):
        raise InputError(f"mask: expected booleans (a tensor or nested lists), got {type(mask).__name__}")
    try:
        m = torch.as_tensor(mask)
    except (ValueError, TypeError, RuntimeError, OverflowError) as e:
        raise InputError(f"mask: not booleans of one shape ({str(e).splitlines()[0][:120]})") from None
    if m.dtype != torch.bool and (m.is_floating_point() or m.is_complex() or bool(((m != 0) & (m != 1)).any())):
        raise InputError("mask: expected booleans or 0/1 (which tokens count)")
    if tuple(m.shape) != tuple(shape):
        raise InputError(f"the mask's shape {tuple(m.shape)} is not the log-probs' {tuple(shape)}")
    return m.bool()


def batch_tokens(trainer_logprobs, rollout_logprobs, mask=None) -> tuple[float, int]:
    """(mean per-token k3 of log r = trainer - rollout over the tokens of `mask`, the number of
    those tokens); NaN when there are none."""
    a = _numbers(trainer_logprobs, "trainer log-probs")
    b = _numbers(rollout_logprobs, "rollout log-probs")
    if a.shape != b.shape:
        raise InputError(f"trainer and rollout log-probs differ in shape: {tuple(a.shape)} vs {tuple(b.shape)}")
    k3 = k3_of(a - b)
    if mask is not None:
        k3 = k3[_mask(mask, a.shape)]
    return (float(k3.mean()) if k3.numel() else math.nan), int(k3.numel())


def batch_k3(trainer_logprobs, rollout_logprobs, mask=None) -> float:
    """Mean per-token k3 of log r = trainer - rollout over the tokens of `mask` (all when
    None); tensors or nested lists of the same shape. NaN when no token counts (an empty or
    fully masked batch is not "no mismatch")."""
    return batch_tokens(trainer_logprobs, rollout_logprobs, mask)[0]


@dataclass
class Trigger:
    """Fires on batches whose mismatch is above `threshold` (module doc)."""

    threshold: float = 1e-3  # the DESIGN's equivalence threshold on mean k3
    cooldown: int = 10  # batches after a fire during which it does not fire again
    max_fires: int = 3
    on_fire: Callable[[Fire], None] | None = None
    fires: list[Fire] = field(default_factory=list)
    seen: int = 0  # batches fed
    last_fire: int | None = None
    values: list[float] = field(default_factory=list)  # every batch's value, in order
    skipped: list[int] = field(default_factory=list)  # steps of batches with no token to compare

    def __post_init__(self):
        th = self.threshold
        if isinstance(th, bool) or not isinstance(th, numbers.Real) or not (th >= 0 and math.isfinite(th)):
            raise InputError(f"threshold must be a finite number >= 0, got {th!r}")
        for name in ("cooldown", "max_fires"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
                raise InputError(f"{name} must be a whole number >= 0, got {v!r}")
        if self.on_fire is not None and not callable(self.on_fire):
            raise InputError(f"on_fire must be callable, got {type(self.on_fire).__name__}")

    def _step(self, step) -> int:
        if step is None:
            return self.seen
        if isinstance(step, bool) or not isinstance(step, numbers.Integral):
            raise InputError(f"step must be a whole number, got {step!r}")
        return int(step)

    def feed(self, trainer_logprobs, rollout_logprobs, mask=None, *, step: int | None = None, samples=None) -> Fire | None:
        """One batch's trainer and rollout log-probs (and response mask): the Fire, if it fired.
        A batch with no token to compare warns and is skipped (module doc)."""
        value, tokens = batch_tokens(trainer_logprobs, rollout_logprobs, mask)
        if tokens == 0:
            step = self._step(step)
            self.seen += 1
            self.values.append(math.nan)
            self.skipped.append(step)
            warnings.warn(f"numbisect trigger: batch {step} has no token to compare (empty, or its mask all false): "
                          "not counted as under the threshold", EmptyBatchWarning, stacklevel=2)
            return None
        return self.feed_value(value, step=step, samples=samples)

    def feed_value(self, value: float, *, step: int | None = None, samples=None) -> Fire | None:
        """One batch's mismatch as the framework computed it: the Fire, if it fired."""
        step = self._step(step)
        if isinstance(value, (str, bytes, bool)):
            raise InputError(f"value must be a number, got {value!r}")
        try:
            value = float(value)
        except (TypeError, ValueError, OverflowError, RuntimeError) as e:
            raise InputError(f"value must be a number ({str(e).splitlines()[0][:120]})") from None
        self.seen += 1
        self.values.append(value)
        above = not (value <= self.threshold)  # NaN fires
        cooling = self.last_fire is not None and step - self.last_fire <= self.cooldown
        if not above or cooling or len(self.fires) >= self.max_fires:
            return None
        fire = Fire(step, value, self.threshold, samples)
        self.fires.append(fire)
        self.last_fire = step
        if self.on_fire is not None:
            self.on_fire(fire)
        return fire


def probe_action(probe, out_dir: str | os.PathLike) -> Callable[[Fire], None]:
    """An `on_fire` that runs `probe.check_weights()` and, when the batch's token ids were
    fed, `probe.compare(samples)`, writing `fire-N-weights.json` / `fire-N-compare.json`
    under `out_dir`; the verdicts and paths go into `fire.results`."""
    os.makedirs(out_dir, exist_ok=True)

    def act(fire: Fire) -> None:
        n = len([f for f in os.listdir(out_dir) if f.endswith("-weights.json")]) + 1
        check = probe.check_weights(samples=fire.samples, step=f"fire {n} (batch {fire.step})")
        path = os.path.join(out_dir, f"fire-{n}-weights.json")
        if check.functional:
            probe.weights_report(check).save(path)
        else:
            write_json_atomic(path, {"weights": check.to_dict()})
        fire.results["weights_ok"] = check.ok
        fire.results["weights_differ"] = {u.unit: u.status for u in check.differing()}
        fire.results["weights_report"] = path
        if fire.samples is not None and probe.problem is None:
            report = probe.compare(fire.samples)
            path = os.path.join(out_dir, f"fire-{n}-compare.json")
            report.save(path)
            fire.results["verdict"] = report.verdict
            fire.results["compare_report"] = path

    return act

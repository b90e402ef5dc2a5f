"""Prefix reuse: a trial replays the leading layers it shares with an earlier trial.

1. Every trial run with prefix reuse records each decoder layer's raw output, once per
   forward call (hf: one call per batch, vLLM: one per sample): the residual stream,
   and on vLLM the `(hidden_states, residual)` pair whose sum the next layer's fused
   norm takes. The first such trial is the baseline (planted faults on, nothing
   swapped). Outputs are kept on the CPU and copied to the engine's device at replay.
2. A new trial with swapped set S can skip layers 0..L-1 when an earlier recording R
   swapped exactly the same units before layer L (the embedding included; for the
   baseline: S swaps nothing before L). It takes the largest such L over the recordings
   (L = number of layers when only `final_norm` / `lm_head` differ). Layers 0..L-1 are
   replaced for that trial by `Replay` modules that return R's outputs for this call:
   layers 0..L-2 hand on the recorded object itself (the next `Replay` ignores it),
   layer L-1 a copy, since the engine's fused norms update their inputs in place. The
   embedding still runs; from layer L on everything runs as usual, swaps and faults
   included, and is recorded (the replayed layers' entries are shared with R).
3. Why this equals a full recomputation: layers 0..L-1 would run the same modules (the
   same units swapped, the same planted faults, which are part of the cache key: a
   fault before L is inside the recording) on the same inputs as in R, so they would
   compute R's outputs again, as long as the engine is deterministic run to run (which
   the swap self-check already relies on). Tests check it bit for bit against a full
   recomputation. On vLLM the skipped layers write no KV cache: numbisect's requests
   are single prefills (`max_tokens=1`), which never read it.
4. Each replay checks that its call sees as many tokens as the recorded one and that
   every recorded call was used; anything else is a BackendError (the engine did not
   run the trace as the recording did), never a silent mix of two runs.

Memory: a recording holds layers x tokens x hidden values (twice on vLLM), as much as a
capture of every layer's output; later recordings hold only the layers they computed
(the replayed layers' entries are shared, and counted once). The baseline and the
`keep` most recently used other recordings are kept, within `max_bytes`
(`--prefix-cache-mb`, default `DEFAULT_MB`): the least recently used others are dropped
first; when the baseline alone does not fit, recording stops for the rest of the run
(`disabled` says why) and trials recompute every layer. The peak is the budget plus the
recording of the trial running. With tensor parallelism each worker keeps its own
recordings and this side only the swapped sets (`note`); both make the same choices
from the same sequence of trials, so there the count is the only bound.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from numbisect.common.errors import BackendError
from numbisect.patching.ledger import Ledger
from numbisect.patching.modules import carry_layer_flags, hidden_arg

HINT = "run with --no-prefix-reuse"
DEFAULT_MB = 4096.0  # --prefix-cache-mb: recorded layer outputs kept across trials


def num_layers(engine) -> int:
    return sum(1 for u in engine.units if u.kind == "layer")


def layer_starts(engine) -> list[int]:
    """start[L]: the execution order of layer L's first unit; start[n]: the first unit after
    the last layer. A unit comes before layer L when its order is below start[L]."""
    n = num_layers(engine)
    starts = [min(u.order for u in engine.units if u.layer == i) for i in range(n)]
    last = max((u.order for u in engine.units if u.layer is not None), default=0)
    return starts + [last + 1]


def shared_depth(engine, swapped, other, starts: list[int] | None = None) -> int:
    """The largest L such that `swapped` and `other` swap the same units before layer L."""
    starts = starts or layer_starts(engine)
    order = {n: engine.unit(n).order for n in set(swapped) ^ set(other)}
    first_diff = min(order.values(), default=None)
    if first_diff is None:
        return len(starts) - 1
    return max(L for L, s in enumerate(starts) if s <= first_diff or L == 0)


def first_layer(engine, swapped) -> int:
    """The first layer a trial with `swapped` units computes when only the baseline
    (nothing swapped) is recorded."""
    return shared_depth(engine, swapped, ())


def _copy(x: Any, device=None) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().to(device or x.device, copy=True)
    if isinstance(x, tuple):
        return tuple(_copy(v, device) for v in x)
    if isinstance(x, list):
        return [_copy(v, device) for v in x]
    return x


def _stream(out: Any) -> torch.Tensor | None:
    """The tensor whose shape identifies a call: the output itself or its first element."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (tuple, list)):
        return sum(_nbytes(v) for v in x)
    return 0


class Replay(nn.Module):
    """A decoder layer that returns its recorded outputs, one per forward call, in order."""

    def __init__(self, layer: int, outputs: list, copy: bool):
        super().__init__()
        self.layer = layer
        self.outputs = outputs
        self.copy = copy
        self.calls = 0

    def forward(self, *args, **kwargs):
        if self.calls >= len(self.outputs):
            raise BackendError(
                f"prefix reuse: layer {self.layer} was called {self.calls + 1} times, the recorded run only "
                f"{len(self.outputs)}; {HINT}"
            )
        out = self.outputs[self.calls]
        x = hidden_arg(args, kwargs)
        rec = _stream(out)
        if x is not None and rec is not None and tuple(x.shape) != tuple(rec.shape):
            raise BackendError(
                f"prefix reuse: call {self.calls} of layer {self.layer} has input {tuple(x.shape)}, the recorded "
                f"output {tuple(rec.shape)}; {HINT}"
            )
        self.calls += 1
        if not self.copy:
            return out
        return _copy(out, x.device if x is not None else None)


@dataclass(eq=False)  # compared by identity
class Recording:
    swapped: frozenset  # the units the recorded trial swapped
    outputs: list = field(default_factory=list)  # layer -> one recorded output per forward call


class PrefixCache:
    """Recorded layer outputs of earlier trials on one engine, trace and set of faults."""

    def __init__(self, keep: int = 8, max_bytes: int | None = None):
        self.keep = keep  # recordings kept besides the baseline's (least recently used dropped)
        self.max_bytes = max_bytes  # None: no byte budget (tensor-parallel workers; tests)
        self.key: Any = None
        self.recordings: list[Recording] = []  # most recently used last
        self.recorded = 0  # trials recorded since the cache was made
        self.cleared = True
        self.disabled: str | None = None  # why recording stopped (the baseline alone is over the budget)
        self.peak_bytes = 0
        self.dropped = 0  # recordings dropped for the byte budget

    def clear(self) -> None:
        self.key, self.recordings = None, []
        self.cleared = True  # a tensor-parallel engine's workers clear theirs on the next trial
        self.disabled = None

    def nbytes(self) -> int:
        """Bytes the kept recordings hold; a layer's outputs shared by several counted once."""
        seen, total = set(), 0
        for rec in self.recordings:
            for outs in rec.outputs:
                if id(outs) not in seen:
                    seen.add(id(outs))
                    total += sum(_nbytes(o) for o in outs)
        return total

    def plan(self, engine, swapped, key) -> tuple[Recording | None, int]:
        """The recording to replay from and how many leading layers (0: none)."""
        if key != self.key:
            self.clear()
            self.key = key
        starts = layer_starts(engine)
        best, depth = None, 0
        for rec in self.recordings:
            d = shared_depth(engine, swapped, rec.swapped, starts)
            if d > depth:
                best, depth = rec, d
        return best, depth

    @contextlib.contextmanager
    def run(self, engine, swapped, source: Recording | None, upto: int):
        """Inside this block, layers 0..upto-1 return `source`'s outputs and every other
        layer's output is recorded; on success the recording joins the cache.

        Call it after the faults are planted and the swaps applied: a fault's hook on a
        layer's output has then already acted on what is recorded. The replaced layers
        are put back on the way out, before the swaps are undone.
        """
        n = num_layers(engine)
        outputs: list[list] = [source.outputs[i] if i < upto else [] for i in range(n)]
        replays = []
        # Its own ledger, undone on the way out: the replaced layers are put back before
        # the engine's arrangement undoes its swaps, some of which may live inside them.
        with Ledger() as ledger:
            for i in range(upto):
                r = Replay(i, source.outputs[i], copy=(i == upto - 1))
                carry_layer_flags(r, ledger.replace(engine.root, engine.module_path(f"layers.{i}"), r))
                replays.append(r)
            for i in range(upto, n):
                def hook(m, args, out, sink=outputs[i]):
                    sink.append(_copy(out, "cpu"))

                ledger.hooks(engine.module(f"layers.{i}"), post=hook, with_kwargs=False)
            yield
        short = [r for r in replays if r.calls != len(r.outputs)]
        if short:
            r = short[0]
            raise BackendError(f"prefix reuse: layer {r.layer} was called {r.calls} times, the recorded run "
                               f"{len(r.outputs)}; {HINT}")
        self._add(Recording(frozenset(swapped), outputs), source)

    def note(self, swapped, used: Recording | None) -> None:
        """Book a trial recorded elsewhere (in a tensor-parallel engine's workers, whose
        caches make the same choices from the same sequence of trials)."""
        self._add(Recording(frozenset(swapped)), used)

    def _add(self, rec: Recording, used: Recording | None) -> None:
        if used is not None and used in self.recordings:  # most recently used last
            self.recordings.remove(used)
            self.recordings.append(used)
        self.recordings = [r for r in self.recordings if r.swapped != rec.swapped] + [rec]
        self.recorded += 1
        others = [r for r in self.recordings if r.swapped]
        while len(others) > self.keep:
            self.recordings.remove(others.pop(0))
        if self.max_bytes is None:
            return
        own = sum(_nbytes(o) for i, outs in enumerate(rec.outputs) if used is None or outs is not used.outputs[i] for o in outs)
        size = self.nbytes()
        self.peak_bytes = max(self.peak_bytes, size)
        while size > self.max_bytes and others:
            self.recordings.remove(others.pop(0))
            self.dropped += 1
            size = self.nbytes()
        if size > self.max_bytes or (used is None and own > self.max_bytes):
            # the baseline alone, or a trial that computed every layer (a resumed run has no
            # baseline): no recording can ever be kept, so stop making them
            self.disabled = (f"one trial's layer outputs need {max(size, own) / 2**20:.1f} MB, over --prefix-cache-mb "
                             f"{self.max_bytes / 2**20:.4g}: every trial recomputes every layer")
            self.recordings = []

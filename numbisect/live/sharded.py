"""The weight-sync check on a sharded trainer: a policy whose parameters are DTensors
(FSDP2's `fully_shard`, torchtitan, TRL with accelerate FSDP2, verl, prime-rl).

Gathering a DTensor (`full_tensor()`) is a collective: every rank must gather the same
tensors in the same order, or the job hangs until the process group's timeout (30 min by
default) or, for tensors of the same shape, every rank gets wrong tensors with no error.
So the check is collective-safe by construction:

1. `attach_sharded(model, engine=..., timeout=...)`, on every rank once (as `fully_shard`
   is): a gloo group of its own with a short timeout (`timeout` seconds, the bound on any
   wait of the check), the ordered list of the model's state-dict names, shapes and
   placements, and the reference's digests at attach (one gather of the model). `engine`:
   the `vllm.LLM` on the ranks that hold one (rank 0's colocated engine, in this process or
   in its engine-core process: read through `apply_model`); None on the others.
2. `ShardedProbe.check_weights()`, on every rank (one call each, as an FSDP2 sync iterates
   every parameter on every rank): first the ranks agree, in one `all_gather_object` on that
   group, on the hash of the ordered names and shapes, the call's number and its kind; a
   rank that does not enter the check, or one with another model or another count, is an
   error in one line (`ShardedError`) on every rank that did, within `timeout` seconds,
   before anything is gathered. The group is not used again after a rank failed to answer
   (its next call would pair with a stale one): attach again.
3. Then the engine's rank (the driver) runs the weight check (numbisect.live.weights.check)
   and the others follow: each layer the driver's reader needs is named to every rank in
   one `all_gather_object` (bounded by `timeout`), then gathered (`full_tensor`) by every
   rank in the layer's sorted name order. Peak memory: one layer's whole tensors. A check
   gathers the model once (the digests); a tensor explained gathers its layer again.
4. A tensor of the engine that differs is judged rows by rows where the trainer shards it
   along one dimension (`Shard(d)` on a 1-D mesh): each rank's rows against that rank's
   rows of the reference now and at each earlier check. A sync that pushed one rank's
   shard only, or gathered the ranks' shards of two tensors in a rank-dependent order, is
   named at its unit: "rows 64:128 (rank 1) unwritten: still the weights of check 1",
   "rows 64:128 (rank 1) hold k_proj's rows of rank 1". A tensor the weight conversion
   makes of one rank's rows of a sharded tensor (each expert of a fused [E, ...] experts
   tensor that FSDP2 shards along the experts, `Shard(0)`; found at attach by reverting
   row-index markers, no weight read: `_owners`) that holds an earlier check's weights is
   named with that rank and its rows ("rows 4:5 of mlp.experts.gate_up_proj (rank 1)
   unwritten: still the weights of check 1"; the unit: "rank 1's rows 4:8 of
   mlp.experts.down_proj, mlp.experts.gate_up_proj unwritten: ...; rank 0's ok (12
   tensors)"); its other differences are the whole tensor's ("scaled by 1.5", "experts.1
   <-> experts.2 swapped"). One that holds every row along a dimension of its own is
   judged rows by rows as above; one made of several ranks' rows otherwise, whole.
5. `ShardedProbe.check_sync(sync)`: the user's sync under poison control (as
   `Probe.check_sync`, numbisect.live.poison), every rank running the sync between the
   poison and the check.
6. `ShardedProbe.check_local()`: no communication; on a rank with an engine, this rank's
   share of the reference against the engine's same tensors (its own history of digests):
   the weight conversion reverted on this rank's shards, its tensors named as found at
   attach (row markers, no weight read: `_local_names`): this rank's rows of every tensor
   the trainer shards, the experts of a fused [E, ...] experts tensor sharded along the
   experts (`Shard(0)`) whose rows are this rank's (an expert that holds an earlier local
   check's weights named with its rows: "rank 1's rows 4:8 of mlp.experts.down_proj,
   mlp.experts.gate_up_proj unwritten: still the weights of local 1 (12 tensors)"), the
   replicated tensors whole. Other ranks' experts, and tensors made of several ranks'
   rows, are left out, never called missing or stale: named per unit in the result's
   `not_checked` ("rank 0's rows 0:4 of mlp.experts.down_proj, mlp.experts.gate_up_proj
   (12 tensors): check_weights checks them").

7. `ShardedProbe.trigger(out_dir)`: numbisect.live.trigger's trigger fed on every rank with
   that rank's share of the batch, the ranks agreeing in one exchange on the batch's mean
   k3 over every rank's tokens; on a fire, `write_bundle` on every rank: the replay bundle
   written on the engine's rank, its reference weights the layers the check gathered
   (the model gathered once), the engine's read back (`ShardedTrigger`). With an engine on
   several ranks, each engine rank writes its own (`out_dir/fire-N-rankR`): its own share
   of the batch, its own engine's check and weights, and its own k3 as the fire's value
   (the batch's beside it), so `bisect replay` of each reproduces that rank's.

8. `check_weights(functional=True)`: the units' local errors too, as `Probe.check_weights`
   has them (each engine unit fed the reference's inputs), the reference being the sharded
   model: each forward of it is one exchange, every rank then running a forward (FSDP2
   gathers each layer in its forward: a collective) and only the engine's rank keeping its
   captures (`_Mirrored`). `warm_vs_cold()`: numbisect.live.cold's oracle, the trainer's
   weights gathered layer by layer and written one file per layer for the cold engine.
9. Colocated engines: `engine=` on several ranks (verl's and TRL's colocate mode: an engine
   per rank). Each exchange serves every rank's request together (the layers asked for,
   gathered in sorted order, then one forward when any rank asked for one), so each rank
   with an engine runs its own check against its own engine, in step with the others.
   `warm_vs_cold` loads the gathered weights cold once for them all where their engines'
   settings and samples agree (the first engine rank's child; its answer sent to the
   others, each comparing its own engine with it, in one more round of exchanges so that
   every rank leaves the call together).
10. A rank's own work on its whole engine, which may outlast the probe's `timeout` (a
    cold child: about 6 s on the MoE fixture, minutes on a real model; the engine read back
    whole against the cold load; poison control's poison: the engine read, pushed and read
    again; a replay bundle's two checkpoints), runs while a thread of that rank keeps the
    others in step (`_beating`): an exchange every `heartbeat` seconds, `HEARTBEAT` or a
    quarter of `timeout` where that is shorter, so no rank waits longer than `timeout` for
    it whatever the user passed (tested: `timeout=2`, a cold child of 5.9-13.0 s). The
    phase ends in an exchange repeated until every rank is done (`_settle`). Poison
    control's put-back of what a sync left poisoned runs after the call's last exchange:
    the next call waits for it (bounded by `timeout`).

A rank with an engine gets its own `WeightCheck` back; a rank without one gets the first
engine's rank's (the driver's, sent in the last exchange). The trainer's model is never
changed; it may keep training between checks.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import hashlib
import json
import os
import shutil
import socket
import tempfile
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from numbisect.common.errors import InputError, exception_line
from numbisect.common.procenv import environ
from numbisect.live import bundle as B
from numbisect.live import cold as K
from numbisect.live import poison as X
from numbisect.live import transfer as T
from numbisect.live import weights as W
from numbisect.live.engine import ENGINE
from numbisect.live.engine import settings as engine_settings
from numbisect.live.errors import EngineSettingError, LiveError
from numbisect.live.probe import (
    Probe,
    _engine,
    _PutBack,
    _reference,
    eval_mode,
    random_samples,
    samples_trace,
)
from numbisect.live.trigger import Trigger, batch_tokens
from numbisect.model.arch import arch_for
from numbisect.patching.ledger import Ledger

DEFAULT_TIMEOUT = 60.0  # seconds: the longest any rank waits for the others in a check (the driver reading one unit back included)
DONE = "__done__"
HEARTBEAT = 5.0  # seconds between a rank's exchanges while its long work runs (module doc, 10); min(HEARTBEAT, timeout/4)


class ShardedError(LiveError):
    """The ranks did not enter a sharded check together (one rank missing, another model,
    another number of calls): said in one line on every rank that entered it."""


def _is_dtensor(t) -> bool:
    return hasattr(t, "full_tensor") and hasattr(t, "placements")


def shard_dim(t) -> int | None:
    """The dimension a DTensor is split along on a 1-D mesh (`Shard(d)`), else None
    (replicated, or a layout this check reads whole only)."""
    if not _is_dtensor(t) or t.device_mesh.ndim != 1 or len(t.placements) != 1:
        return None
    return getattr(t.placements[0], "dim", None) if t.placements[0].is_shard() else None


def rank_rows(n: int, world: int) -> list[tuple[int, int]]:
    """Each rank's [start, end) along a dimension of `n` split by `Shard` over `world` ranks
    (torch.chunk's split, as DTensor makes it: the last ranks may hold fewer or none)."""
    size = -(-n // world) if n else 0
    return [(min(n, r * size), min(n, (r + 1) * size)) for r in range(world)]


def _local(model) -> tuple[list[str], dict]:
    """The model's state-dict names in order, and (shape, placement) of each."""
    sd = model.state_dict()
    names = list(sd)
    meta = {k: (tuple(v.shape), str(getattr(v, "placements", "local")), str(v.dtype)) for k, v in sd.items()}
    return names, meta


class ShardedReference(W.ReferenceReader):
    """A `ReferenceReader` over a model whose tensors are DTensors: each layer gathered when
    the driver's check asks for it, every rank gathering the same layer in the same order
    (`ShardedProbe._exchange`); its rows per rank digested as they pass (`chunks`)."""

    def __init__(self, probe: ShardedProbe, dtype: torch.dtype | None = None):
        self.probe = probe
        self.model = probe.model
        self.dtype = dtype
        self._groups = probe.groups
        self.shapes, self.layer_of = probe.shapes, probe.layer_of
        self._cached = None
        self.chunks: dict[str, list[str]] = {}  # checkpoint name -> digest of each rank's rows (engine dtype)
        self.gathers = 0  # layers gathered
        self._chunk_dtype: torch.dtype | None = None
        self._dtypes: dict = {}
        self.keep: dict | None = probe._keep  # the gathered tensors kept as they pass (a bundle's reference), else None

    def _pass_state(self) -> None:
        return None  # each layer gathered on its own (`_revert`)

    def _revert(self, key: str, sd: dict | None = None) -> dict[str, torch.Tensor]:
        self.gathers += 1
        return self.probe.gather_layer(key)

    def digests(self, dtype: torch.dtype, dtypes: dict | None = None) -> dict[str, str]:
        out = {}
        dtypes = dtypes or {}
        for key, tensors in self.layers():
            out.update(W.reference_digests(tensors, dtype, dtypes))
            if self.keep is not None:
                self.keep.update(tensors)
            for n, t in tensors.items():
                d = self.probe.dims.get(n)
                if d is not None:
                    c = t.to(dtypes.get(n, dtype))
                    self.chunks[n] = [W.digest(c.narrow(d, a, b - a)) for a, b in rank_rows(c.shape[d], self.probe.world)]
        return out


class ShardedProbe:
    """numbisect on every rank of a sharded trainer (module doc)."""

    def __init__(self, model, engine, timeout: float, group=None):
        self.model = model
        self.llm = engine
        self.timeout = float(timeout)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.group = group or dist.new_group(backend="gloo", timeout=dt.timedelta(seconds=self.timeout))
        self.calls = 0
        self.broken: str | None = None
        names, meta = _local(model)
        self.names = names
        self.fingerprint = hashlib.sha256(json.dumps([names, [meta[n] for n in names]]).encode()).hexdigest()[:16]
        self._groups: dict[str, list[str]] = {}
        for k in names:
            self._groups.setdefault(W.layer_key(k), []).append(k)
        self.groups = self._groups
        self.config = model.config
        self.arch = arch_for(self.config)
        self.shapes, self.layer_of, self.dims, self.owned = self._checkpoint_names()
        # what check_local compares: found on a rank with an engine only (elsewhere it returns None)
        self.local_map, self.local_cut = self._local_names() if engine is not None else ({}, {})
        holders = self._all_gather(("attach", self.fingerprint, engine is not None), "attach_sharded")
        other = next((r for r, h in enumerate(holders) if h[1] != self.fingerprint), None)
        if other is not None:
            raise ShardedError(f"attach_sharded: rank {other}'s model has other state-dict names, shapes, placements or "
                               f"another order of them than rank {self.rank}'s: attach the same sharded model on every rank")
        drivers = [r for r, h in enumerate(holders) if h[2]]
        if not drivers:
            raise ShardedError("attach_sharded: no rank was given the engine (engine=llm on the rank that holds it)")
        self.driver = drivers[0]  # the first rank with an engine: the one whose check a rank without one gets
        self.engines = drivers  # every rank with an engine of its own (colocated: each checks its own)
        self._keep: dict | None = None
        self.history = W.History()
        self.row_history: list[tuple[str, dict[str, list[str]]]] = []  # (label, name -> rows' digests)
        self.local_history = W.History()  # check_local's: this rank's rows
        self._engine = None
        self._probe = None  # a whole-model Probe over this rank's engine (`_driver_probe`)
        self._hf = None  # the reference's forward on a rank that only takes part (`_follow_forward`)
        if engine is not None:
            self._engine = _EngineSide(engine, self.shapes)
        self.gathers = 0
        self.beats = 0  # exchanges made by `_beating` on this rank
        digests, chunks = self._driven(lambda ref: (ref.digests(self._engine.dtype, self._engine.dtypes), ref.chunks))
        if self._engine is not None:
            self.history.add("attach", digests)
            self.row_history.append(("attach", chunks))
            self.local_history.add("attach", self._local_ref_digests())

    # -- names -------------------------------------------------------------------------------
    def _checkpoint_names(self):
        """Checkpoint names of the reference (transformers' revert of the weight conversion on
        meta tensors: nothing gathered): shapes, layer, the dimension a name's tensor is
        sharded along where its state-dict tensor is that same tensor, and the tensors the
        conversion makes of one rank's rows of a sharded state-dict tensor (`_owners`)."""
        from transformers.core_model_loading import revert_weight_conversion

        sd = self.model.state_dict()
        shapes, layer_of, dims, owned = {}, {}, {}, {}
        for key, ks in self._groups.items():
            meta = {k: torch.empty(tuple(sd[k].shape), dtype=sd[k].dtype, device="meta") for k in ks}
            out = revert_weight_conversion(self.model, meta)
            for n, t in out.items():
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    shapes[n], layer_of[n] = tuple(t.shape), key
                    if n in sd and tuple(sd[n].shape) == tuple(t.shape):
                        dims[n] = shard_dim(sd[n])
            converted = [k for k in ks if shard_dim(sd[k]) is not None and k not in dims]
            if converted:
                more_dims, more_owned = self._owners(sd, ks, {n for n in out if n in shapes})
                dims.update(more_dims)
                owned.update(more_owned)
        return shapes, layer_of, {n: d for n, d in dims.items() if d is not None}, owned

    def _owners(self, sd: dict, ks: list[str], names: set[str]) -> tuple[dict[str, int], dict[str, tuple]]:
        """For a layer whose sharded state-dict tensors the weight conversion turns into other
        checkpoint tensors (a fused [E, ...] experts tensor split per expert): which rows of
        which tensor each checkpoint tensor is made of, found by reverting markers (each
        sharded tensor's row index along its shard dimension, broadcast: no weight read).
        Returns (name -> dimension, for a tensor holding every row along one of its own
        dimensions: judged rows by rows as a dense one) and (name -> (rank, state-dict
        name, a, b), for a tensor made of rows a:b of that one rank's shard). A tensor made
        of several ranks' rows otherwise is judged whole."""
        from transformers.core_model_loading import revert_weight_conversion

        marks, spans, base = {}, [], 0
        for k in sorted(ks):
            t, d = sd[k], shard_dim(sd[k])
            shape = tuple(t.shape)
            if d is None or k in names:
                marks[k] = torch.full((), -1, dtype=torch.int32).expand(shape)
                continue
            view = [1] * len(shape)
            view[d] = shape[d]
            marks[k] = (torch.arange(shape[d], dtype=torch.int32) + base).view(view).expand(shape)
            spans.append((base, base + shape[d], k))
            base += shape[d]
        try:
            out = revert_weight_conversion(self.model, marks)
        except Exception:  # a conversion that computes on its values: these tensors judged whole
            return {}, {}
        dims, owned = {}, {}
        for n, v in out.items():
            if n not in names or not isinstance(v, torch.Tensor) or v.numel() == 0:
                continue
            lo, hi = int(v.min()), int(v.max())
            src = next((x for x in spans if x[0] <= lo < x[1]), None)
            if lo < 0 or src is None or hi >= src[1]:
                continue  # rows of no sharded tensor, or of two
            n_rows = src[1] - src[0]
            a, b = lo - src[0], hi - src[0] + 1
            r = next((r for r, (x, y) in enumerate(rank_rows(n_rows, self.world)) if x <= a and b <= y), None)
            if r is not None:
                owned[n] = (r, src[2], a, b)
                continue
            for c in range(v.dim()):  # every row, in order, along one of its own dimensions
                if v.shape[c] == n_rows and a == 0 and _along(v, c, src[0], n_rows):
                    dims[n] = c
                    break
        return dims, owned

    def _local_names(self) -> tuple[dict[str, dict[str, str]], dict[str, tuple[int, int, int]]]:
        """What `check_local` compares on this rank, found as `_owners` finds the owners (each
        sharded tensor's row index, broadcast over this rank's shard: no weight read), the
        weight conversion reverted on this rank's shards: per layer, (the name the
        conversion gives a tensor of this rank's shards -> its checkpoint name), for a tensor
        that is a checkpoint tensor whole (replicated; an expert of a fused experts tensor
        whose rows are all this rank's: named by its index among this rank's rows, so its
        index is shifted to the fused tensor's) or this rank's rows of one along one of its
        dimensions; and (checkpoint name -> (dimension, a, b)) for the latter: the engine's
        rows a:b of it. A tensor of other ranks' rows, or of several ranks', is in no map."""
        from transformers.core_model_loading import revert_weight_conversion

        sd = self.model.state_dict()
        maps, cuts = {}, {}
        for key, ks in self._groups.items():
            marks, spans, base = {}, [], 0
            for k in sorted(ks):
                t, d = sd[k], shard_dim(sd[k])
                local = tuple((t.to_local() if _is_dtensor(t) else t).shape)
                a, b = rank_rows(t.shape[d], self.world)[self.rank] if d is not None else (0, 0)
                if d is None or local[d] != b - a:
                    whole = not _is_dtensor(t) or all(p.is_replicate() for p in t.placements)
                    marks[k] = torch.full((), -1 if whole else -2, dtype=torch.int32).expand(local)
                    continue
                view = [1] * len(local)
                view[d] = b - a
                marks[k] = (torch.arange(a, b, dtype=torch.int32) + base).view(view).expand(local)
                spans.append((base, base + t.shape[d], k, a, b))
                base += t.shape[d]
            try:
                out = revert_weight_conversion(self.model, marks)
            except Exception:  # a conversion that computes on its values: nothing of this layer checked locally
                maps[key] = {}
                continue
            maps[key] = {}
            for n, v in out.items():
                got = self._local_name(n, v, spans) if isinstance(v, torch.Tensor) and v.numel() else None
                if got is not None:
                    maps[key][n] = got[0]
                    if got[1] is not None:
                        cuts[got[0]] = got[1]
        return maps, cuts

    def _local_name(self, n: str, v: torch.Tensor, spans: list[tuple]) -> tuple[str, tuple | None] | None:
        """`_local_names` for one tensor the conversion gives of this rank's shards (`v`: its
        row markers): (its checkpoint name, (dimension, a, b) or None), or None."""
        lo, hi = int(v.min()), int(v.max())
        if hi < 0:  # of no sharded rows: a checkpoint tensor whole where it is one of that name and shape
            return (n, None) if lo == -1 and self.shapes.get(n) == tuple(v.shape) else None
        src = next((x for x in spans if x[0] <= lo < x[1]), None)
        if lo < 0 or src is None or hi >= src[1]:
            return None
        base, end, k, ra, rb = src
        a, b = lo - base, hi - base + 1
        same = [m for m, o in self.owned.items() if o == (self.rank, k, a, b) and self.shapes[m] == tuple(v.shape)
                and _index_apart(m, n, ra)]
        if len(same) == 1:
            return same[0], None
        full = self.shapes.get(n)
        if full is None or len(full) != v.dim() or (a, b) != (ra, rb):
            return None
        for c in range(v.dim()):  # this rank's rows, in order, along one of its own dimensions
            if full[c] == end - base and v.shape[c] == rb - ra and all(full[i] == v.shape[i] for i in range(v.dim()) if i != c) \
                    and _along(v, c, base + ra, rb - ra):
                return n, (c, ra, rb)
        return None

    # -- communication -------------------------------------------------------------------------
    def _all_gather(self, obj, what: str) -> list:
        """One `all_gather_object` on the check's own group, bounded by `timeout`."""
        if self.broken:
            raise ShardedError(self.broken)
        out = [None] * self.world
        t0 = time.perf_counter()
        try:
            dist.all_gather_object(out, obj, group=self.group)
        except Exception as e:  # gloo's timeout, or a peer gone
            waited = time.perf_counter() - t0
            self.broken = (f"{what} on rank {self.rank}: the other ranks did not take part within {waited:.0f} s "
                           f"(timeout {self.timeout:g} s): call it on every rank, the same number of times; "
                           "this probe's group is out of step now: attach_sharded again on every rank")
            raise ShardedError(self.broken) from e
        return out

    def _agree(self, what: str, payload=None) -> list:
        """Every rank entered the same call (module doc, 2); each rank's `payload`, sent in the
        same exchange, comes back in rank order."""
        self.calls += 1
        mine = (what, self.calls, self.fingerprint)
        seen = self._all_gather((mine, payload), what)
        off = [r for r, s in enumerate(seen) if tuple(s[0]) != mine]
        if off:
            r = off[0]
            other = seen[r][0]
            if other[2] != self.fingerprint:
                why = "another model (state-dict names, shapes, placements or their order differ)"
            elif other[0] != what:
                why = f"its call {other[0]}"
            else:
                why = f"its call number {other[1]} where this rank is at {self.calls}"
            self.broken = (f"{what}: rank {r} entered with {why}: every rank must call the same checks in the same "
                           "order; attach_sharded again on every rank")
            raise ShardedError(self.broken)
        return [x[1] for x in seen]

    def gather_layer(self, key: str) -> dict[str, torch.Tensor]:
        """On a rank with an engine, inside its check: layer `key`, gathered by every rank in
        one exchange (`_exchange`)."""
        return self._exchange(("layer", key), "gathering a layer")[1]

    def _exchange(self, mine, what: str) -> tuple[list, dict | None]:
        """One exchange of the check's protocol (module doc, 3): every rank sends what it
        asks for (a layer, a forward of the model, or that it is done) and serves what every
        rank asked: each layer asked for gathered by all in sorted order, then, when a rank
        asked for a forward, one forward of the sharded model on every rank (the ranks that
        asked run theirs after this returns; the others the first one's sample, nothing
        kept). Returns every rank's message and this rank's layer, if it asked for one."""
        msgs = self._all_gather(mine, what)
        kind = mine[0] if isinstance(mine, tuple) and mine else None
        layer = None
        for key in sorted({m[1] for m in msgs if isinstance(m, tuple) and m and m[0] == "layer"}):
            got = self._gather(key)
            if kind == "layer" and mine[1] == key:
                layer = got
            del got
        forwards = [m[1] for m in msgs if isinstance(m, tuple) and m and m[0] == "forward"]
        if forwards and kind != "forward":
            self._follow_forward(forwards[0])
        return msgs, layer

    @property
    def heartbeat(self) -> float:
        """Seconds between two exchanges while this rank's local work may outlast `timeout`
        (`_beating`): `HEARTBEAT`, or a quarter of `timeout` where that is shorter, so a
        waiting rank never waits longer than `timeout` whatever the user passed."""
        return min(HEARTBEAT, self.timeout / 4)

    @contextlib.contextmanager
    def _beating(self, what: str):
        """For the block (this rank's own work that may outlast `timeout`, no exchange in it:
        module doc, 10), a thread keeps the other ranks in step: one exchange every
        `heartbeat` seconds, each serving what the others ask for. The group out of step
        meanwhile is raised once the block is done. End the phase with `_settle`."""
        stop, box = threading.Event(), {}

        def beat():
            try:
                while not stop.wait(self.heartbeat):
                    self._exchange(("wait", None), what)
                    self.beats += 1
            except BaseException as e:  # the group out of step: raised on the calling thread below
                box["error"] = e

        t = threading.Thread(target=beat, name="numbisect-heartbeat", daemon=True)
        t.start()
        try:
            yield
        finally:
            stop.set()
            t.join()
            if "error" in box:
                raise box["error"]

    def _settle(self, payload, what: str) -> list:
        """The last exchange of a phase in which a rank's own work may have run under
        `_beating`: repeated until every rank sends its `payload` in the same exchange (its
        heartbeats answered meanwhile); every rank's, in rank order."""
        while True:
            msgs, _ = self._exchange((DONE, payload), what)
            if all(isinstance(m, tuple) and m and m[0] == DONE for m in msgs):
                return [m[1] for m in msgs]

    def _follow_forward(self, sample: tuple[list[int], int]) -> None:
        """A forward of the sharded model on a rank that takes part only (its gathers are
        collectives): one sample, prefill, nothing captured."""
        if self._hf is None:
            self._hf = _reference(self.model, None, sharded=True)[0]
        ids, p = sample
        with eval_mode(self.model):
            self._hf.forward(samples_trace([{"prompt_ids": ids[:p], "completion_ids": ids[p:]}]).samples)

    def _driver_probe(self) -> _DriverProbe:
        """A whole-model `Probe` over this rank's engine, its reference's forwards run on every
        rank together (`_Mirrored`): the functional pass, the cold oracle, poison control's
        pushes (made once, on a rank with an engine)."""
        if self._probe is None:
            self._probe = _DriverProbe(self)
        return self._probe

    def _gather(self, key: str) -> dict[str, torch.Tensor]:
        """Layer `key` gathered (`full_tensor`, in its sorted names) and reverted to checkpoint names."""
        from transformers.core_model_loading import revert_weight_conversion

        self.gathers += 1
        sd = self.model.state_dict()
        full = {}
        with torch.no_grad():
            for k in sorted(self._groups[key]):
                t = sd[k]
                full[k] = (t.full_tensor() if _is_dtensor(t) else t).detach()
            out = revert_weight_conversion(self.model, full)
        return {k: v for k, v in out.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}

    def _driven(self, work, *, both: bool = False):
        """Run `work(reader)` on every rank with an engine while every rank serves what each
        asks for (`_exchange`), until all are done. A rank with an engine returns its own
        result, one without the first engine's rank's (sent in the last exchange); `both`:
        a rank with an engine returns (its own, the first engine rank's). An error on a rank
        is raised there, and as a `ShardedError` line on the others."""
        result, err = None, None
        if self._engine is not None:
            try:
                result = work(ShardedReference(self))
            except ShardedError:  # the group is out of step: nothing more can be exchanged
                raise
            except BaseException as e:
                err = e
        line = exception_line(err) if err is not None else None
        what = "ending a check" if self._engine is not None else "following the check"
        while True:
            msgs, _ = self._exchange((DONE, None if err is not None else result, line), what)
            if all(isinstance(m, tuple) and m and m[0] == DONE for m in msgs):
                break
        if err is not None:
            raise err
        failed = next(((r, m[2]) for r, m in enumerate(msgs) if m[2]), None)
        if failed is not None:
            raise ShardedError(f"the check failed on rank {failed[0]}: {failed[1]}")
        if self._engine is None:
            return msgs[self.driver][1]
        return (result, msgs[self.driver][1]) if both else result

    # -- checks -------------------------------------------------------------------------------
    def check_weights(self, step: str | None = None, *, functional: bool = False, samples=None) -> W.WeightCheck:
        """Per unit, whether the engine computes with the trainer's weights (module doc, 2-4).
        Call it on every rank, with the same `functional`. `functional`: each unit judged by
        its local error too (module doc, 8), on `samples` (those of each rank with an
        engine; default: a few random ones); refused on every rank, in one line, where an
        engine cannot be hooked."""
        self._agree_functional("check_weights", functional)
        label = step or f"check {self.calls}"
        t0 = time.perf_counter()
        return self._driven(functools.partial(self._check, label=label, t0=t0, functional=functional, samples=samples))

    def _agree_functional(self, what: str, functional: bool, extra=None) -> list:
        """The ranks agree on a call and on `functional`; with it, each rank with an engine
        says why its engine cannot be hooked (if so): raised on every rank. Returns each
        rank's `extra`, sent in the same exchange."""
        problem = None
        if functional and self._engine is not None:
            try:
                problem = self._driver_probe().problem
            except Exception as e:  # the engine could not be wrapped: said on every rank
                problem = exception_line(e)
        each = self._agree(what, (bool(functional), problem, extra))
        if len({f for f, _, _ in each}) > 1:
            ranks = ", ".join(f"rank {r} {f}" for r, (f, _, _) in enumerate(each))
            raise ShardedError(f"{what}: the ranks differ in functional ({ranks}): pass the same on every rank")
        bad = next(((r, x) for r, (_, x, _) in enumerate(each) if x), None)
        if bad is not None:
            raise EngineSettingError(bad[1] if bad[0] == self.rank else f"rank {bad[0]}'s engine: {bad[1]}")
        return [x for _, _, x in each]

    def check_sync(self, sync, *, seed: int = 0, step: str | None = None) -> W.WeightCheck:
        """`sync()` (the user's push, run on every rank: its gathers are collectives) under
        poison control (numbisect.live.poison), then `check_weights`; call it on every rank.
        On each rank with an engine, before the sync: the engine's tensors read back (kept)
        and overwritten with seeded random values through vLLM's reload, each read back
        again; a tensor, or a rank's rows, the sync never wrote is then `unwritten`, "still
        the weights of poison (seed N)", whatever the engine held before. The poison is one
        change in a Ledger (numbisect.patching.ledger), undone as `Probe.poisoned`'s is: the
        tensors the sync left poisoned put back to what they held before it; every tensor
        put back as found when the sync raises. A poison that could not be pushed or did not
        reach a tensor: `PoisonError` on every rank, the engine put back, the sync not run."""
        self._agree("check_sync")
        label = step or f"check {self.calls}"
        with Ledger() as ledger:
            p, back, err = None, None, None
            if self._engine is not None:
                try:
                    with self._beating("waiting for the engine's poison"):  # the whole engine read, pushed, read again
                        p, back = self._poison(seed, ledger)
                except X.PoisonError as e:
                    err = e.message
            errors = [e for e in self._settle(err, "poisoning the engine") if e]
            if errors:
                raise X.PoisonError(errors[0])
            try:
                sync()
            except BaseException:
                if back is not None:
                    back.what = "putting the engine back after the sync raised"
                    back.after = "the engine may hold poisoned weights: push your weights again"
                raise
            if back is not None:
                back.synced = True  # from here on, the sync's tensors stay as it wrote them
            t0 = time.perf_counter()
            return self._driven(functools.partial(self._check_poisoned, p=p, ledger=ledger, label=label, t0=t0))

    def _poison(self, seed: int, ledger: Ledger) -> tuple[X.Poisoned, _PutBack]:
        """The engine's tensors read back and poisoned (check_sync), on a rank with an engine:
        the push a change in `ledger`, its undo `probe._PutBack`, as `Probe.poisoned` has it."""
        eng, dp = self._engine, self._driver_probe()
        t0 = time.perf_counter()
        saved = {n: t for n, t in eng.tensors().items() if n in self.shapes}
        before = (self.history.previous() or ("", {}))[1]
        poison = X.poison_values(saved, {n: (saved[n], before.get(n)) for n in saved}, seed, W.digest)
        p = X.Poisoned(seed=seed, label=X.POISON_LABEL.format(seed=seed), tensors=len(saved))
        back = _PutBack(p, saved, dict(self.shapes), "putting the engine back",
                        "the engine holds the poison: push your weights again")
        try:
            dp._pushed(ledger, self.llm, poison, "poisoning the engine",
                       "the engine may hold poisoned weights: push your weights again", back)
        except X.PoisonError as e:  # a reload that stopped part way: what the engine held, pushed back once more
            failed = e.message.rsplit(";", 1)[0]
            back.what, back.after = failed, "putting the engine back failed too: push your weights again"
            raise X.PoisonError(f"{failed}; the engine was put back as found") from None
        p.digests, missed = X.read_poison(eng.units(), saved, {}, W.digest)  # not read back, or what it held
        if missed:
            raise X.PoisonError(f"the poison did not reach {len(missed)} engine tensor(s) ({', '.join(missed[:4])}): "
                                "a sync that skips them could not be told; the engine was put back as found")
        p.rows = {n: [W.digest(t.narrow(self.dims[n], a, b - a)) for a, b in rank_rows(t.shape[self.dims[n]], self.world)]
                  for n, t in poison.items() if n in self.dims}
        p.seconds = X.timed(t0)
        return p, back

    def _check_poisoned(self, ref: ShardedReference, p: X.Poisoned, ledger: Ledger, label: str, t0: float) -> W.WeightCheck:
        """The check after a poisoned sync, the poison as the step before it; then the ledger
        undone: the tensors still holding the poison put back (check_sync)."""
        entry, rentry = (p.label, p.digests), (p.label, p.rows)
        self.history.steps.append(entry)
        self.row_history.append(rentry)
        try:
            check = self._check(ref, label, t0, keep_digests=True)
        finally:
            self.history.steps = [s for s in self.history.steps if s is not entry]
            self.row_history = [s for s in self.row_history if s is not rentry]
        p.check = check
        try:
            ledger.undo()  # `_PutBack`: p.left read from the check, those pushed back
        finally:
            p.check = None
            check.engine_digests = {}
        check.poison = p.to_dict()
        return check

    # -- the warm-vs-cold oracle -----------------------------------------------------------------
    def warm_vs_cold(self, samples=None, *, functional: bool = False, cold: K.ColdLoad | None = None,
                     timeout: float | None = 900) -> K.WarmCold:
        """numbisect.live.cold's oracle on a sharded trainer; call it on every rank, with the
        same `functional`. The trainer's weights gathered layer by layer (every rank, in one
        order, as the check) and written by each rank with an engine to a checkpoint
        directory, one file per layer (peak memory: one layer's whole tensors), loaded cold
        in a child process (the trainer's process-group variables not passed on); that
        rank's engine compared with it per unit (`WarmCold`). `functional`: the units' local
        outputs too, fed the sharded model's inputs (a forward on every rank). `cold`: an
        earlier result's `.cold`, reused (the model still gathered once, for its digests).

        Several ranks with an engine (colocated): where none passes `cold` and their engines'
        settings (numbisect.live.engine's `settings`) and `samples` agree, one cold load
        serves them all (module doc, 9): the first engine rank's child, its answer sent to
        the others in the check's last exchange; each compares its own engine with it.
        Otherwise each loads its own. While a child runs, or a rank reads its engine back
        whole, that rank keeps the others waiting in exchanges at most `heartbeat` seconds
        apart (`HEARTBEAT`, or `timeout`/4 where shorter): a cold load may outlast the
        probe's `timeout`. (This method's `timeout` bounds the cold child itself.)"""
        key = None
        if self._engine is not None and (cold is None or (functional and cold.captures is None)):
            key = hashlib.sha256(repr((sorted(engine_settings(self.llm).items()), samples)).encode()).hexdigest()
        keys = self._agree_functional("warm_vs_cold", functional, key)
        share = (len(self.engines) > 1 and all(keys[r] is not None for r in self.engines)
                 and all(keys[r] == keys[self.driver] for r in self.engines))
        work = functools.partial(self._warm_cold, samples=samples, functional=functional, cold=cold, timeout=timeout,
                                 share=share)
        if not share:
            return self._driven(work)
        out = self._driven(work, both=True)
        mine = {}

        def against(ref):  # the other engine ranks' engines against the shared cold load, every rank still in step
            if self.rank == self.driver:
                return None
            (digests, shapes, t0), lead = out
            if lead.cold.ref != digests:
                raise LiveError("warm_vs_cold: the first engine rank's cold load holds other reference weights than "
                                "this rank gathered")
            dp = self._driver_probe()
            with self._beating("waiting for a warm engine's read-back"):
                mine["wc"] = dp._warm_against(dp._llm(), lead.cold, shapes, functional, t0)

        self._driven(against)
        if self._engine is None or self.rank == self.driver:
            return out if self._engine is None else out[0]
        return mine["wc"]

    def _warm_cold(self, ref: ShardedReference, samples, functional: bool, cold, timeout, share: bool = False):
        dp = self._driver_probe()
        llm = dp._llm()
        t0 = time.perf_counter()
        if share and self.rank != self.driver:  # the first engine rank loads it cold for every engine rank
            digests, shapes = _stream_checkpoint(ref.layers(), None, dp.ref.config)
            return digests, shapes, t0
        write = cold is None or (functional and cold.captures is None)
        tmp = tempfile.mkdtemp(prefix="numbisect-cold-") if write else None
        try:
            model_dir = os.path.join(tmp, "model") if write else None
            digests, shapes = _stream_checkpoint(ref.layers(), model_dir, dp.ref.config)
            if cold is not None and cold.ref != digests:
                raise LiveError("warm_vs_cold(cold=...): the reference's weights changed since that cold load; "
                                "load it cold again")
            if write:
                with _single_process_env():  # the cold engine's vLLM must not join the trainer's process group
                    cold = dp._cold_load(model_dir, digests, shapes, samples, functional, timeout)
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
        with self._beating("waiting for a warm engine's read-back"):  # the whole engine read back: may outlast timeout
            return dp._warm_against(llm, cold, shapes, functional, t0)

    def _check(self, ref: ShardedReference, label: str, t0: float, keep_digests: bool = False, functional: bool = False,
               samples=None) -> W.WeightCheck:
        eng = self._engine
        rows = functools.partial(self._rows, ref)
        local = flips = None
        if functional:  # the units' local errors first: forwards of the sharded model on every rank (module doc, 8)
            dp = self._driver_probe()
            c, _, _ = dp._comparison(samples if samples is not None else random_samples(dp.ref.vocab_size))
            local = {r["name"]: r["local"]["rel_l2"] for r in c.units if r.get("local")}
            flips = W.routing_flips(c.routing)
        check = W.check(ref, eng.units(), self.history, self.arch, self.config, dtype=eng.dtype, dtypes=eng.dtypes,
                        step=label, local=local, tied=eng.tied, t0=t0, flips=flips, rows=rows)
        self.row_history.append((label, dict(ref.chunks)))
        del self.row_history[: -self.history.keep]
        for u in check.units:
            u.summary = _rows_summary(u.tensors, self.owned) or u.summary
        if not keep_digests:
            check.engine_digests = {}
        return T.annotate(check, eng.llm, self.arch, self.config, list(self.shapes))  # the weight version, the last push

    def _rows(self, ref: ShardedReference, name: str, t: torch.Tensor) -> dict | None:
        """A verdict on the rows of each rank of a sharded tensor that differs, when the ranks'
        rows do not all tell the same (module doc, 4); None otherwise."""
        if name in self.owned:
            return self._owned_rows(name, t)
        d = self.dims.get(name)
        now = ref.chunks.get(name)
        if d is None or now is None or tuple(t.shape) != self.shapes[name]:
            return None
        spans = rank_rows(t.shape[d], self.world)
        seen = [W.digest(t.narrow(d, a, b - a)) for a, b in spans]
        earlier = self.row_history  # oldest first; the last is the previous check's
        anywhere = {}
        for n, ds in ref.chunks.items():
            for r, x in enumerate(ds):
                anywhere.setdefault(x, (n, r))
        ranks = []
        for r, ((a, b), x) in enumerate(zip(spans, seen)):
            entry = {"rank": r, "rows": [a, b]}
            if x == now[r]:
                entry["status"] = W.OK
            elif earlier and (earlier[-1][1].get(name) or [None] * self.world)[r] == x:
                entry.update(status=W.UNWRITTEN, holds=earlier[-1][0])
            elif any((h.get(name) or [None] * self.world)[r] == x for _, h in earlier[:-1]):
                lb = next(lb for lb, h in reversed(earlier[:-1]) if (h.get(name) or [None] * self.world)[r] == x)
                entry.update(status=W.STALE, holds=lb)
            elif x in anywhere:
                other, orank = anywhere[x]
                entry.update(status=W.CORRUPTED, holds=f"{W.short_name(other)} rows of rank {orank}", tensor=other)
            else:
                entry["status"] = W.CORRUPTED
            ranks.append(entry)
        statuses = {e["status"] for e in ranks}
        if len(statuses) == 1 and W.OK not in statuses and not any("tensor" in e for e in ranks):
            return None  # every rank's rows alike: the whole tensor's verdict says it
        bad = [e for e in ranks if e["status"] != W.OK]
        phrase = "; ".join(_rank_phrase(e) for e in bad) + (
            f"; rank{'s' if len(ranks) - len(bad) > 1 else ''} "
            f"{','.join(str(e['rank']) for e in ranks if e['status'] == W.OK)} ok" if len(bad) < len(ranks) else "")
        worst = W._worst(e["status"] for e in bad)
        out = {"status": worst, "how": "rows per rank", "ranks": ranks, "phrase": phrase}
        holds = {e.get("holds") for e in bad if e["status"] in (W.UNWRITTEN, W.STALE)}
        if worst in (W.UNWRITTEN, W.STALE) and len(holds) == 1:
            out["holds"] = holds.pop()
        return out

    def _owned_rows(self, name: str, t: torch.Tensor, history: W.History | None = None) -> dict | None:
        """A tensor made of one rank's rows of a sharded tensor (`owned`: an expert of a fused
        experts tensor) that differs: that rank's rows named when they hold the weights of
        an earlier check (unwritten, stale; `history`: the checks', default `check_weights`'s);
        None otherwise (the whole tensor's verdict, its explanation included: "scaled by
        1.5", "experts.1 <-> experts.2 swapped")."""
        r, src, a, b = self.owned[name]
        steps = (history or self.history).steps  # oldest first; the last is the previous check's
        if tuple(t.shape) != self.shapes[name] or not steps:
            return None
        x = W.digest(t)
        if steps[-1][1].get(name) == x:
            status, holds = W.UNWRITTEN, steps[-1][0]
        else:
            holds = next((lb for lb, h in reversed(steps[:-1]) if h.get(name) == x), None)
            if holds is None:
                return None
            status = W.STALE
        entry = {"rank": r, "rows": [a, b], "of": src, "status": status, "holds": holds}
        return {"status": status, "how": "rows per rank", "ranks": [entry], "phrase": _rank_phrase(entry), "holds": holds}

    def check_local(self, step: str | None = None) -> W.WeightCheck | None:
        """This rank's own rows against the engine's same rows, no communication (module
        doc, 6); None on a rank without an engine. The tensors left out (other ranks' rows:
        the experts they own) are named per unit in the result's `not_checked`."""
        if self._engine is None:
            return None
        t0 = time.perf_counter()
        label = step or f"local {len(self.local_history.steps)}"
        eng = self._engine
        ref = _LocalReference(self)
        history = self.local_history

        def rows(name: str, t: torch.Tensor) -> dict | None:
            return self._owned_rows(name, t, history) if name in self.owned else None

        check = W.check(ref, _LocalUnits(eng.units(), self, set(ref.shapes)), history, self.arch, self.config,
                        dtype=eng.dtype, dtypes=eng.dtypes, step=label, tied=eng.tied, t0=t0, rows=rows)
        mine = {n: o for n, o in self.owned.items() if o[0] == self.rank}  # no word on other ranks' rows
        for u in check.units:
            u.summary = _rows_summary(u.tensors, mine) or u.summary
        check.not_checked = self._not_checked(set(self.shapes) - set(ref.shapes))
        check.seconds = time.perf_counter() - t0
        return check

    def _not_checked(self, names: set[str]) -> dict[str, str]:
        """Unit -> the tensors of it a local check leaves out, in words: other ranks' rows of
        a sharded tensor ("rank 0's rows 0:4 of mlp.experts.down_proj,
        mlp.experts.gate_up_proj (12 tensors)"), tensors of several ranks' rows."""
        unit = W.tensor_unit(self.arch, self.config)
        per: dict[str, dict[tuple, list]] = {}
        for n in sorted(names):
            o = self.owned.get(n)
            per.setdefault(unit(n), {}).setdefault((o[0],) if o else (None,), []).append(o or n)
        out = {}
        for u, groups in per.items():
            parts = []
            for (r,), xs in sorted(groups.items(), key=lambda kv: (kv[0][0] is None, kv[0][0] or 0)):
                if r is None:
                    parts.append(f"{len(xs)} tensor{'s' if len(xs) > 1 else ''} of several ranks' rows or another layout")
                    continue
                parts.append(f"rank {r}'s {_rows_of([(x[2], x[3]) for x in xs], {x[1] for x in xs})} "
                             f"({len(xs)} tensor{'s' if len(xs) > 1 else ''})")
            out[u] = "; ".join(parts) + ": check_weights checks them"
        return out

    def _local_ref_digests(self) -> dict[str, str]:
        return _LocalReference(self).digests(self._engine.dtype, self._engine.dtypes)


    def close(self) -> None:
        """Take back what this rank's functional pass and cold oracle kept (numbisect's view of
        the engine in its workers, the cold oracle's fork server); the engine stays running."""
        if self._probe is not None:
            self._probe.close()
            self._probe = None

    # -- the trigger and the replay bundle ----------------------------------------------------
    def trigger(self, out_dir: str | os.PathLike, *, threshold: float = 1e-3, cooldown: int = 10, max_fires: int = 3,
                weights: bool = True) -> ShardedTrigger:
        """A trigger for this sharded trainer (`ShardedTrigger`): fed on every rank with that
        rank's batch; on a fire, a replay bundle under `out_dir/fire-N` on the engine's rank."""
        return ShardedTrigger(self, out_dir, threshold=threshold, cooldown=cooldown, max_fires=max_fires, weights=weights)

    def write_bundle(self, out_dir: str | os.PathLike, samples=None, *, fire=None, weights: bool = True,
                     shares: list | None = None) -> dict:
        """A replay bundle (numbisect.live.bundle's layout) of the batch, written on each rank
        with an engine; call it on every rank with that rank's `samples` (token ids, sent in
        one exchange). The weight check runs (every rank gathering each layer once, in one
        order) and the layers it gathers are kept on each engine rank as the bundle's
        reference weights: the model is gathered once for both; the engine's weights are read
        back from that rank's engine. One engine rank: its bundle at `out_dir`, of every
        rank's samples. Several (colocated, each rank's rollouts from its own engine): each
        engine rank's bundle at `out_dir-rankR`, of its own samples (the first engine rank's
        with those of the ranks without an engine too), its check and engine its own, and
        `fire`'s value there the k3 of those samples' tokens (`shares`: each rank's k3 sum
        and token count, from the trigger; what its replay reproduces), the batch's kept as
        `batch_value`. No functional
        comparison (the finding says so): the replay compares the two checkpoints on the
        batch. Returns, on every rank, the bundle's path and finding (a rank without an
        engine: the first engine rank's) and `paths` (engine rank -> its bundle); an error on
        an engine rank is a `ShardedError` line on every rank."""
        each = self._agree("write_bundle", samples)
        several = len(self.engines) > 1
        out = os.fspath(out_dir)
        self._keep = {} if self._engine is not None else None  # the reference's tensors (digests, weights if `weights`)
        try:
            check = self.check_weights(step=f"fire (batch {fire.step})" if fire is not None else "bundle")
            ref, self._keep = self._keep, None
            result, err = None, None
            if self._engine is not None:
                try:
                    if several:
                        mine = [r for r in range(self.world) if r == self.rank or
                                (self.rank == self.driver and r not in self.engines)]
                        path, rank_fire = f"{out}-rank{self.rank}", _RankFire.of(fire, self.rank, mine, shares)
                    else:
                        mine, path, rank_fire = range(self.world), out, fire
                    merged = [x for r in mine if each[r] for x in each[r]]
                    with self._beating("waiting for a replay bundle"):  # two whole checkpoints written
                        b = self._write_bundle(path, merged or None, check, rank_fire, ref, weights)
                    result = {"path": b.path, "finding": b.finding}
                except Exception as e:  # said on every rank, in one line
                    err = exception_line(e)
                del ref
        finally:
            self._keep = None
        msgs = self._settle((result, err), "writing the bundle")
        failed = next(((r, m[1]) for r, m in enumerate(msgs) if m[1]), None)
        if failed is not None:
            raise ShardedError(f"the replay bundle could not be written on rank {failed[0]}: {failed[1]}")
        own = msgs[self.rank if self._engine is not None else self.driver][0]
        return {**own, "paths": {r: msgs[r][0]["path"] for r in self.engines}}

    def _write_bundle(self, out: str, samples, check: W.WeightCheck, fire, ref: dict, weights: bool):
        """The bundle's parts and manifest, on the engine's rank (write_bundle)."""
        os.makedirs(out, exist_ok=True)
        eng = self._engine
        trace = samples_trace(samples if samples else random_samples(self.config.get_text_config().vocab_size))
        parts: dict = {}
        B.write_trace(trace, os.path.join(out, "trace.jsonl"))
        parts["trace"] = "trace.jsonl"
        live = engine_settings(self.llm)
        live.pop("dtype", None)  # recorded apart (`--engine-dtype`)
        B.write_json_atomic(os.path.join(out, "engine.json"), B.engine_settings(live))
        parts["engine_settings"] = "engine.json"
        B.write_reference_digests(out, ref, eng.dtype)
        parts["reference_digests"] = "reference-digests.json"
        parts["reference"] = parts["engine"] = None
        if weights:
            W.write_checkpoint(os.path.join(out, "reference"), self.config, ref)
            tensors = eng.tensors()
            W.write_checkpoint(os.path.join(out, "engine"), self.config, {n: t for n, t in tensors.items() if n in ref})
            parts["reference"], parts["engine"] = "reference", "engine"
            del tensors
        ref_dtype = next(iter(ref.values())).dtype
        B.write_json_atomic(os.path.join(out, "weights.json"), {"weights": check.to_dict()})
        parts["weights_report"] = "weights.json"
        parts["compare_report"] = parts["routing"] = None
        finding = {"weights_ok": check.ok, "weights_differ": {u.unit: u.status for u in check.differing()},
                   "weights_summary": check.lines(), "weight_version": check.weight_version,
                   "compare_refused": "a sharded trainer (attach_sharded): no live comparison; the replay compares the "
                                      "gathered reference with the engine's weights on the batch"}
        faults = ENGINE.planted_in(self.llm)
        return B.write_manifest(out, arch=self.arch.name, model_type=getattr(self.config, "model_type", None),
                                ref_dtype=ref_dtype, eng_dtype=eng.dtype, live_settings=live, faults=faults, trace=trace,
                                fire=fire, finding=finding, parts=parts)


@dataclass
class _RankFire:
    """A fire as one engine rank's bundle records it (`ShardedProbe.write_bundle`, several
    engine ranks): the value this rank's own share of the batch gave (what its bundle's
    replay reproduces), the batch's beside it."""

    fire: object
    rank: int
    value: float

    @classmethod
    def of(cls, fire, rank: int, ranks: list[int], shares: list | None):
        """The fire of the bundle of `ranks`' samples: their tokens' mean k3 (`shares`: each
        rank's k3 sum and token count), else the batch's."""
        if fire is None:
            return None
        total = sum(shares[r][0] for r in ranks) if shares else 0.0
        tokens = sum(shares[r][1] for r in ranks) if shares else 0
        return cls(fire, rank, total / tokens if tokens else fire.value)

    def to_dict(self) -> dict:
        return {**self.fire.to_dict(), "value": self.value, "batch_value": self.fire.value, "rank": self.rank}


class ShardedTrigger:
    """numbisect.live.trigger's `Trigger` on a sharded trainer, fed on every rank.

    What an FSDP trainer has: each rank its own share of the batch (data parallel), with
    both log-probs of each token: the trainer's, from its forward on the sharded model, and
    the rollout's, which came with the batch from the engine (verl, TRL and prime-rl ship
    them with the samples). So every rank calls `feed(trainer_logprobs, rollout_logprobs,
    mask, samples=its token ids)` with its own share; the ranks agree in one exchange (the
    sharded check's: one agreed call, bounded by the probe's timeout, a rank that skips it
    is a `ShardedError` line on the others) and each rank's k3 sum and token count are
    summed: the batch's value is the mean k3 over every rank's tokens, the same on every
    rank, so every rank fires together. A rank's bad input is an `InputError` line on every
    rank. On a fire every rank runs `ShardedProbe.write_bundle` (the weight check, the model
    gathered once, the bundle written on the engine's rank under `out_dir/fire-N`; with an
    engine on several ranks, each engine rank's own under `out_dir/fire-N-rankR`, its fire
    value that rank's own k3); `fire.results` gets the bundle's path and finding on every
    rank (this rank's, or the first engine rank's on a rank without an engine) and, with
    several, `bundles` (engine rank -> path)."""

    def __init__(self, probe: ShardedProbe, out_dir, *, threshold=1e-3, cooldown=10, max_fires=3, weights=True):
        self.probe = probe
        self.out_dir = os.fspath(out_dir)
        self.weights = weights
        self.trigger = Trigger(threshold=threshold, cooldown=cooldown, max_fires=max_fires, on_fire=self._fire)
        self._shares: list | None = None  # each rank's (k3 sum, tokens) in the last batch fed

    @property
    def fires(self) -> list:
        return self.trigger.fires

    @property
    def values(self) -> list[float]:
        return self.trigger.values

    @property
    def skipped(self) -> list[int]:
        return self.trigger.skipped

    @property
    def rank_values(self) -> list[float | None] | None:
        """Each rank's own k3 in the last batch fed (None for a rank with no token), or None."""
        return None if self._shares is None else [t / n if n else None for t, n in self._shares]

    def feed(self, trainer_logprobs, rollout_logprobs, mask=None, *, step: int | None = None, samples=None):
        """This rank's share of the batch (class doc); every rank calls it. The Fire, if it fired."""
        total, n, err = 0.0, 0, None
        try:
            value, n = batch_tokens(trainer_logprobs, rollout_logprobs, mask)
            total = value * n if n else 0.0
        except InputError as e:
            err = e.message
        seen = self.probe._agree("trigger", (total, n, err, step))
        bad = next(((r, x[2]) for r, x in enumerate(seen) if x[2]), None)
        if bad is not None:
            raise InputError(f"rank {bad[0]}'s batch: {bad[1]}" if bad[0] != self.probe.rank else bad[1])
        step = seen[self.probe.driver][3]  # the engine's rank's count of batches, if it gave one
        tokens = sum(x[1] for x in seen)
        self._shares = [(x[0], x[1]) for x in seen]  # each rank's k3 sum and tokens (its own bundle's value, colocated)
        if tokens == 0:
            return self.trigger.feed([], [], step=step)  # warns, records the batch as skipped
        return self.trigger.feed_value(sum(x[0] for x in seen) / tokens, step=step, samples=samples)

    def _fire(self, fire) -> None:
        out = os.path.join(self.out_dir, f"fire-{len(self.trigger.fires)}")
        res = self.probe.write_bundle(out, fire.samples, fire=fire, weights=self.weights, shares=self._shares)
        fire.results["bundle"] = res["path"]
        if len(res["paths"]) > 1:
            fire.results["bundles"] = res["paths"]
        fire.results.update({k: v for k, v in res["finding"].items() if k != "weights_summary"})


def _rows_summary(rows: list[dict], owned: dict | None = None) -> str:
    """A unit's summary where its tensors differ rows per rank: one phrase per pattern of
    the ranks' verdicts ("rank 1's rows unwritten: still the weights of check 1, rank 0's
    ok (6 tensors)"; for tensors made of one rank's rows of a sharded tensor, `owned`,
    "rank 1's rows 4:8 of mlp.experts.down_proj, mlp.experts.gate_up_proj unwritten: still
    the weights of check 1; rank 0's ok (12 tensors)"), the other tensors as the weight
    check phrases them; "" when none does."""
    per_rank = [r for r in rows if r.get("how") == "rows per rank"]
    if not per_rank or any(r.get("how") != "rows per rank" for r in rows if r["status"] != W.OK):
        return ""
    groups: dict[str, int] = {}
    whole = [r for r in per_rank if any("of" in e for e in r["ranks"])]
    if whole:
        groups.update(_owned_summary(whole, owned or {}))
        per_rank = [r for r in per_rank if r not in whole]
    for r in per_rank:
        if any("tensor" in e for e in r["ranks"]):  # rows of another tensor: named one by one
            key = f"{W.short_name(r['tensor'])}: {r['phrase']}"
        else:
            bad = [e for e in r["ranks"] if e["status"] != W.OK]
            ok = [str(e["rank"]) for e in r["ranks"] if e["status"] == W.OK]
            key = ", ".join(f"rank {e['rank']}'s rows " + _rank_phrase(e).split(") ", 1)[1] for e in bad)
            key += f"; rank {','.join(ok)}'s ok" if ok else ""
        groups[key] = groups.get(key, 0) + 1
    return "; ".join(k if n == 1 or ":" in k.split(" ", 1)[0] else f"{k} ({n} tensors)" for k, n in groups.items())


def _owned_summary(rows: list[dict], owned: dict) -> dict[str, int]:
    """`_rows_summary`'s phrases for tensors each made of one rank's rows (`owned`): per
    rank and verdict, the rows and the tensors they are rows of, and the ranks whose rows of
    those tensors all read right; each phrase with its number of tensors."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        e = r["ranks"][0]
        groups.setdefault((e["rank"], e["status"], e.get("holds")), []).append(e)
    bad_ranks = {k[0] for k in groups}
    out = {}
    for (rank, status, holds), es in groups.items():
        srcs = {e["of"] for e in es}
        owners = sorted({o[0] for o in owned.values() if o[1] in srcs} - bad_ranks)
        key = f"rank {rank}'s {_rows_of([tuple(e['rows']) for e in es], srcs)} {_verdict(status, holds)}"
        key += f"; rank {','.join(str(o) for o in owners)}'s ok" if owners else ""
        out[f"{key} ({len(es)} tensors)" if len(es) > 1 else key] = 1
    return out


def _rows_of(spans: list[tuple[int, int]], srcs) -> str:
    """Rows of sharded tensors in words ("rows 0:4 of mlp.experts.down_proj,
    mlp.experts.gate_up_proj"), spans that meet joined."""
    spans = sorted(set(spans))
    rows = f"{spans[0][0]}:{spans[-1][1]}" if all(x[1] == y[0] for x, y in zip(spans, spans[1:])) else \
        ", ".join(f"{a}:{b}" for a, b in spans)
    return f"rows {rows} of {', '.join(W.short_name(x) for x in sorted(srcs))}"


def _along(v: torch.Tensor, c: int, start: int, count: int) -> bool:
    """Whether row markers `v` hold rows start..start+count-1, in order, along dimension `c`."""
    view = [1] * v.dim()
    view[c] = count
    return torch.equal(v, (torch.arange(count, dtype=torch.int32) + start).view(view).expand_as(v))


def _index_apart(name: str, local: str, first: int) -> bool:
    """Whether a checkpoint name and the name the weight conversion gives the same tensor of
    this rank's shard differ by one index only, the local one counted from this rank's first
    row (`first`): "experts.5.up_proj.weight" and "experts.1.up_proj.weight" for first 4."""
    x, y = name.split("."), local.split(".")
    diff = [(p, q) for p, q in zip(x, y) if p != q]
    if len(x) != len(y) or len(diff) > 1:
        return False
    return not diff and first == 0 or bool(diff) and diff[0][0].isdigit() and diff[0][1].isdigit() \
        and int(diff[0][0]) - int(diff[0][1]) == first


def _verdict(status: str, holds) -> str:
    """What rows of a rank hold, in words ("unwritten: still the weights of check 1")."""
    what = {W.UNWRITTEN: f"unwritten: still the weights of {holds}", W.STALE: f"stale: still the weights of {holds}"}
    return what.get(status) or (f"hold {holds}" if holds else "changed")


def _rank_phrase(e: dict) -> str:
    a, b = e["rows"]
    of = f" of {W.short_name(e['of'])}" if e.get("of") else ""
    return f"rows {a}:{b}{of} (rank {e['rank']}) {_verdict(e['status'], e.get('holds'))}"


class _EngineSide:
    """The engine as the driver reads it: in this process, or through `apply_model`."""

    def __init__(self, llm, shapes: dict):
        self.llm = llm
        self.config, self.dtype = ENGINE.model_config(llm)
        self.shapes = shapes
        self.arch = arch_for(self.config)
        self.tied = bool(getattr(self.config.get_text_config(), "tie_word_embeddings", False))
        self.in_process = ENGINE.in_process_client(llm)
        if self.in_process:
            self.model = ENGINE.in_process_model(llm)
            self.dtypes = W.engine_dtypes(self.model, shapes, self.dtype)
        else:
            self.model = None
            self.dtypes = ENGINE.remote_dtypes(llm, shapes, self.dtype)

    def tensors(self) -> dict:
        """Every engine tensor in checkpoint names (copies)."""
        if self.model is not None:
            return W.engine_tensors(self.model, self.shapes)
        return W.remote_tensors(self.llm, self.shapes)

    def units(self) -> W.UnitReader:
        if self.model is not None:
            return W.unit_reader(self.shapes, self.arch, self.config, model=self.model)
        return W.unit_reader(self.shapes, self.arch, self.config, llm=self.llm)


class _LocalReference(W.ReferenceReader):
    """This rank's share of the reference, no communication: each layer's weight conversion
    reverted on this rank's shards (`to_local()`; a replicated tensor's is the whole tensor),
    its tensors named as `ShardedProbe._local_names` found at attach: the checkpoint
    tensors this rank holds whole (replicated ones, the experts whose rows are this rank's)
    and this rank's rows of the others a rank holds rows of."""

    def __init__(self, probe: ShardedProbe, dtype=None):
        self.probe = probe
        self.model = probe.model
        self.dtype = dtype
        self._groups = probe.groups
        self._cached = None
        self.layer_of = probe.layer_of
        self.shapes = {}
        for m in probe.local_map.values():
            for n in m.values():
                shape = list(probe.shapes[n])
                if n in probe.local_cut:
                    d, a, b = probe.local_cut[n]
                    shape[d] = b - a
                self.shapes[n] = tuple(shape)

    def _revert(self, key: str, sd: dict | None = None) -> dict[str, torch.Tensor]:
        from transformers.core_model_loading import revert_weight_conversion

        names = self.probe.local_map.get(key, {})
        if not names:
            return {}
        with torch.no_grad():
            sd = self.model.state_dict() if sd is None else sd
            out = revert_weight_conversion(self.model, {k: (sd[k].to_local() if _is_dtensor(sd[k]) else sd[k]).detach()
                                                        for k in self._groups[key]})
        return {names[n]: v for n, v in out.items() if n in names and isinstance(v, torch.Tensor) and v.is_floating_point()}


class _LocalUnits:
    """The engine's units, each tensor cut to this rank's rows where the local reference
    holds this rank's rows of it (`local_cut`), the tensors it does not hold left out
    (other ranks' experts); tensors of no reference name pass (the check's `unmapped`)."""

    def __init__(self, reader: W.UnitReader, probe: ShardedProbe, names: set[str]):
        self.reader, self.probe, self.names = reader, probe, names
        self.peak_bytes, self.unit_bytes = None, {}

    def __iter__(self):
        for unit, tensors in self.reader:
            cut = {}
            for n, t in tensors.items():
                if n in self.probe.shapes and n not in self.names:
                    continue  # not checked here: `not_checked`
                c = self.probe.local_cut.get(n)
                if c is not None and tuple(t.shape) == self.probe.shapes.get(n):
                    t = t.narrow(c[0], c[1], c[2] - c[1])
                cut[n] = t
            yield unit, cut


class _Mirrored:
    """The reference's backend (transformers, over the sharded model) on a rank with an
    engine, each forward of it run on every rank together: one exchange per sample
    (`ShardedProbe._exchange`), then this rank's forward of that sample (FSDP2 gathers each
    layer in its forward: a collective). Prefill only; the rest is the backend's own."""

    def __init__(self, inner, probe: ShardedProbe):
        self._inner, self._probe = inner, probe

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def forward(self, samples, *, full_logits=False, capture=(), capture_inputs=(), feed=None, mode="prefill"):
        if mode != "prefill":
            raise InputError("a sharded reference runs in prefill mode only (its forwards run on every rank together)")
        out = None
        for i, s in enumerate(samples):
            self._probe._exchange(("forward", (list(s.ids), len(s.prompt_ids))), "a forward of the sharded model")
            r = self._inner.forward([s], full_logits=full_logits, capture=capture, capture_inputs=capture_inputs,
                                    feed={u: xs[i:i + 1] for u, xs in (feed or {}).items()}, mode=mode)
            if out is None:
                out = r
                continue
            out.token_logprobs += r.token_logprobs
            if out.full_logprobs is not None:
                out.full_logprobs += r.full_logprobs or []
            for mine, theirs in ((out.captures, r.captures), (out.inputs, r.inputs)):
                for u, xs in theirs.items():
                    mine.setdefault(u, []).extend(xs)
        return out if out is not None else self._inner.forward([], full_logits=full_logits, capture=capture,
                                                                capture_inputs=capture_inputs, mode=mode)


class _DriverProbe(Probe):
    """numbisect.live.probe's `Probe` on a rank with an engine, over the sharded model (its
    forwards mirrored on every rank: `_Mirrored`) and that rank's engine: the functional
    pass, the cold oracle and poison control's pushes, as the whole-model API has them. Its
    weight history is the sharded probe's (no digest of its own at attach)."""

    def __init__(self, sharded: ShardedProbe):
        ref, model, _ = _reference(sharded.model, None, sharded=True)
        eng, llm, owned, settings = _engine(sharded.llm, None)
        super().__init__(_Mirrored(ref, sharded), eng, model, llm, owned, settings)
        self.history = sharded.history
        self._sharded = sharded

    def _record_attach(self) -> None:
        pass  # the sharded probe's history (its digests gathered on every rank)

    def _load_cold(self, job: dict, timeout: float | None) -> dict:
        """The cold child, the other ranks kept in step meanwhile (`ShardedProbe._beating`), so
        a child that outlasts the probe's timeout does not time out the ranks waiting for
        this one."""
        with self._sharded._beating("waiting for the cold engine"):
            return super()._load_cold(job, timeout)


def _stream_checkpoint(layers, dest: str | None, config) -> tuple[dict[str, str], dict[str, tuple]]:
    """The digest and shape of each tensor of `layers` ((key, tensors) in checkpoint names,
    one layer at a time); with `dest`, each layer written there as a file of its own plus
    transformers' index and the config (one layer's tensors held at a time)."""
    from safetensors.torch import save_file

    digests, shapes, index, total = {}, {}, {}, 0
    if dest is not None:
        os.makedirs(dest, exist_ok=True)
    for i, (_, tensors) in enumerate(layers):
        for n, t in tensors.items():
            digests[n], shapes[n] = W.digest(t), tuple(t.shape)
        if dest is not None and tensors:
            fname = f"model-{i:05d}.safetensors"
            save_file({n: t.detach().contiguous() for n, t in tensors.items()}, os.path.join(dest, fname),
                      metadata={"format": "pt"})
            index.update({n: fname for n in tensors})
            total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    if dest is not None:
        config.to_json_file(os.path.join(dest, "config.json"))
        with open(os.path.join(dest, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": index}, f)
    return digests, shapes


@contextlib.contextmanager
def _single_process_env():
    """The trainer's process-group variables (RANK, WORLD_SIZE, MASTER_PORT, ...) replaced,
    for the block, by a world of one on a free port: an engine started from a rank (the cold
    oracle's child) builds its own group, not one over the trainer's ranks."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with environ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                  "MASTER_PORT": str(port)}):
        yield


def attach_sharded(model, engine=None, *, timeout: float = DEFAULT_TIMEOUT, group=None) -> ShardedProbe:
    """A `ShardedProbe` over a trainer's sharded model (module doc). Call on every rank, once,
    after `fully_shard`; `engine`: the `vllm.LLM` on the rank that holds it (None elsewhere);
    `timeout`: the longest a check waits for the other ranks (seconds; a rank's longer work,
    a cold child, keeps them waiting in exchanges `heartbeat` apart: module doc, 10); `group`: a gloo
    group of your own for the check's exchanges (default: one made here with `timeout`)."""
    if not dist.is_available() or not dist.is_initialized():
        raise LiveError("attach_sharded: torch.distributed is not initialized (call it on every rank of the trainer, "
                        "after init_process_group and fully_shard); for a whole model in one process use attach()")
    if not any(isinstance(p, DTensor) for p in model.parameters()):
        raise LiveError("attach_sharded: the model holds no DTensor (it was not sharded with fully_shard); "
                        "for a whole model in one process use attach()")
    return ShardedProbe(model, engine, timeout, group)


__all__ = ["attach_sharded", "ShardedProbe", "ShardedTrigger", "ShardedError", "rank_rows", "shard_dim", "DEFAULT_TIMEOUT"]

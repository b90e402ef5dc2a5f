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
   "rows 64:128 (rank 1) hold k_proj's rows of rank 1".
5. `ShardedProbe.check_sync(sync)`: the user's sync under poison control (as
   `Probe.check_sync`, numbisect.live.poison), every rank running the sync between the
   poison and the check.
6. `ShardedProbe.check_local()`: no communication; on a rank with an engine, this rank's
   own rows of every tensor the trainer shards against the engine's same rows (its own
   history of digests), the rest of the tensors (replicated) whole.

7. `ShardedProbe.trigger(out_dir)`: numbisect.live.trigger's trigger fed on every rank with
   that rank's share of the batch, the ranks agreeing in one exchange on the batch's mean
   k3 over every rank's tokens; on a fire, `write_bundle` on every rank: the replay bundle
   written on the engine's rank, its reference weights the layers the check gathered
   (the model gathered once), the engine's read back (`ShardedTrigger`).

Every rank gets the same `WeightCheck` back (the driver's, sent in the last exchange).
The trainer's model is never changed; it may keep training between checks.
"""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import json
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from numbisect.common.errors import InputError
from numbisect.live import bundle as B
from numbisect.live import poison as X
from numbisect.live import transfer as T
from numbisect.live import weights as W
from numbisect.live.engine import ENGINE
from numbisect.live.engine import settings as engine_settings
from numbisect.live.errors import LiveError
from numbisect.live.probe import random_samples, samples_trace
from numbisect.live.sync import push
from numbisect.live.trigger import Trigger, batch_tokens
from numbisect.model.arch import arch_for

DEFAULT_TIMEOUT = 60.0  # seconds: the longest any rank waits for the others in a check (the driver reading one unit back included)
DONE = "__done__"


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

    def _revert(self, key: str) -> dict[str, torch.Tensor]:
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
        self.shapes, self.layer_of, self.dims = self._checkpoint_names()
        holders = self._all_gather(("attach", self.fingerprint, engine is not None), "attach_sharded")
        other = next((r for r, h in enumerate(holders) if h[1] != self.fingerprint), None)
        if other is not None:
            raise ShardedError(f"attach_sharded: rank {other}'s model has other state-dict names, shapes, placements or "
                               f"another order of them than rank {self.rank}'s: attach the same sharded model on every rank")
        drivers = [r for r, h in enumerate(holders) if h[2]]
        if not drivers:
            raise ShardedError("attach_sharded: no rank was given the engine (engine=llm on the rank that holds it)")
        self.driver = drivers[0]
        self._keep: dict | None = None
        self.history = W.History()
        self.row_history: list[tuple[str, dict[str, list[str]]]] = []  # (label, name -> rows' digests)
        self.local_history = W.History()  # check_local's: this rank's rows
        self._engine = None
        if self.rank == self.driver:
            self._engine = _EngineSide(engine, self.shapes)
        self.gathers = 0
        digests, chunks = self._driven(lambda ref: (ref.digests(self._engine.dtype, self._engine.dtypes), ref.chunks))
        if self.rank == self.driver:
            self.history.add("attach", digests)
            self.row_history.append(("attach", chunks))
        if self._engine is not None:
            self.local_history.add("attach", self._local_ref_digests())

    # -- names -------------------------------------------------------------------------------
    def _checkpoint_names(self):
        """Checkpoint names of the reference (transformers' revert of the weight conversion on
        meta tensors: nothing gathered): shapes, layer, and the dimension a name's tensor is
        sharded along where its state-dict tensor is that same tensor."""
        from transformers.core_model_loading import revert_weight_conversion

        sd = self.model.state_dict()
        shapes, layer_of, dims = {}, {}, {}
        for key, ks in self._groups.items():
            meta = {k: torch.empty(tuple(sd[k].shape), dtype=sd[k].dtype, device="meta") for k in ks}
            out = revert_weight_conversion(self.model, meta)
            for n, t in out.items():
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    shapes[n], layer_of[n] = tuple(t.shape), key
                    if n in sd and tuple(sd[n].shape) == tuple(t.shape):
                        dims[n] = shard_dim(sd[n])
        return shapes, layer_of, {n: d for n, d in dims.items() if d is not None}

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
        """Driver side of one exchange: every rank told `key`, then the layer gathered by all."""
        self._all_gather(key, "gathering a layer")
        return self._gather(key)

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

    def _driven(self, work):
        """Run `work(reader)` on the driver while the other ranks follow its requests; every
        rank returns the driver's result (sent in the last exchange)."""
        if self.rank == self.driver:
            try:
                result = work(ShardedReference(self))
            except BaseException as e:
                self._all_gather((DONE, None, f"{type(e).__name__}: {e}"), "ending a check")
                raise
            self._all_gather((DONE, result, None), "ending a check")
            return result
        while True:
            msgs = self._all_gather(None, "following the check")
            msg = msgs[self.driver]
            if isinstance(msg, tuple) and msg and msg[0] == DONE:
                if msg[2]:
                    raise ShardedError(f"the check failed on rank {self.driver}: {msg[2]}")
                return msg[1]
            self._gather(msg)

    # -- checks -------------------------------------------------------------------------------
    def check_weights(self, step: str | None = None) -> W.WeightCheck:
        """Per unit, whether the engine computes with the trainer's weights (module doc, 2-4).
        Call it on every rank."""
        self._agree("check_weights")
        label = step or f"check {self.calls}"
        t0 = time.perf_counter()
        return self._driven(functools.partial(self._check, label=label, t0=t0))

    def check_sync(self, sync, *, seed: int = 0, step: str | None = None) -> W.WeightCheck:
        """`sync()` (the user's push, run on every rank: its gathers are collectives) under
        poison control (numbisect.live.poison), then `check_weights`; call it on every rank.
        On the engine's rank, before the sync: the engine's tensors read back (kept) and
        overwritten with seeded random values through vLLM's reload, each read back again;
        a tensor, or a rank's rows, the sync never wrote is then `unwritten`, "still the
        weights of poison (seed N)", whatever the engine held before. The tensors the sync
        left poisoned are put back to what they held before it. A poison that could not be
        pushed or did not reach a tensor: `PoisonError` on every rank, the engine put back,
        the sync not run."""
        self._agree("check_sync")
        label = step or f"check {self.calls}"
        p, err = None, None
        if self.rank == self.driver:
            try:
                p = self._poison(seed)
            except X.PoisonError as e:
                err = e.message
        errors = [e for e in self._all_gather(err, "poisoning the engine") if e]
        if errors:
            raise X.PoisonError(errors[0])
        sync()
        t0 = time.perf_counter()
        return self._driven(functools.partial(self._check_poisoned, p=p, label=label, t0=t0))

    def _poison(self, seed: int) -> X.Poisoned:
        """The engine's tensors read back and poisoned (check_sync), on the engine's rank."""
        eng = self._engine
        t0 = time.perf_counter()
        saved = {n: t for n, t in eng.tensors().items() if n in self.shapes}
        held = {n: W.digest(t) for n, t in saved.items()}
        before = (self.history.previous() or ("", {}))[1]
        poison = X.poison_values(saved, {n: {held[n], before.get(n)} for n in saved}, seed, W.digest)
        p = X.Poisoned(seed=seed, label=X.POISON_LABEL.format(seed=seed), tensors=len(saved))
        push(self.llm, list(poison.items()), repack=True)
        p.digests = {n: d for n, d in W.reader_digests(eng.units()).items() if n in saved}
        missed = sorted(n for n in saved if p.digests.get(n) in (None, held[n]))
        if missed:
            push(self.llm, list(saved.items()), repack=True)
            raise X.PoisonError(f"the poison did not reach {len(missed)} engine tensor(s) ({', '.join(missed[:4])}): "
                                "a sync that skips them could not be told; the engine was put back as found")
        p.rows = {n: [W.digest(t.narrow(self.dims[n], a, b - a)) for a, b in rank_rows(t.shape[self.dims[n]], self.world)]
                  for n, t in poison.items() if n in self.dims}
        self._saved = saved
        p.seconds = X.timed(t0)
        return p

    def _check_poisoned(self, ref: ShardedReference, p: X.Poisoned, label: str, t0: float) -> W.WeightCheck:
        """The check after a poisoned sync, the poison as the step before it; then the
        tensors still holding it put back (check_sync)."""
        entry, rentry = (p.label, p.digests), (p.label, p.rows)
        self.history.steps.append(entry)
        self.row_history.append(rentry)
        try:
            check = self._check(ref, label, t0, keep_digests=True)
        finally:
            self.history.steps = [s for s in self.history.steps if s is not entry]
            self.row_history = [s for s in self.row_history if s is not rentry]
        t1 = time.perf_counter()
        p.left = X.still_poisoned(check.engine_digests, p)
        check.engine_digests = {}
        if p.left:  # the sync's tensors as it wrote them, the others as they were before the poison
            push(self.llm, list(X.put_back(self._engine.tensors(), self._saved, p.left).items()), repack=True)
            p.restored = True
        self._saved = None
        p.restore_seconds = X.timed(t1)
        p.check = None
        check.poison = p.to_dict()
        return check

    def _check(self, ref: ShardedReference, label: str, t0: float, keep_digests: bool = False) -> W.WeightCheck:
        eng = self._engine
        rows = functools.partial(self._rows, ref)
        check = W.check(ref, eng.units(), self.history, self.arch, self.config, dtype=eng.dtype, dtypes=eng.dtypes,
                        step=label, tied=eng.tied, t0=t0, rows=rows)
        self.row_history.append((label, dict(ref.chunks)))
        del self.row_history[: -self.history.keep]
        for u in check.units:
            u.summary = _rows_summary(u.tensors) or u.summary
        if not keep_digests:
            check.engine_digests = {}
        return T.annotate(check, eng.llm, self.arch, self.config, list(self.shapes))  # the weight version, the last push

    def _rows(self, ref: ShardedReference, name: str, t: torch.Tensor) -> dict | None:
        """A verdict on the rows of each rank of a sharded tensor that differs, when the ranks'
        rows do not all tell the same (module doc, 4); None otherwise."""
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

    def check_local(self, step: str | None = None) -> W.WeightCheck | None:
        """This rank's own rows against the engine's same rows, no communication (module
        doc, 6); None on a rank without an engine."""
        if self._engine is None:
            return None
        t0 = time.perf_counter()
        label = step or f"local {len(self.local_history.steps)}"
        eng = self._engine
        ref = _LocalReference(self)
        return W.check(ref, _LocalUnits(eng.units(), self), self.local_history, self.arch, self.config,
                       dtype=eng.dtype, dtypes=eng.dtypes, step=label, tied=eng.tied, t0=t0)

    def _local_ref_digests(self) -> dict[str, str]:
        return _LocalReference(self).digests(self._engine.dtype, self._engine.dtypes)


    # -- the trigger and the replay bundle ----------------------------------------------------
    def trigger(self, out_dir: str | os.PathLike, *, threshold: float = 1e-3, cooldown: int = 10, max_fires: int = 3,
                weights: bool = True) -> ShardedTrigger:
        """A trigger for this sharded trainer (`ShardedTrigger`): fed on every rank with that
        rank's batch; on a fire, a replay bundle under `out_dir/fire-N` on the engine's rank."""
        return ShardedTrigger(self, out_dir, threshold=threshold, cooldown=cooldown, max_fires=max_fires, weights=weights)

    def write_bundle(self, out_dir: str | os.PathLike, samples=None, *, fire=None, weights: bool = True) -> dict:
        """A replay bundle (numbisect.live.bundle's layout) of the batch, written on the engine's
        rank; call it on every rank with that rank's `samples` (token ids; gathered to the
        engine's rank in one exchange). The weight check runs (every rank gathering each layer
        once, in one order) and the layers it gathers are kept on the engine's rank as the
        bundle's reference weights: the model is gathered once for both; the engine's weights
        are read back from the engine. No functional comparison (the finding says so): the
        replay compares the two checkpoints on the batch. Returns, on every rank, the bundle's
        path and finding; an error on the engine's rank is a `ShardedError` line on every rank."""
        each = self._agree("write_bundle", samples)
        driver = self.rank == self.driver
        self._keep = {} if driver else None  # the reference's tensors (its digests, and its weights when `weights`)
        try:
            check = self.check_weights(step=f"fire (batch {fire.step})" if fire is not None else "bundle")
            ref, self._keep = self._keep, None
            result, err = None, None
            if driver:
                try:
                    merged = [x for s in each if s for x in s]
                    b = self._write_bundle(os.fspath(out_dir), merged or None, check, fire, ref, weights)
                    result = {"path": b.path, "finding": b.finding}
                except Exception as e:  # said on every rank, in one line
                    err = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                del ref
        finally:
            self._keep = None
        msgs = self._all_gather((result, err), "writing the bundle")
        result, err = msgs[self.driver]
        if err:
            raise ShardedError(f"the replay bundle could not be written on rank {self.driver}: {err}")
        return result

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
        try:
            faults = sorted({x for specs in self.llm.apply_model(ENGINE.planted_faults) or [] for x in (specs or [])})
        except Exception:  # an engine that refuses a pickled function: unknown, recorded as none
            faults = []
        return B.write_manifest(out, arch=self.arch.name, model_type=getattr(self.config, "model_type", None),
                                ref_dtype=ref_dtype, eng_dtype=eng.dtype, live_settings=live, faults=faults, trace=trace,
                                fire=fire, finding=finding, parts=parts)


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
    gathered once, the bundle written on the engine's rank under `out_dir/fire-N`);
    `fire.results` gets the bundle's path and finding on every rank."""

    def __init__(self, probe: ShardedProbe, out_dir, *, threshold=1e-3, cooldown=10, max_fires=3, weights=True):
        self.probe = probe
        self.out_dir = os.fspath(out_dir)
        self.weights = weights
        self.trigger = Trigger(threshold=threshold, cooldown=cooldown, max_fires=max_fires, on_fire=self._fire)

    @property
    def fires(self) -> list:
        return self.trigger.fires

    @property
    def values(self) -> list[float]:
        return self.trigger.values

    @property
    def skipped(self) -> list[int]:
        return self.trigger.skipped

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
        if tokens == 0:
            return self.trigger.feed([], [], step=step)  # warns, records the batch as skipped
        return self.trigger.feed_value(sum(x[0] for x in seen) / tokens, step=step, samples=samples)

    def _fire(self, fire) -> None:
        out = os.path.join(self.out_dir, f"fire-{len(self.trigger.fires)}")
        res = self.probe.write_bundle(out, fire.samples, fire=fire, weights=self.weights)
        fire.results["bundle"] = res["path"]
        fire.results.update({k: v for k, v in res["finding"].items() if k != "weights_summary"})


def _rows_summary(rows: list[dict]) -> str:
    """A unit's summary where its tensors differ rows per rank: one phrase per pattern of
    the ranks' verdicts ("rank 1's rows unwritten: still the weights of check 1, rank 0's
    ok (6 tensors)"), the other tensors as the weight check phrases them; "" when none does."""
    per_rank = [r for r in rows if r.get("how") == "rows per rank"]
    if not per_rank or any(r.get("how") != "rows per rank" for r in rows if r["status"] != W.OK):
        return ""
    groups: dict[str, int] = {}
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


def _rank_phrase(e: dict) -> str:
    a, b = e["rows"]
    what = {W.UNWRITTEN: f"unwritten: still the weights of {e.get('holds')}", W.STALE: f"stale: still the weights of {e.get('holds')}"}
    text = what.get(e["status"]) or (f"hold {e['holds']}" if e.get("holds") else "changed")
    return f"rows {a}:{b} (rank {e['rank']}) {text}"


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
            self.dtypes = llm.apply_model(functools.partial(W.engine_dtypes, shapes=shapes, dtype=self.dtype))[0]

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
    """This rank's rows of every tensor the trainer shards, the others whole (replicated:
    `to_local()` is the whole tensor); no communication."""

    def __init__(self, probe: ShardedProbe, dtype=None):
        self.probe = probe
        self.model = probe.model
        self.dtype = dtype
        self._groups = probe.groups
        self._cached = None
        self.layer_of = probe.layer_of
        sd = probe.model.state_dict()
        self.shapes = {n: tuple(sd[n].to_local().shape) if _is_dtensor(sd[n]) else tuple(s)
                       for n, s in probe.shapes.items() if n in sd}

    def _revert(self, key: str) -> dict[str, torch.Tensor]:
        sd = self.model.state_dict()
        return {n: (sd[n].to_local() if _is_dtensor(sd[n]) else sd[n]).detach()
                for n in sorted(self._groups[key]) if n in self.shapes}


class _LocalUnits:
    """The engine's units, each tensor cut to this rank's rows where the trainer shards it."""

    def __init__(self, reader: W.UnitReader, probe: ShardedProbe):
        self.reader, self.probe = reader, probe
        self.peak_bytes, self.unit_bytes = None, {}

    def __iter__(self):
        for unit, tensors in self.reader:
            cut = {}
            for n, t in tensors.items():
                d = self.probe.dims.get(n)
                if d is not None and tuple(t.shape) == self.probe.shapes.get(n):
                    a, b = rank_rows(t.shape[d], self.probe.world)[self.probe.rank]
                    t = t.narrow(d, a, b - a)
                cut[n] = t
            yield unit, cut


def attach_sharded(model, engine=None, *, timeout: float = DEFAULT_TIMEOUT, group=None) -> ShardedProbe:
    """A `ShardedProbe` over a trainer's sharded model (module doc). Call on every rank, once,
    after `fully_shard`; `engine`: the `vllm.LLM` on the rank that holds it (None elsewhere);
    `timeout`: the longest a check waits for the other ranks (seconds); `group`: a gloo
    group of your own for the check's exchanges (default: one made here with `timeout`)."""
    if not dist.is_available() or not dist.is_initialized():
        raise LiveError("attach_sharded: torch.distributed is not initialized (call it on every rank of the trainer, "
                        "after init_process_group and fully_shard); for a whole model in one process use attach()")
    if not any(isinstance(p, DTensor) for p in model.parameters()):
        raise LiveError("attach_sharded: the model holds no DTensor (it was not sharded with fully_shard); "
                        "for a whole model in one process use attach()")
    return ShardedProbe(model, engine, timeout, group)


__all__ = ["attach_sharded", "ShardedProbe", "ShardedTrigger", "ShardedError", "rank_rows", "shard_dim", "DEFAULT_TIMEOUT"]

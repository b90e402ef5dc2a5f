"""A debugging session: one trace, one reference, one engine, and the trials run on them.

One way to make one: `Session(ref, engine, trace, settings, spec)` over backends already
open (numbisect.live.run hands it the live objects' backends); `Session.open(spec,
settings)` first opens and checks the inputs a `Spec` names (the CLI's directories:
options, trace, configs, then the loads) and builds it so. It holds them: `compare()`
runs the comparison pipeline (`numbisect.pipeline.comparison`) and keeps what it returns
(the reference's log-probs the trials reuse, its expert ids) and gives the baseline
report body; `trial(swapped)` is the evaluator the search calls; `self_check()` proves
the swaps. The layers above (the commands, numbisect.live, the TUI) hold a Session; the
layers below never see one.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from numbisect.backends import BACKENDS, open_backend, require_reference, services, source
from numbisect.backends.base import (
    Backend,
    ForwardResult,
    check_checkpoint,
    load_config,
)
from numbisect.common.errors import BackendError, InputError
from numbisect.model import groups as G
from numbisect.model.arch import arch_for
from numbisect.model.ckptdiff import diff_checkpoints
from numbisect.model.rlformats import load_any
from numbisect.model.trace import BUILTIN_GROUPS, Trace, check_vocab, samples_digest
from numbisect.patching.faults import check_fault, parse_fault
from numbisect.patching.prefix import DEFAULT_MB, PrefixCache
from numbisect.pipeline import comparison as P
from numbisect.pipeline import decode as D
from numbisect.pipeline import measure as C
from numbisect.pipeline.layerstream import LayerStreamRef
from numbisect.pipeline.routing import check_replay
from numbisect.report import findings as F
from numbisect.session.environment import set_threads
from numbisect.session.userengine import UserEngine


@dataclass
class Spec:
    """What the user asked to compare (recorded in the report as `inputs`)."""

    ref: str  # "hf:DIR"
    engine: str  # "hf:DIR", "vllm:DIR" or "rollout"
    trace: str  # JSONL path
    ref_dtype: str = "bfloat16"
    engine_dtype: str = "bfloat16"
    ref_opts: dict = field(default_factory=dict)
    engine_opts: dict = field(default_factory=dict)
    faults: list[str] = field(default_factory=list)  # planted engine faults, e.g. "weight_noise=1e-2@layers.0.attn"
    group_defs: list[str] = field(default_factory=list)  # extra token groups, "NAME=ID[,ID]"
    trace_format: str | None = None  # rlformats preset (None: numbisect JSONL or detected)
    trace_fields: str | None = None  # rlformats field map, "prompt=...,completion=...,logprobs=..."
    engine_mode: str = "prefill"  # "prefill", or "decode": prompt prefilled, completion decoded token by token
    replay_routing: str | None = None  # "ref" or "engine": the routing replay what-if (numbisect.pipeline.routing)
    capture: str = "stats"  # stats: streaming per-unit statistics; full: also every tensor to capture_dir; memory: all kept in RAM
    capture_dir: str | None = None  # full mode: safetensors go here
    max_capture_mb: float | None = None  # full mode: RAM buffered before spilling a unit to disk
    threads: int | None = None  # torch threads pinned in this process (None: torch's, or vLLM's binding)
    engine_config: dict | None = None  # the user's vLLM settings (--engine-config, --engine-opt on top; numbisect.session.userengine); the session sets engine_opts from it
    engine_config_path: str | None = None  # the --engine-config file


class Session:
    def __init__(self, ref: Backend, engine: Backend | None, trace: Trace, settings: C.Settings, spec: Spec, *,
                 engine_kind: str | None = None, progress=None, prefix_reuse: bool = True,
                 prefix_cache_mb: float | None = None, digests: dict | None = None,
                 checkpoint_diff: dict | None = None, group_origin: dict | None = None,
                 user_engine: UserEngine | None = None, owned=()):
        """A session over backends already open (`Session.open` opens them from the
        directories a `Spec` names; numbisect.live.run hands the live objects' backends).
        Nothing is read from disk here: `spec`'s faults are parsed and checked against the
        engine's units, its `engine_mode` is the engine's mode, its capture settings the
        comparison's. `engine=None`: the trace's own rollout log-probs (`engine_kind`
        "rollout"); `engine_kind` defaults to the engine backend's kind.

        `prefix_reuse`: a trial replays the leading layers it shares with the baseline or
        an earlier trial instead of recomputing them (`numbisect.patching.prefix`; same results),
        keeping at most `prefix_cache_mb` of recorded layer outputs (default
        `numbisect.patching.prefix.DEFAULT_MB`); prefill only (recordings are per engine
        call; decode calls once per token).

        What the opener found goes with them: `digests` (what a trial log's resume checks;
        default the trace's), `checkpoint_diff` (numbisect.model.ckptdiff), `group_origin`
        (where each token group came from), `user_engine` (--engine-config's run,
        numbisect.session.userengine) and `owned`, the backends `close()` closes.
        """
        self.spec = spec
        self.ref = ref
        self.engine = engine
        self.trace = trace
        self.settings = settings
        self.say = progress or (lambda msg: None)
        self.engine_kind = engine_kind or engine.kind
        # A dump or the rollout's own log-probs: compared, never run (no faults, swaps, trials).
        self.engine_runs = BACKENDS[self.engine_kind].runs
        self.mode = spec.engine_mode
        self.prefix_reuse = prefix_reuse and self.mode == "prefill"
        mb = DEFAULT_MB if prefix_cache_mb is None else prefix_cache_mb  # checked where parsed (cli)
        self.prefix = PrefixCache(max_bytes=math.ceil(mb * 2**20))
        self.faults = [parse_fault(f) for f in spec.faults]
        if engine is not None:
            for f in self.faults:
                check_fault(engine, f)
            D.check_faults(engine, self.faults, self.mode)
        if spec.threads:  # after the engine started: vLLM's CPU worker sets its own count
            set_threads(spec.threads)
        self.user_engine = user_engine
        self.checkpoint_diff = checkpoint_diff
        self.group_origin = {} if group_origin is None else group_origin
        self.samples = trace.samples
        self.groups = C.group_names(trace) + (["all"] if settings.group == "all" else [])
        self.digests = {"trace": trace.sha256} if digests is None else digests
        self._owned = list(owned)
        self._ref_result: ForwardResult | None = None
        self.ref_routing: dict | None = None  # router unit -> per-sample expert ids of the reference
        self._ref_tokens: ForwardResult | None = None  # the reference's log-probs from the last compare
        self.comparison: P.Comparison | None = None  # the last compare's result

    @classmethod
    def open(cls, spec: Spec, settings: C.Settings, progress=None, backends: dict | None = None,
             prefix_reuse: bool = True, prefix_cache_mb: float | None = None) -> Session:
        """The session over the directories `spec` names (the CLI's --ref, --engine,
        --trace): cheap checks first (options, trace, configs, architectures, vocabulary,
        groups), then the slow loads. `backends` may hold already-open "ref" / "engine"
        backends (tests share engines); the others are opened through the registry and
        closed by `close()`."""
        import torch

        torch.manual_seed(0)  # recorded as environment.seeds; nothing here samples, but hooks may
        o = _Opening(spec, settings, progress or (lambda msg: None))
        o.read_request()
        eng_cfg, given, dump = o.check_inputs(dict(backends or {}))
        ref, engine, owned = o.open_backends(eng_cfg, given, dump)
        return cls(ref, engine, o.trace, settings, spec, engine_kind=o.eng_kind, progress=progress,
                   prefix_reuse=prefix_reuse, prefix_cache_mb=prefix_cache_mb, digests=o.digests(),
                   checkpoint_diff=o.checkpoint_diff, group_origin=o.group_origin, user_engine=o.user_engine,
                   owned=owned)

    # -- the comparison pipeline ------------------------------------------------------------
    def sides(self) -> P.Sides:
        """The pipeline's inputs, as this session holds them now (`self_check` and the
        selftest change `faults` and `mode` between calls)."""
        return P.Sides(ref=self.ref, engine=self.engine, trace=self.trace, samples=self.samples, settings=self.settings,
                       groups=self.groups, faults=self.faults, mode=self.mode, say=self.say,
                       ref_result=self._ref_result, ref_routing=self.ref_routing)

    def reference(self) -> ForwardResult:
        """The whole-run reference (every unit's input and output), made once."""
        if self._ref_result is None:
            self._ref_result, self.ref_routing = P.reference_run(self.sides())
        return self._ref_result

    def reference_tokens(self) -> ForwardResult:
        """The reference's log-probs: from the last compare when there was one (a streamed
        compare makes no second reference forward and keeps no unit), else from `reference()`."""
        return self._ref_tokens or self.reference()

    def routing_probe(self, backend, replay=None):
        """A recorder (and replayer) of expert ids for `backend`; None on a dense model."""
        return self.sides().routing_probe(backend, replay)

    def engine_forward(self, swapped=(), capture=(), feed=None, mode=None, probe=None, *, prefix=None,
                       full_logits=True) -> ForwardResult:
        """The engine with its planted faults, then `swapped` units replaced by the reference's,
        run in `mode` (default: the session's engine mode), and, with `probe`, its expert ids
        recorded or replayed (`numbisect.pipeline.comparison.Sides.engine_forward`).

        `prefix=(recording, L)`: layers 0..L-1 replay the recording, the others are
        recorded in the session's prefix cache (`numbisect.patching.prefix`; used by `trial`).
        """
        return self.sides().engine_forward(swapped, capture, feed, mode, probe, prefix=prefix, cache=self.prefix,
                                           full_logits=full_logits)

    def compare(self, local: bool = True) -> dict:
        """Token metrics, RL cost and per-unit divergence of the unswapped engine: the
        report body of the pipeline's comparison (`numbisect.pipeline.comparison.compare`)."""
        capture = P.Capture(self.spec.capture, self.spec.capture_dir, self.spec.max_capture_mb)
        c = P.compare(self.sides(), local, capture, self.spec.replay_routing)
        self._ref_tokens = c.ref_tokens
        if c.ref_result is not None:
            self._ref_result = c.ref_result
        if c.ref_routing is not None:
            self.ref_routing = c.ref_routing
        self.comparison = c
        body = P.report_body(c)
        if self.user_engine is not None:  # the token-level comparison in the user's own configuration
            if self.user_engine.child:
                self.user_engine.fit_contract(self.ref, self.samples)
            body = self.user_engine.apply(body, c, self.samples, self.settings, self.groups, self.ref)
        differs = F.summary(self.checkpoint_diff)  # a finding at any threshold (numbisect.report.findings)
        if differs is not None:
            body["checkpoint_differs"] = differs
        return body

    def _prefix_key(self):
        """What the recorded prefix depends on besides the session's fixed engine and trace."""
        return (tuple(self.faults), id(self.engine), id(self.samples))

    def _trial_forward(self, swapped, full_logits: bool | None = None) -> tuple[ForwardResult, int]:
        """The engine forward of a trial, and how many leading layers it replayed. Full
        logits (tokens x vocab per sample, and a float64 KL over them) by default only when
        the search judges the KL; otherwise a trial measures the token log-probs alone."""
        full = self.settings.judges_kl if full_logits is None else full_logits
        if not self.prefix_reuse or self.engine is None or self.prefix.disabled:
            return self.engine_forward(swapped, full_logits=full), 0
        source, upto = self.prefix.plan(self.engine, swapped, self._prefix_key())
        return self.engine_forward(swapped, prefix=(source, upto), full_logits=full), upto

    def trial(self, swapped) -> tuple[float, dict]:
        """One engine forward with `swapped` units replaced: (judged value, summary)."""
        if self.engine is not None and not self.engine_runs:  # (the rollout's own log-probs are one fixed trial)
            raise InputError(f"--engine {self.engine_kind}:DIR can be compared, not searched: a {self.engine_kind} cannot run swap trials")
        ref = self.reference_tokens()
        t0 = time.perf_counter()
        res, replayed = self._trial_forward(swapped)
        tokens = C.token_report(self.samples, ref, res, self.settings, self.groups, detail=False)
        summary = {
            "groups": {g: {"k3_mean": v["k3"]["mean"], "k3_p99": v["k3"]["p99"], "kl_mean": (v["kl"] or {}).get("mean")} for g, v in tokens["groups"].items()},
            "seq_frac_rejected": tokens["rl_cost"]["seq_frac_rejected"],
            "forward_s": round(time.perf_counter() - t0, 4),
        }
        if self.prefix_reuse and self.engine is not None:
            summary["prefix_layers"] = replayed  # leading layers replayed from an earlier trial
        return tokens["value"], summary

    def self_check(self, tol: float = 1e-7) -> dict:
        """Swap every unit: the engine must then reproduce the reference.

        Two trials cover every adapter the search uses: the finest units (MoE sub-units,
        norms, attention, dense MLPs, embed, lm_head), then whole MoE blocks. Planted
        faults stay out of the first (one on a block's own output is outside every
        sub-unit); the second swaps every top-level unit, which removes any fault.
        """
        if self.engine is None or not self.engine_runs:
            raise InputError(f"swaps need an engine that runs (hf: or vllm:), not {self.engine_kind}")
        fine = ("embed", "norm", "attn", "mlp", "router", "experts", "shared_expert", "lm_head", "projector")
        fine += ("shared_expert_gate",)
        coarse = ("embed", "norm", "attn", "mlp", "moe", "lm_head", "vision")
        same_dtype = self.spec.ref_dtype == self.spec.engine_dtype
        checks = []
        # Decode mode: the adapters are proven in prefill (attention cannot be swapped in
        # decode, so decode cannot reproduce the reference); then every unit that can be
        # swapped in decode is, and its value is recorded without a verdict.
        mode, self.mode = self.mode, "prefill"
        try:
            self._self_check_runs(fine, coarse, same_dtype, tol, checks)
        finally:
            self.mode = mode
        if mode == "decode":
            names = D.decode_candidates([u.name for u in self.engine.units if u.kind in fine], self.engine, mode)
            planted, self.faults = self.faults, []
            try:
                _, summary = self.trial(names)
            finally:
                self.faults = planted
            checks.append({"swapped": "sub-units, decode mode (attention left to the engine)", "mode": "decode",
                           "kinds": sorted({self.engine.unit(n).kind for n in names}),
                           "k3_mean": summary["groups"]["completion"]["k3_mean"], "passed": True, "judged": False})
        judged = [c for c in checks if c.get("judged", True)]
        worst = max(c["k3_mean"] or 0.0 for c in judged)
        return {
            "k3_mean": worst,
            "tolerance": tol,
            "dtypes_match": same_dtype,
            "passed": all(c["passed"] for c in checks),
            "checks": checks,
            "swapped": [c["swapped"] for c in checks if not c["passed"]] or [c["swapped"] for c in judged],
        }

    def _self_check_runs(self, fine, coarse, same_dtype, tol, checks) -> None:
        for label, kinds in (("sub-units", fine), ("blocks", coarse)):
            names = [u.name for u in self.engine.units if u.kind in kinds]
            if label == "blocks" and not any(u.kind in ("moe", "vision") for u in self.engine.units):
                continue
            planted, self.faults = self.faults, ([] if label == "sub-units" else self.faults)
            try:
                _, summary = self.trial(names)
            finally:
                self.faults = planted
            k3 = summary["groups"]["completion"]["k3_mean"]
            checks.append({"swapped": label, "kinds": sorted({self.engine.unit(n).kind for n in names}), "k3_mean": k3,
                           "passed": (k3 is not None and k3 <= tol) if same_dtype else True})

    def close(self) -> None:
        """Close the backends this session opened (not the ones it was given)."""
        for b in self._owned:
            try:
                b.close()
            except BackendError:
                pass
        self._owned = []

    def inputs(self) -> dict:
        """What went in, with digests: enough to tell whether two reports are comparable."""
        eng = (
            {**self.engine.describe(), "sha256": self.digests["engine"], "mode": self.mode}
            if self.engine is not None
            else {"backend": self.engine_kind, "path": self.trace.path, "dtype": None}
        )
        return {
            "ref": {**self.ref.describe(), "sha256": self.digests["ref"]},
            "engine": eng,
            "trace": {
                "path": self.trace.path,
                "sha256": self.trace.sha256,
                "samples": len(self.samples),
                "completion_tokens": sum(len(s.completion_ids) for s in self.samples),
                "groups": self.groups,
                "group_origin": self.group_origin,  # name -> trace, config image_token_id N, --group-def
                "format": self.trace.format,
            },
            "faults": [f.to_dict() for f in self.faults],
            **({"checkpoint_diff": self.checkpoint_diff} if self.checkpoint_diff is not None else {}),
        }


class _Opening:
    """`Session.open`'s steps over the directories a `Spec` names, in order: `read_request`
    (the trace and the options, before anything is read from a checkpoint), `check_inputs`
    (both configs against each other and the trace), `open_backends` (the slow loads),
    `digests` (what identifies the inputs)."""

    def __init__(self, spec: Spec, settings: C.Settings, say):
        self.spec, self.settings, self.say = spec, settings, say
        self.checkpoint_diff: dict | None = None  # numbisect.model.ckptdiff, when the two checkpoints are two directories

    def read_request(self) -> None:
        """The trace and what the options ask for, checked before anything is read from a
        checkpoint: the reference's path, the engine's kind and path."""
        spec = self.spec
        self.trace: Trace = load_any(spec.trace, spec.trace_format, spec.trace_fields)
        ref_kind, self.ref_path = C.parse_spec(spec.ref, "--ref")
        require_reference(ref_kind, spec.ref)
        self.ref_kind = ref_kind  # the kind accepted: the reference opens as that
        eng_kind, self.eng_path = C.parse_spec(spec.engine, "--engine")
        self.eng_kind = eng_kind
        self.user_engine = None  # --engine-config: the user's engine, as they run it (numbisect.session.userengine)
        if spec.engine_config is not None:
            self.user_engine = UserEngine.check(spec, eng_kind)
            spec.engine_opts = self.user_engine.backend_opts()
        C.check_opts(ref_kind, spec.ref_opts, "--ref-opt")
        C.check_opts(eng_kind, spec.engine_opts, "--engine-opt")
        faults = [parse_fault(f) for f in spec.faults]
        D.check_mode(eng_kind, spec.engine_mode)
        D.check_tp(spec.engine_mode, spec.engine_opts)
        D.check_trace(self.trace, spec.engine_mode)
        if faults and not BACKENDS[eng_kind].runs:
            raise InputError(f"--engine-fault needs an engine that runs (hf: or vllm:), not {eng_kind}")

    def check_inputs(self, backends: dict):
        """Both configs against each other and the trace (vocabulary, positions, images,
        groups), the checkpoint diff; a dump engine (and a layer-streamed reference) opened
        here, as they are read, not run. Returns (engine config, backends, the dump)."""
        spec, settings, eng_kind, eng_path = self.spec, self.settings, self.eng_kind, self.eng_path
        ref_cfg = load_config(self.ref_path)
        ref_arch = arch_for(ref_cfg)
        check_replay(spec.replay_routing, ref_cfg, eng_kind, spec.engine_opts)
        if spec.replay_routing and spec.engine_mode == "decode":
            raise InputError("--replay-routing works in prefill mode only (--engine-mode decode records no expert ids yet)")
        check_vocab(self.trace, ref_cfg.get_text_config().vocab_size)
        C.check_positions(self.trace, ref_cfg, "the reference")
        G.check_images(self.trace, ref_cfg, ref_arch)
        if not BACKENDS[eng_kind].takes_images and any(s.images is not None for s in self.trace.samples):
            raise InputError(f"the trace has images: compare them against an hf engine (--engine hf:DIR); the {eng_kind} backend takes tokens only")
        self.group_origin = G.add_groups(self.trace, ref_cfg, G.parse_group_defs(spec.group_defs))
        if settings.group not in C.group_names(self.trace) + ["all"]:
            hint = " (define one with --group-def NAME=ID[,ID])" if settings.group not in BUILTIN_GROUPS else ""
            raise InputError(f"unknown group {settings.group!r}; this trace has: {', '.join(C.group_names(self.trace))}{hint}")
        dump = eng_cfg = None
        if source(eng_kind) == "dump":
            dump = backends.get("engine") or open_backend(eng_kind, eng_path, spec.engine_dtype, spec.engine_opts, trace=self.trace)
            C.check_configs(ref_cfg, dump.config)
            backends = {**backends, "engine": dump}
        elif source(eng_kind) == "checkpoint":
            eng_cfg = load_config(eng_path)
            if not getattr(arch_for(eng_cfg), BACKENDS[eng_kind].unit_map):
                raise InputError(f"{arch_for(eng_cfg).name} {BACKENDS[eng_kind].no_unit_map}: use --engine hf:DIR")
            C.check_configs(ref_cfg, eng_cfg)
            C.check_positions(self.trace, eng_cfg, "the engine")
            self.checkpoint_diff = self._checkpoint_diff(ref_cfg)
        if spec.ref_opts.get("layer_stream") and "ref" not in backends:
            if source(eng_kind) != "dump":
                raise InputError("--ref-opt layer_stream=true needs --engine dump:DIR (the layers' inputs come from the dump)")
            backends = {**backends, "ref": LayerStreamRef(self.ref_path, spec.ref_dtype)}
        return eng_cfg, backends, dump

    def open_backends(self, eng_cfg, backends: dict, dump) -> tuple[Backend, Backend | None, list]:
        """The reference, the user's own engine run (--engine-config) and the engine, opened
        (or taken from `backends`): (reference, engine, the backends opened here)."""
        spec, eng_kind, eng_path = self.spec, self.eng_kind, self.eng_path
        ref: Backend = backends.get("ref") or self._open(self.ref_kind, self.ref_path, spec.ref_dtype, spec.ref_opts, "loading reference")
        engine: Backend | None = None
        if self.user_engine is not None:  # before the in-process engine: its custom ops follow the user's engine
            text = eng_cfg.get_text_config()
            max_len = spec.engine_opts.get("max_model_len", min(1024, int(getattr(text, "max_position_embeddings", 1024) or 1024)))
            self.user_engine.run(self.trace.samples, eng_path, spec.engine_dtype, int(max_len), int(text.vocab_size),
                                 self.settings.judges_kl, services(eng_kind).run_child, self.say)
            spec.engine_opts = self.user_engine.backend_opts()
        if source(eng_kind) != "trace":  # not the rollout's own log-probs
            engine = backends.get("engine") or self._open(eng_kind, eng_path, spec.engine_dtype, spec.engine_opts, "starting engine")
            C.check_pair(ref, engine)
        return ref, engine, [b for k, b in (("ref", ref), ("engine", engine)) if b is not None and (k not in backends or b is dump)]

    def digests(self) -> dict:
        """What identifies the inputs (a trial log's resume checks them)."""
        spec, eng_kind, eng_path = self.spec, self.eng_kind, self.eng_path
        digests = {"ref": C.checkpoint_digest(self.ref_path), "trace": self.trace.sha256,
                   "samples": samples_digest(self.trace.samples)}  # what --trace-fields selected, too
        extra = G.inputs_digest(self.trace, spec.group_defs)  # pixel inputs and --group-def live outside the file
        if extra:
            digests["trace_extra"] = extra
        if source(eng_kind) == "dump":
            digests["engine"] = C.dump_digest(eng_path)
        elif source(eng_kind) == "checkpoint":
            digests["engine"] = C.checkpoint_digest(eng_path)
        return digests

    def _checkpoint_diff(self, ref_cfg) -> dict | None:
        """What differs between the two checkpoints (weights per unit, numeric config), read
        before any forward; None when both sides load the same directory."""
        ref_path, eng_path = self.ref_path, self.eng_path
        if Path(ref_path).resolve() == Path(eng_path).resolve():
            return None
        self.say("checkpoints: the engine's weights and config against the reference's")
        diff = diff_checkpoints(ref_path, eng_path, check_checkpoint(ref_path), check_checkpoint(eng_path), ref_cfg)
        for n in diff.get("index", []):  # the diff read what the loader reads; a disagreeing copy is not read
            self.say(f"checkpoints: the {n['checkpoint']} index and its files disagree: {n['note']}")
        return diff

    def _open(self, kind, path, dtype, opts, what) -> Backend:
        self.say(f"{what} {kind}:{path} ({dtype})")
        return open_backend(kind, path, dtype, dict(opts), "--ref-opt" if what == "loading reference" else "--engine-opt")

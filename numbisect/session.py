"""A debugging session: one trace, one reference, one engine, and the trials run on them.

The reference runs once (captures kept); the engine runs once per trial. `compare()`
gives the baseline report body; `trial(swapped)` is the evaluator the search calls.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from numbisect import compare as C
from numbisect.arch import arch_for
from numbisect.backends.base import Backend, ForwardResult, load_config
from numbisect.errors import BackendError, InputError
from numbisect.faults import apply_faults, check_fault, parse_fault
from numbisect.swap import apply_swaps, unpatch
from numbisect.trace import BUILTIN_GROUPS, Trace, check_vocab


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
    capture: str = "stats"  # stats: streaming per-unit statistics; full: also every tensor to capture_dir; memory: all kept in RAM
    capture_dir: str | None = None  # full mode: safetensors go here
    max_capture_mb: float | None = None  # full mode: RAM buffered before spilling a unit to disk


class Session:
    def __init__(self, spec: Spec, settings: C.Settings, progress=None, backends: dict | None = None):
        """`backends` may hold already-open "ref" / "engine" backends (tests share engines)."""
        self.spec = spec
        self.settings = settings
        self.say = progress or (lambda msg: None)
        backends = backends or {}
        import torch

        torch.manual_seed(0)  # recorded as environment.seeds; nothing here samples, but hooks may
        from numbisect import groups as G
        from numbisect.rlformats import load_any

        self.trace: Trace = load_any(spec.trace, spec.trace_format, spec.trace_fields)
        ref_kind, ref_path = C.parse_spec(spec.ref, "--ref")
        if ref_kind != "hf":
            raise InputError(f"--ref must be hf:DIR (got {spec.ref!r})")
        eng_kind, eng_path = C.parse_spec(spec.engine, "--engine")
        self.engine_kind = eng_kind
        self.faults = [parse_fault(f) for f in spec.faults]
        if self.faults and eng_kind in ("rollout", "dump"):
            raise InputError(f"--engine-fault needs an engine that runs (hf: or vllm:), not {eng_kind}")
        # Cheap checks first: configs, architectures, vocabulary, groups; then the slow loads.
        ref_cfg = load_config(ref_path)
        ref_arch = arch_for(ref_cfg)
        check_vocab(self.trace, ref_cfg.get_text_config().vocab_size)
        G.check_images(self.trace, ref_cfg, ref_arch)
        if eng_kind == "vllm" and any(s.images is not None for s in self.trace.samples):
            raise InputError("the trace has images: compare them against an hf engine (--engine hf:DIR); the vllm backend takes tokens only")
        self.group_origin = G.add_groups(self.trace, ref_cfg, G.parse_group_defs(spec.group_defs))
        if settings.group not in C.group_names(self.trace) + ["all"]:
            hint = " (define one with --group-def NAME=ID[,ID])" if settings.group not in BUILTIN_GROUPS else ""
            raise InputError(f"unknown group {settings.group!r}; this trace has: {', '.join(C.group_names(self.trace))}{hint}")
        dump = None
        if eng_kind == "dump":
            from numbisect.backends.dump import DumpBackend

            dump = backends.get("engine") or DumpBackend(eng_path, self.trace)
            C.check_configs(ref_cfg, dump.config)
            backends = {**backends, "engine": dump}
        elif eng_kind != "rollout":
            eng_cfg = load_config(eng_path)
            if eng_kind == "vllm" and not arch_for(eng_cfg).vllm:
                raise InputError(f"{arch_for(eng_cfg).name} has no vLLM unit map (vLLM-CPU cannot run it here): use --engine hf:DIR")
            C.check_configs(ref_cfg, eng_cfg)
        if spec.ref_opts.get("layer_stream") and "ref" not in backends:
            from numbisect.layerstream import LayerStreamRef

            if eng_kind != "dump":
                raise InputError("--ref-opt layer_stream=true needs --engine dump:DIR (the layers' inputs come from the dump)")
            backends = {**backends, "ref": LayerStreamRef(ref_path, spec.ref_dtype)}
        self.ref: Backend = backends.get("ref") or self._open("hf", ref_path, spec.ref_dtype, spec.ref_opts, "loading reference")
        self.engine: Backend | None = None
        if eng_kind != "rollout":
            self.engine = backends.get("engine") or self._open(
                eng_kind, eng_path, spec.engine_dtype, spec.engine_opts, "starting engine"
            )
            C.check_pair(self.ref, self.engine)
            for f in self.faults:
                check_fault(self.engine, f)
        self._owned = [b for k, b in (("ref", self.ref), ("engine", self.engine)) if b is not None and (k not in backends or b is dump)]
        self.samples = self.trace.samples
        self.groups = C.group_names(self.trace) + (["all"] if settings.group == "all" else [])
        self._ref_result: ForwardResult | None = None
        self._ref_tokens: ForwardResult | None = None  # the reference's log-probs from a streamed compare
        self.digests = {"ref": C.checkpoint_digest(ref_path), "trace": self.trace.sha256}
        extra = G.inputs_digest(self.trace, spec.group_defs)  # pixel inputs and --group-def live outside the file
        if extra:
            self.digests["trace_extra"] = extra
        if eng_kind == "dump":
            self.digests["engine"] = C.dump_digest(eng_path)
        elif eng_kind != "rollout":
            self.digests["engine"] = C.checkpoint_digest(eng_path)

    def _open(self, kind, path, dtype, opts, what) -> Backend:
        self.say(f"{what} {kind}:{path} ({dtype})")
        return C.open_backend(kind, path, dtype, dict(opts))

    # -- the reference ------------------------------------------------------------------
    def reference(self) -> ForwardResult:
        if self._ref_result is None:
            self.say("running the reference")
            names = C.capture_names(self.ref)
            self._ref_result = self.ref.forward(
                self.samples, full_logits=True, capture=names, capture_inputs=C.local_feed_names(self.ref)
            )
        return self._ref_result

    # -- the engine -----------------------------------------------------------------------
    def engine_forward(self, swapped=(), capture=(), feed=None) -> ForwardResult:
        """The engine with its planted faults, then `swapped` units replaced by the reference's."""
        if self.engine is None:
            return C.rollout_result(self.trace)
        planted = apply_faults(self.engine, self.faults)
        try:
            apply_swaps(self.engine, self.ref, list(swapped))
            return self.engine.forward(self.samples, full_logits=True, capture=list(capture), feed=feed)
        finally:
            unpatch(self.engine)
            self.engine.restore()
            planted.undo()

    def compare(self, local: bool = True) -> dict:
        """Token metrics, RL cost and per-unit divergence of the unswapped engine."""
        if getattr(self.ref, "kind", None) == "hf-layers":
            from numbisect.layerstream import stream_compare_layers

            return stream_compare_layers(self, local)
        if self.spec.capture != "memory":  # stats / full: streamed sample by sample (numbisect.capture)
            from numbisect.capture import stream_compare

            return stream_compare(self, local)
        ref = self.reference()
        self.say("running the engine")
        units = self.engine.units if self.engine else []
        prop = self.engine_forward(capture=[u.name for u in units])
        tokens = C.token_report(self.samples, ref, prop, self.settings, self.groups)
        loc = None
        if local and self.engine is not None:
            self.say("teacher-forced pass (local error)")
            feed = {n: ref.inputs[n] for n in C.local_feed_names(self.engine) if ref.inputs.get(n)}
            loc = self.engine_forward(capture=[u.name for u in units], feed=feed)
        rows = C.unit_report(units, ref, prop if self.engine else None, loc, self.engine.dtype if self.engine else None, self.settings)
        body = {
            "baseline": tokens,
            "units": rows,
            "first_divergence": C.first_divergence(rows, self.settings),
            "verdict": "aligned" if tokens["value"] <= self.settings.threshold else "diverged",
        }
        if loc is not None:
            body["local_ranking"] = C.local_ranking(rows)
        return body

    def trial(self, swapped) -> tuple[float, dict]:
        """One engine forward with `swapped` units replaced: (judged value, summary)."""
        if self.engine_kind == "dump":
            raise InputError("--engine dump:DIR can be compared, not searched: a dump cannot run swap trials")
        ref = self._ref_tokens or self.reference()
        t0 = time.perf_counter()
        res = self.engine_forward(swapped)
        tokens = C.token_report(self.samples, ref, res, self.settings, self.groups)
        summary = {
            "groups": {g: {"k3_mean": v["k3"]["mean"], "k3_p99": v["k3"]["p99"], "kl_mean": (v["kl"] or {}).get("mean")} for g, v in tokens["groups"].items()},
            "seq_frac_rejected": tokens["rl_cost"]["seq_frac_rejected"],
            "forward_s": round(time.perf_counter() - t0, 4),
        }
        return tokens["value"], summary

    def self_check(self, tol: float = 1e-7) -> dict:
        """Swap every unit: the engine must then reproduce the reference.

        Two trials cover every adapter the search uses: the finest units (MoE sub-units,
        norms, attention, dense MLPs, embed, lm_head), then whole MoE blocks. Planted
        faults stay out of the first (one on a block's own output is outside every
        sub-unit); the second swaps every top-level unit, which removes any fault.
        """
        if self.engine is None or self.engine_kind == "dump":
            raise InputError(f"swaps need an engine that runs (hf: or vllm:), not {self.engine_kind}")
        fine = ("embed", "norm", "attn", "mlp", "router", "experts", "shared_expert", "lm_head", "projector")
        coarse = ("embed", "norm", "attn", "mlp", "moe", "lm_head", "vision")
        same_dtype = self.spec.ref_dtype == self.spec.engine_dtype
        checks = []
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
        worst = max(c["k3_mean"] or 0.0 for c in checks)
        return {
            "k3_mean": worst,
            "tolerance": tol,
            "dtypes_match": same_dtype,
            "passed": all(c["passed"] for c in checks),
            "checks": checks,
            "swapped": [c["swapped"] for c in checks if not c["passed"]] or [c["swapped"] for c in checks],
        }

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
            {**self.engine.describe(), "sha256": self.digests["engine"]}
            if self.engine is not None
            else {"backend": "rollout", "path": self.trace.path, "dtype": None}
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
        }

"""The comparison pipeline: a trace through the reference and the engine, in one of three modes.

Its place in the layers: under `numbisect.session.session` (a Session holds the backends and
the trace, and calls in here), over the backends, `measure` (the metrics), `capture`
(streaming statistics, spill store), `layerstream` (a reference one layer at a time)
and `numbisect.patching.arrangement` (the engine's faults, swaps and probe for one forward). Nothing
here takes or calls a Session: every input is in `Sides`.

1. `Sides`: what a comparison runs on (both backends, the trace, settings, groups,
   the engine's planted faults and mode, a progress callback). `engine_forward` is the
   one engine forward of a session: faults, swaps, routing probe and prefix reuse set
   up around it and undone after, on a local or a tensor-parallel engine.
2. The modes, each returning one `Comparison`:
   - `streamed`: sample by sample, every unit folded into streaming statistics
     (`--capture stats`), in `full` also written to safetensors;
   - `whole_run`: both sides over the whole trace, every tensor kept (`--capture
     memory`, decode mode, the routing replay);
   - `layer_streamed`: a layer-streamed reference against a dump.
   `compare` picks the mode the inputs ask for.
3. `report_body(comparison)` is the report's body; it is built here and nowhere else.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

from numbisect.backends.base import Backend, ForwardResult
from numbisect.common.errors import InputError
from numbisect.model.trace import Trace
from numbisect.patching.arrangement import arranged
from numbisect.pipeline import capture as K
from numbisect.pipeline import decode as D
from numbisect.pipeline import measure as C
from numbisect.pipeline import recurrent as RS
from numbisect.pipeline import routing as R
from numbisect.pipeline import selection as SEL
from numbisect.pipeline.contract import ContractFit
from numbisect.report.findings import tokens_verdict


def _quiet(msg: str) -> None:
    pass


@dataclass
class Sides:
    """What a comparison runs on. `ref_result` / `ref_routing`: the whole-run reference
    (every unit's input and output) and its expert ids, when one was made already; they
    and the methods below are also what `routing.replay_whatif` reads of its first
    argument."""

    ref: Backend
    engine: Backend | None  # None: the trace's own rollout log-probs
    trace: Trace
    samples: list  # the samples compared (the trace's, or the first of them)
    settings: C.Settings
    groups: list[str]
    faults: list = field(default_factory=list)  # planted in the engine for every forward
    mode: str = "prefill"  # the engine's mode: prefill or decode
    say: Callable[[str], None] = _quiet  # progress, one line at a time
    ref_result: ForwardResult | None = None
    ref_routing: dict | None = None

    def reference(self) -> ForwardResult:
        """The whole-run reference: made once, then kept in `ref_result`."""
        if self.ref_result is None:
            self.ref_result, self.ref_routing = reference_run(self)
        return self.ref_result

    def routing_probe(self, backend, replay=None):
        """A recorder (and replayer) of expert ids for `backend`; None on a dense model."""
        spec = R.router_spec(backend.config)
        return None if spec is None else R.RoutingProbe(backend, spec, self.samples, replay)

    def engine_forward(self, swapped=(), capture=(), feed=None, mode=None, probe=None, *, prefix=None, cache=None,
                       full_logits=True) -> ForwardResult:
        """The engine with its planted faults, then `swapped` units replaced by the reference's,
        run in `mode` (default: `self.mode`), and, with `probe`, its expert ids recorded or
        replayed. `prefix=(recording, L)` with `cache` (a `prefix.PrefixCache`): layers
        0..L-1 replay the recording, the others are recorded (`numbisect.patching.prefix`)."""
        eng = self.engine
        if eng is None:
            return C.rollout_result(self.trace)
        remote = getattr(eng, "remote", False)  # tensor parallel: faults and swaps go into the workers
        mode = mode or self.mode
        if not remote:
            D.check_swappable(eng, list(swapped), mode)
        with arranged(eng, self.ref, self.faults, swapped, probe), _prefix_reuse(eng, cache, swapped, prefix):
            # a tensor-parallel engine takes the mode too: it refuses decode rather than run a prefill in its place
            return eng.forward(self.samples, full_logits=full_logits, capture=list(capture), feed=feed, mode=mode)


@contextlib.contextmanager
def _prefix_reuse(engine, cache, swapped, prefix):
    """Prefix reuse around one forward: in this process (`PrefixCache.run`), or in a
    tensor-parallel engine's workers, this side keeping the cache's bookkeeping."""
    if not prefix:
        yield
        return
    source, upto = prefix
    if not getattr(engine, "remote", False):
        with cache.run(engine, swapped, source, upto):
            yield
        return
    engine.prefix_begin(swapped, source, upto, clear=cache.cleared)
    cache.cleared = False
    ok = False
    try:
        yield
        ok = True
    finally:
        engine.prefix_end(failed=not ok)
    cache.note(swapped, source)


def reference_run(sides: Sides) -> tuple[ForwardResult, dict | None]:
    """The reference over the whole trace, every unit's output and hidden-state input
    kept, and its expert ids (None on a dense model)."""
    sides.say("running the reference")
    probe = sides.routing_probe(sides.ref)
    undo = probe.install() if probe else None
    try:
        res = sides.ref.forward(sides.samples, full_logits=True, capture=C.capture_names(sides.ref),
                                capture_inputs=C.local_feed_names(sides.ref))
    finally:
        if undo:
            undo()
    return res, (probe.ids if probe else None)


# -- the result ---------------------------------------------------------------------------------
@dataclass
class CaptureInfo:
    """What a comparison kept of the activations (the report's `capture`)."""

    mode: str  # stats or full
    dir: str | None = None  # full: where the safetensors went
    max_mb: float | None = None  # full: RAM buffered before spilling
    peak_buffered_mb: float | None = None  # full: the most it buffered
    peak_weights_mb: float | None = None  # layer-stream: the most weights materialised at once

    def to_dict(self) -> dict:
        out: dict = {"mode": self.mode}
        if self.dir is not None:
            out.update(dir=self.dir, max_mb=self.max_mb, peak_buffered_mb=self.peak_buffered_mb)
        if self.peak_weights_mb is not None:
            out.update(layer_stream=True, peak_weights_mb=self.peak_weights_mb)
        return out


@dataclass
class Comparison:
    """One comparison of the unswapped engine with the reference."""

    tokens: dict  # token metrics, RL cost, worst tokens (measure.token_report): the report's `baseline`
    units: list[dict]  # per unit: propagated and local error
    first_divergence: dict  # the first unit not bitwise equal, the first above the unit tolerance (1e-2)
    verdict: str  # aligned or diverged
    ref_tokens: ForwardResult  # the reference's log-probs, which the trials and what-ifs reuse
    local_ranking: dict | None = None  # unit -> rank by own (teacher-forced) error; None without a local pass
    capture: CaptureInfo | None = None  # streamed modes
    engine_modes: dict | None = None  # decode mode: decode against prefill inside the engine
    routing: dict | None = None  # MoE: expert agreement per layer
    routing_replay: dict | None = None  # --replay-routing
    ref_result: ForwardResult | None = None  # whole run: the reference with every capture
    ref_routing: dict | None = None  # MoE: router unit -> per-sample expert ids of the reference
    logprob_contract: dict | None = None  # rollout engine: raw, processed (fitted sampler) or logits
    indexer_selection: dict | None = None  # sparse attention (GLM-5): the indexers' key selection agreement
    recurrent_state: dict | None = None  # linear attention (Qwen3.5, Qwen3-Next): the recurrent state's error
    engine_tokens: ForwardResult | None = None  # the engine's own token log-probs (an engine that ran)


def _comparison(sides: Sides, tokens: dict, rows: list[dict], ref_tokens: ForwardResult, ranked: bool,
                layers: bool = False, **rest) -> Comparison:
    """The judged parts of a comparison, the same in every mode."""
    return Comparison(
        tokens=tokens,
        units=rows,
        first_divergence=C.first_divergence(rows, sides.settings),
        verdict=tokens_verdict(tokens["value"], sides.settings.threshold),
        ref_tokens=ref_tokens,
        local_ranking=C.local_ranking(rows, layers=layers) if ranked else None,
        **rest,
    )


def report_body(c: Comparison) -> dict:
    """The report's body for a comparison (`bisect compare`; `bisect run` adds its sections)."""
    body = {"baseline": c.tokens, "units": c.units, "first_divergence": c.first_divergence, "verdict": c.verdict}
    if c.local_ranking is not None:
        body["local_ranking"] = c.local_ranking
    if c.capture is not None:
        body["capture"] = c.capture.to_dict()
    if c.engine_modes is not None:
        body["engine_modes"] = c.engine_modes
    if c.routing is not None:
        body["routing"] = c.routing
    if c.routing_replay is not None:
        body["routing_replay"] = c.routing_replay
    if c.logprob_contract is not None:
        body["logprob_contract"] = c.logprob_contract
    if c.indexer_selection is not None:
        body["indexer_selection"] = c.indexer_selection
    if c.recurrent_state is not None:
        body["recurrent_state"] = c.recurrent_state
    return body


def _stat_rows(units, prop: dict, loc: dict) -> list[dict]:
    """Per-unit rows from streaming statistics (a unit no sample reached: None)."""
    rows = []
    for u in units:
        p, lo = prop.get(u.name), loc.get(u.name)
        rows.append({"name": u.name, "kind": u.kind, "layer": u.layer, "parent": u.parent,
                     "propagated": p.result() if p is not None and p.n else None,
                     "local": lo.result() if lo is not None and lo.n else None})
    return rows


# -- the modes ------------------------------------------------------------------------------------
@dataclass
class Capture:
    """What a streamed comparison keeps (`--capture`, `--capture-dir`, `--max-capture-mb`)."""

    mode: str = "stats"  # stats, full (memory is `whole_run`)
    dir: str | None = None
    max_mb: float | None = None


def compare(sides: Sides, local: bool = True, capture: Capture | None = None, replay: str | None = None) -> Comparison:
    """The comparison the inputs ask for: layer-streamed against a dump when the
    reference streams its layers; streamed (stats / full) in prefill mode; else the
    whole run (memory capture, decode mode, the routing replay)."""
    capture = capture or Capture()
    if getattr(sides.ref, "kind", None) == "hf-layers":
        return layer_streamed(sides, local)
    if capture.mode != "memory" and sides.mode == "prefill" and not replay:
        return streamed(sides, local, capture)
    return whole_run(sides, local, replay)


def streamed(sides: Sides, local: bool = True, capture: Capture | None = None) -> Comparison:
    """Sample by sample: the reference (captures and inputs), the engine on its own
    inputs (propagated) and teacher-forced (local), folded into `capture.UnitStats`; in
    `full` mode every tensor also goes to a `capture.SpillStore`. For a dump engine the
    local pass feeds the *reference* the dumped inputs and compares its outputs with the
    dumped outputs. Under tensor parallelism each sample's captures are gathered from
    the workers, and its inputs fed into them. Then, on a MoE model, the routing of both
    sides (`_routing_light`)."""
    capture = capture or Capture()
    ref, eng = sides.ref, sides.engine
    mode = capture.mode or "stats"
    if mode not in K.MODES:
        raise InputError(f"unknown capture mode {mode!r}; choose stats or full")
    units = eng.units if eng is not None else []
    names = [u.name for u in units]
    streamed_local = local  # under TP too: the inputs go into the workers (backends/vllm/tp.py)
    remote = eng is not None and getattr(eng, "remote", False)  # no local pass of the state or selection there yet
    feed_names = C.local_feed_names(ref) if eng is not None and streamed_local else []
    store = None
    if mode == "full":
        if not capture.dir:
            raise InputError("--capture full needs --capture-dir DIR")
        K.check_budget(units or ref.units, sides.samples, ref.config, ref.dtype, capture.max_mb)
        store = K.SpillStore(capture.dir, capture.max_mb)
    dump = eng is not None and eng.recorded
    edtype = eng.dtype if eng is not None else None
    prop = {n: K.UnitStats(edtype) for n in names}
    loc = {n: K.UnitStats(edtype) for n in names}
    # Per sample only the token log-probs and the per-position KL are kept, not the
    # tokens x vocab log-probs; the reference's are kept for the trials of a kl-mean search.
    keep_ref_full = sides.settings.judges_kl
    ref_tok, ref_full, eng_tok, kl = [], [], [], C.PositionKL()
    contract = ContractFit() if eng is None else None  # the rollout's own log-probs: raw or processed?
    state = arranged(eng, ref, sides.faults) if eng is not None and not dump else contextlib.nullcontext()
    sides.say(f"reference and engine, sample by sample ({mode} capture)")
    state.__enter__()
    behind = K._Behind()
    try:
        def one(i, s) -> None:
            """One sample: every tensor it makes is gone when this returns."""
            r = ref.forward([s], full_logits=True, capture=names, capture_inputs=feed_names)
            ref_tok.append(r.token_logprobs[0])
            if keep_ref_full:
                ref_full.append(r.full_logprobs[0])
            if eng is None:
                contract.add(s, r.full_logprobs[0])
                return
            if dump:
                d = eng.sample(i, units=names, inputs=feed_names)
                eng_tok.append(d["token_logprobs"])
                e_full = d["full_logprobs"]
                e_out, e_in = d["outputs"], d["inputs"]
            else:
                e = eng.forward([s], full_logits=True, capture=names)
                eng_tok.append(e.token_logprobs[0])
                e_full = e.full_logprobs[0]
                e_out, e_in = {n: v[0] for n, v in e.captures.items() if v}, {}
            kl.add(r.full_logprobs[0], e_full)
            behind.submit(K.fold, prop, {n: (r.captures[n][0], e_out[n]) for n in names if n in e_out and r.captures.get(n)}, i)
            if store is not None:
                for n in names:
                    if r.captures.get(n):
                        store.add("ref", n, i, r.captures[n][0])
                    if r.inputs.get(n):
                        store.add("ref", n, i, r.inputs[n][0], inp=True)
                    if n in e_out:
                        store.add("engine", n, i, e_out[n])
            if not streamed_local:
                return
            if dump:  # the reference fed the engine's dumped inputs
                fed = ref.forward([s], capture=names, feed={n: [x] for n, x in e_in.items()}) if e_in else None
                pairs = {n: (fed.captures[n][0], e_out[n]) for n in names if fed and n in e_in and n in e_out and fed.captures.get(n)}
            else:  # the engine fed the reference's inputs
                fed = eng.forward([s], capture=names, feed={n: [r.inputs[n][0]] for n in feed_names if r.inputs.get(n)})
                pairs = {n: (r.captures[n][0], fed.captures[n][0]) for n in names if fed.captures.get(n) and r.captures.get(n)}
            behind.submit(K.fold, loc, pairs, i)
            if store is not None:
                for n, (a, b) in pairs.items():
                    store.add("local", n, i, b if not dump else a)

        for i, s in enumerate(sides.samples):
            one(i, s)
            K._trim()
        behind.wait()
    finally:
        behind.close()
        state.__exit__(None, None, None)
    if store is not None:
        store.flush()
    ref_res = ForwardResult(token_logprobs=ref_tok, full_logprobs=ref_full if keep_ref_full else None)
    eng_res = C.rollout_result(sides.trace) if eng is None else ForwardResult(token_logprobs=eng_tok)
    tokens = C.token_report(sides.samples, ref_res, eng_res, sides.settings, sides.groups,
                            kl=kl.result() if eng is not None else None)
    rows = _stat_rows(units, prop, loc if streamed_local else {})
    info = CaptureInfo(mode)
    if store is not None:
        info = CaptureInfo(mode, dir=str(capture.dir), max_mb=capture.max_mb, peak_buffered_mb=round(store.peak_held / 2**20, 3))
    routing, ref_ids = _routing_light(sides, local)
    return _comparison(sides, tokens, rows, ref_res, ranked=streamed_local and eng is not None, capture=info,
                       routing=routing, ref_routing=ref_ids, indexer_selection=SEL.selection_light(sides, streamed_local and not remote),
                       recurrent_state=RS.state_light(sides, streamed_local and not remote),
                       logprob_contract=contract.result() if contract is not None else None,
                       engine_tokens=eng_res if eng is not None else None)


def _routing_light(sides: Sides, local: bool) -> tuple[dict | None, dict | None]:
    """Routing agreement for a streamed compare, and the reference's expert ids: both
    sides run once more capturing only their routers (tokens x experts each), so no
    hidden-size tensor is kept. (None, None) on a dense model, a dump, the rollout and
    under tensor parallelism."""
    ref, eng = sides.ref, sides.engine
    if eng is None or eng.recorded or eng.remote:
        return None, None
    spec = R.router_spec(ref.config)
    if spec is None:
        return None, None
    units = R.router_units(ref)
    sides.say("routing: routers of both sides")
    probe = sides.routing_probe(ref)
    undo = probe.install()
    try:
        r = ref.forward(sides.samples, capture=units, capture_inputs=units if local else ())
    finally:
        undo()
    passes = {}
    p = sides.routing_probe(eng)
    passes["propagated"] = (p.ids, sides.engine_forward(capture=units, probe=p, full_logits=False).captures)
    if local:
        p = sides.routing_probe(eng)
        feed = {n: r.inputs[n] for n in units if r.inputs.get(n)}
        passes["local"] = (p.ids, sides.engine_forward(capture=units, feed=feed, probe=p, full_logits=False).captures)
    report = R.routing_report(sides.samples, spec, units, probe.ids, r.captures, passes,
                              (R._biases(ref, units), R._biases(eng, units)))
    return report, probe.ids


def whole_run(sides: Sides, local: bool = True, replay: str | None = None) -> Comparison:
    """Both sides over the whole trace, every unit's tensors kept: the reference once
    (`sides.reference()`), the engine propagated and teacher-forced (local); in decode
    mode also the engine in prefill (`engine_modes`); on a MoE model the expert ids of
    each pass (`routing`), and with `replay` the routing replay what-if."""
    ref = sides.reference()
    eng = sides.engine
    sides.say("running the engine")
    units = eng.units if eng else []
    names = [u.name for u in units]
    remote = eng is not None and getattr(eng, "remote", False)
    # Routing probes record per engine call; decode mode calls once per token: prefill only.
    probes = {"propagated": sides.routing_probe(eng) if eng and sides.mode == "prefill" and not remote else None}
    prop = sides.engine_forward(capture=names, probe=probes["propagated"])
    tokens = C.token_report(sides.samples, ref, prop, sides.settings, sides.groups)
    loc = None
    if local and eng is not None:  # under TP the inputs go into the workers (backends/vllm/tp.py)
        sides.say("teacher-forced pass (local error)")
        feed = {n: ref.inputs[n] for n in C.local_feed_names(eng) if ref.inputs.get(n)}
        probes["local"] = sides.routing_probe(eng) if sides.mode == "prefill" and not remote else None
        loc = sides.engine_forward(capture=names, feed=feed, probe=probes["local"])
    rows = C.unit_report(units, ref, prop if eng else None, loc, eng.dtype if eng else None, sides.settings)
    modes = None
    if sides.mode == "decode":
        sides.say("running the engine in prefill mode (decode vs prefill)")
        pre = sides.engine_forward(capture=names, mode="prefill")
        modes = D.with_baseline(D.engine_modes(sides.samples, sides.settings, sides.groups, eng.dtype, ref, prop, pre, units),
                                tokens)
    routing = replayed = None
    if probes["propagated"] is not None:
        results = {"propagated": prop, "local": loc}
        passes = {k: (p.ids, results[k].captures if results[k] is not None else {}) for k, p in probes.items() if p is not None}
        router_units = R.router_units(sides.ref)
        routing = R.routing_report(sides.samples, R.router_spec(sides.ref.config), router_units, sides.ref_routing or {},
                                   ref.captures, passes, (R._biases(sides.ref, router_units), R._biases(eng, router_units)))
        if replay:
            replayed = R.replay_whatif(sides, replay, probes["propagated"].ids, prop, tokens)
    contract = None
    if eng is None:  # the rollout's own log-probs: raw or processed?
        fit = ContractFit()
        for s, full in zip(sides.samples, ref.full_logprobs):
            fit.add(s, full)
        contract = fit.result()
    return _comparison(sides, tokens, rows, ref, ranked=loc is not None, engine_modes=modes, routing=routing,
                       routing_replay=replayed, ref_result=ref, ref_routing=sides.ref_routing, logprob_contract=contract,
                       indexer_selection=SEL.selection_light(sides, local and not remote),
                       recurrent_state=RS.state_light(sides, local and not remote),
                       engine_tokens=prop if eng is not None else None)


def layer_streamed(sides: Sides, local: bool = True) -> Comparison:
    """Against a dump with a layer-streamed reference (`layerstream.LayerStreamRef`):
    token metrics, and per decoder layer the propagated error (the reference's own
    stream) and the local error (the layer fed the dump's input for it against the
    dumped output); the decoder layers are the units ranked."""
    ref, eng = sides.ref, sides.engine
    if eng is None or not eng.recorded:
        raise InputError("--ref-opt layer_stream=true needs --engine dump:DIR (the layers' inputs come from the dump)")
    n = len(sides.samples)
    layer_units = [u for u in eng.units if u.kind == "layer"]
    prop = {u.name: K.UnitStats(eng.dtype) for u in layer_units}
    loc = {u.name: K.UnitStats(eng.dtype) for u in layer_units}

    def on_layer(i, layer, hs):
        name = f"layers.{i}"
        if name not in eng.dumped:
            return
        for s in range(n):
            out = eng.tensor(name, f"out.{s}")
            prop[name].update(hs[s], out, s)
            x = eng.tensor(name, f"in.{s}")
            if local and x is not None:
                loc[name].update(ref.run_layer(layer, x), out, s)

    sides.say("layer-streamed reference")
    tok, full, _ = ref.stream(sides.samples, on_layer=on_layer)
    eng_tok, kl = [], C.PositionKL()
    for i in range(n):  # one sample's dumped logits at a time
        d = eng.sample(i, units=[], inputs=[])
        eng_tok.append(d["token_logprobs"])
        kl.add(full[i], d["full_logprobs"])
        del d
    ref_res = ForwardResult(token_logprobs=tok)
    tokens = C.token_report(sides.samples, ref_res, ForwardResult(token_logprobs=eng_tok), sides.settings, sides.groups,
                            kl=kl.result())
    info = CaptureInfo("stats", peak_weights_mb=round(ref.peak_loaded_bytes / 2**20, 3))
    return _comparison(sides, tokens, _stat_rows(eng.units, prop, loc), ref_res, ranked=local, layers=True, capture=info)

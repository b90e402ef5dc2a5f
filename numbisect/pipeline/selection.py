"""Sparse attention's token selection (GLM-5's DSA indexer): which keys each query attends on
each side, how often the two sides agree, and why they differ where they do.

The indexer unit (kind `indexer`, `layers.{i}.attn.indexer`) picks, for every query, the
`index_topk` earlier keys with the highest index scores; the attention then attends only
those. Compared like MoE routing (numbisect.pipeline.routing), with tokens for experts:

1. `selection_mask(ids, first_row, width)`: the canonical output of an indexer unit, the
   [rows, width] 0/1 mask of the causal keys each query picked (ids outside the causal
   range, or negative as engines pad them, are dropped: a query with fewer keys than
   `index_topk` before it attends all of them whatever ids fill the rest).
2. `SelectionProbe`: installed on a backend for one forward (`Backend.install_selection_probe`;
   transformers: a forward hook on each indexer that recomputes its scores), it records per
   indexer and sample the keys really picked (a mask) and the scores they were picked by.
3. `selection_report`: per indexer layer, the fraction of queries whose key set is
   identical (over the queries that had a choice: more causal keys than index_topk),
   the queries whose selection flipped with the keys only one side picked, the margin
   between the k-th and (k+1)-th score on each side at a flip (a near-tie explains it),
   and exact ties (margin 0: the pick is then the kernel's tie-break, not the model's).
4. `selection_light`: in a comparison, both sides run once more with the probe (the engine
   also teacher-forced: its attention and indexer fed the reference's input), or the
   masks a dump engine recorded (no scores there: margins on the reference side only).
   In decode mode the engine's picks are its indexer units' captures (one row of the
   [T, T] mask per step; no scores either).
5. `replay_whatif`: the engine runs with the reference's picks at every indexer (then at
   each indexer that flipped, alone): how much of the judged metric the different picks
   cause, as `--replay-routing ref` does for experts. A probe given `replay` hands the
   attention those keys (`replay_ids`) instead of its indexer's; queries whose picks
   already agree keep the indexer's own ids, so replaying a side's own picks changes
   nothing. `bisect compare --replay-indexer` (and `run`, after its search) adds it to the
   report as `indexer_replay`; `check_replay` refuses it, before any model loads, where
   it cannot run.
"""

from __future__ import annotations

import math

import torch

from numbisect.backends import BACKENDS
from numbisect.backends.base import load_config
from numbisect.common.errors import InputError
from numbisect.model.arch import arch_for
from numbisect.patching.probes.selection import (  # noqa: F401 (read as selection.*)
    SelectionProbe,
    indexer_units,
    replay_ids,
    selection_mask,
)
from numbisect.pipeline import measure as C
from numbisect.pipeline import metrics as M
from numbisect.pipeline.measure import parse_spec

MAX_FLIPS_LISTED = 50  # flipped queries listed per layer (the count is always complete)


def index_topk(config) -> int | None:
    return getattr(config.get_text_config(), "index_topk", None)


def margins(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[n] per query, its k-th minus (k+1)-th highest causal score (inf when it has at most
    k causal keys: no choice). `scores`: [n, n] with the non-causal keys at -inf."""
    n = scores.shape[0]
    out = torch.full((n,), math.inf, dtype=torch.float64)
    if n > k:
        top = scores[k:].double().topk(k + 1, dim=-1).values
        out[k:] = top[:, k - 1] - top[:, k]
    return out


# -- the report ---------------------------------------------------------------------------------
def _p50(x: torch.Tensor) -> float | None:
    x = x[torch.isfinite(x)]
    return M.aggregate(x)["p50"] if x.numel() else None


def layer_selection(samples, k: int, ref_masks, eng_masks, ref_scores=None, eng_scores=None) -> dict:
    """Agreement of one indexer over every query of every sample (prompt and completion)."""
    where, differ, choice, gained, lost = [], [], [], [], []
    for s, (rm, em) in enumerate(zip(ref_masks, eng_masks)):
        n = rm.shape[0]
        d = (rm != em).any(dim=1)
        for t in range(n):
            where.append((s, t))
            choice.append(t + 1 > k)
            differ.append(bool(d[t]))
            if d[t]:
                gained.append(sorted(int(x) for x in ((em[t] > 0) & (rm[t] == 0)).nonzero().flatten()))
                lost.append(sorted(int(x) for x in ((rm[t] > 0) & (em[t] == 0)).nonzero().flatten()))
            else:
                gained.append(None)
                lost.append(None)
    n_choice = sum(choice)
    flipped = [i for i, d in enumerate(differ) if d]
    completion = [i for i, (s, t) in enumerate(where) if t >= len(samples[s].prompt_ids) and choice[i]]
    out: dict = {
        "queries": len(where),
        "queries_with_choice": n_choice,
        "agree_frac": (sum(1 for i, c in enumerate(choice) if c and not differ[i]) / n_choice) if n_choice else None,
        "flipped": len(flipped),
        "keys_differing": sum(len(gained[i]) for i in flipped),
        "completion_queries_with_choice": len(completion),
        "completion_agree_frac": (sum(1 for i in completion if not differ[i]) / len(completion)) if completion else None,
    }
    have_ref, have_eng = bool(ref_scores), bool(eng_scores)
    rm_all = torch.cat([margins(x, k) for x in ref_scores]) if have_ref else None
    em_all = torch.cat([margins(x, k) for x in eng_scores]) if have_eng else None
    if have_ref:
        out["margin_p50_all"] = _p50(rm_all)
        out["margin_p50_flipped"] = _p50(rm_all[flipped]) if flipped else None
        out["ties_ref"] = int((rm_all == 0).sum())
    if have_eng:
        out["ties_engine"] = int((em_all == 0).sum())
    if have_ref and have_eng:
        rs, es = torch.cat([x.flatten() for x in ref_scores]), torch.cat([x.flatten() for x in eng_scores])
        fin = torch.isfinite(rs) & torch.isfinite(es)
        err = M.activation_error(rs[fin], es[fin])
        out["score_error"] = {key: err[key] for key in ("rel_l2", "max_abs", "mean_abs", "cosine")}
    if have_ref or have_eng:
        tied = [i for i in flipped if (have_ref and rm_all[i] == 0) or (have_eng and em_all[i] == 0)]
        out["flips_at_ties"] = len(tied)
    flips = []
    for i in flipped[:MAX_FLIPS_LISTED]:
        s, t = where[i]
        row = {
            "sample": s,
            "position": t,
            "token_id": int(samples[s].ids[t]),
            "completion": t >= len(samples[s].prompt_ids),
            "keys_ref_only": lost[i],
            "keys_engine_only": gained[i],
            "ref_margin": _finite(rm_all[i]) if have_ref else None,
            "engine_margin": _finite(em_all[i]) if have_eng else None,
        }
        flips.append(row)
    out["flips"] = flips
    return out


def _finite(x: torch.Tensor) -> float | None:
    v = float(x)
    return v if math.isfinite(v) else None


def selection_report(samples, k: int, units: list[str], ref_masks: dict, ref_scores: dict, sides: dict) -> dict:
    """Per indexer layer and per engine pass (`sides`: name -> (engine masks, engine scores))."""
    layers = []
    for u in units:
        row = {"unit": u, "layer": int(u.split(".")[1])}
        for side, (masks, scores) in sides.items():
            if masks.get(u) and ref_masks.get(u):
                row[side] = layer_selection(samples, k, ref_masks[u], masks[u], ref_scores.get(u), scores.get(u))
            else:
                row[side] = None
        layers.append(row)
    return {"index_topk": k,
            "source": "hooked indexer (keys picked; margins from its scores, recomputed from its inputs)",
            "layers": layers}


# -- in a comparison (comparison.Sides) -----------------------------------------------------------
def selection_light(sides, local: bool) -> dict | None:
    """Selection agreement of every indexer: the reference with the probe, the engine with it
    on its own inputs (propagated) and, with `local`, with its attention and indexers fed the
    reference's inputs; a dump engine's recorded masks instead (no scores, no local pass).
    None for a model without indexers, the rollout, or an engine under tensor parallelism."""
    ref, eng = sides.ref, sides.engine
    units = indexer_units(ref)
    k = index_topk(ref.config)
    if not units or k is None or eng is None or eng.remote or sides.mode not in ("prefill", "decode"):
        return None
    sides.say("indexer selection: indexers of both sides")
    fed_units = [u.rsplit(".", 1)[0] for u in units] + units  # the attention around each indexer, and it
    probe = SelectionProbe(ref, sides.samples)
    undo = probe.install()
    try:
        r = ref.forward(sides.samples, capture_inputs=fed_units if local and not eng.recorded else ())
    finally:
        undo()
    passes = {}
    if eng.recorded:
        have = [u for u in units if u in eng.dumped]
        if not have:
            return None
        masks = {u: [] for u in have}
        for i in range(len(sides.samples)):
            outs = eng.sample(i, units=have, inputs=[])["outputs"]
            for u in have:
                masks[u].append(outs[u].float())
        passes["propagated"] = (masks, {})
    elif sides.mode == "decode":
        # The probe counts one engine call per sample; decode calls once per token. The
        # engine's picks are then its indexer units' captures, each step's picks a row of
        # the sample's [T, T] mask (no scores: margins on the reference side only).
        res = sides.engine_forward(capture=units, full_logits=False)
        passes["propagated"] = ({u: [m.float() for m in res.captures[u]] for u in units}, {})
        if local:
            res = sides.engine_forward(capture=units, full_logits=False,
                                       feed={n: r.inputs[n] for n in fed_units if r.inputs.get(n)})
            passes["local"] = ({u: [m.float() for m in res.captures[u]] for u in units}, {})
    else:
        p = SelectionProbe(eng, sides.samples)
        undo = p.install()
        try:
            sides.engine_forward(full_logits=False)
        finally:
            undo()
        passes["propagated"] = (p.masks, p.scores)
        if local:
            p = SelectionProbe(eng, sides.samples)
            undo = p.install()
            try:
                sides.engine_forward(full_logits=False, feed={n: r.inputs[n] for n in fed_units if r.inputs.get(n)})
            finally:
                undo()
            passes["local"] = (p.masks, p.scores)
    out = selection_report(sides.samples, k, units, probe.masks, probe.scores, passes)
    if sides.mode == "decode":
        out["source"] = ("reference: hooked indexer (prefill; margins from its scores); engine: its indexer units' "
                         "picks in decode mode, step by step")
    return out


def check_replay(spec) -> None:
    """Refuse `--replay-indexer` where it cannot run, before any model loads: a model without
    sparse attention's indexer, an engine that does not run (a dump, the rollout), tensor
    parallelism, decode mode. `spec`: the session's `Spec`."""
    _, ref_path = parse_spec(spec.ref, "--ref")
    config = load_config(ref_path)
    arch = arch_for(config)
    if "indexer" not in arch.attn_sub_units or index_topk(config) is None:
        raise InputError(f"--replay-indexer needs a model with sparse attention's indexer (GLM-5's DSA); {arch.name} has none")
    engine_kind = parse_spec(spec.engine, "--engine")[0]
    entry = BACKENDS.get(engine_kind)
    if entry is None or not entry.runs:
        raise InputError(f"--replay-indexer needs an engine that runs (hf: or vllm:), not {engine_kind}")
    opts = spec.engine_opts or {}
    if entry.remote(opts):
        raise InputError(f"--replay-indexer does not run under tensor parallelism yet (tensor_parallel_size="
                         f"{opts.get('tensor_parallel_size')}): replay on tensor_parallel_size=1")
    if spec.engine_mode != "prefill":
        raise InputError("--replay-indexer works in prefill mode only (--engine-mode decode replays no picks yet)")


def _replay_trial(sides, replay: dict, ref_tokens) -> tuple[float, dict, dict]:
    """The engine with `replay` forced: (judged value, k3 mean per group, masks it ran with)."""
    p = SelectionProbe(sides.engine, sides.samples, replay)
    undo = p.install()
    try:
        res = sides.engine_forward(full_logits=sides.settings.judges_kl)
    finally:
        undo()
    tokens = C.token_report(sides.samples, ref_tokens, res, sides.settings, sides.groups, detail=False)
    return tokens["value"], {g: v["k3"]["mean"] for g, v in tokens["groups"].items()}, p.masks


def _flips(a: dict, b: dict, units) -> dict:
    return {u: sum(int((x != y).any(dim=1).sum()) for x, y in zip(a[u], b[u])) if a.get(u) and b.get(u) else None
            for u in units}


def replay_whatif(sides) -> dict | None:
    """What-if: the engine attends the reference's picks at every indexer, then at each
    indexer whose picks differed alone. `from_flips` = baseline - replayed; what is left
    (`from_drift`) is the numeric drift with identical selections. None where the engine
    cannot be probed (a dump, tensor parallelism) or the model has no indexer."""
    ref, eng = sides.ref, sides.engine
    units = indexer_units(ref)
    if not units or eng is None or eng.recorded or eng.remote or sides.mode != "prefill":
        return None
    sides.say("indexer replay: the engine with the reference's picks")
    probe = SelectionProbe(ref, sides.samples)
    undo = probe.install()
    try:
        ref_tokens = ref.forward(sides.samples, full_logits=True)
    finally:
        undo()
    base, base_groups, own = _replay_trial(sides, {}, ref_tokens)
    before = _flips(probe.masks, own, units)
    value, groups, used = _replay_trial(sides, {u: probe.masks[u] for u in units}, ref_tokens)
    after = _flips(probe.masks, used, units)
    layers = []
    for u in units:
        row = {"unit": u, "layer": int(u.split(".")[1]), "flips_before": before[u], "flips_after": after[u],
               "value_replayed_alone": None, "from_flips": None}
        if before[u]:
            v, _, _ = _replay_trial(sides, {u: probe.masks[u]}, ref_tokens)
            row["value_replayed_alone"] = v
            row["from_flips"] = base - v
        layers.append(row)
    return {"direction": "ref", "replayed_on": "engine", "metric": sides.settings.metric, "group": sides.settings.group,
            "baseline": base, "replayed": value, "from_flips": base - value, "from_drift": value,
            "groups_baseline": base_groups, "groups_replayed": groups, "layers": layers}

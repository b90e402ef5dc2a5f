"""MoE routing: which experts each side chose, how often they agree, and routing replay.

1. `router_spec(config)`: top-k and the scoring function of an architecture, from its
   config (softmax or sigmoid, top-k renormalisation, GLM's grouped selection with the
   score-correction bias and its scaling factor).
2. `RoutingProbe`: installed on a backend for one forward, it records the expert ids
   the backend really handed its experts (per MoE layer, per sample) and, for a replay,
   replaces them by given ids. Where it sits is the backend's
   (`Backend.install_routing_probe`; transformers: a forward hook on the router, vLLM:
   the fused-MoE runner's `select_experts`); each call goes through `RoutingProbe.route`.
3. `routing_report`: per MoE layer, top-k expert-set agreement, the flipped tokens with
   the margin between the k-th and (k+1)-th router score on each side (a near-tie
   explains a flip), and the router-logit error.
4. Replay (R3, rollout routing replay): one side runs with the other's expert ids. The
   side that replays keeps its own router for the combine weights: its own scores at the
   replayed experts, normalised as its architecture does (as R3's trainer does with the
   rollout's routing mask). Tokens whose expert set already agrees are left untouched,
   so replaying a side's own ids changes nothing, bit for bit.
"""

from __future__ import annotations

import torch

from numbisect.backends import BACKENDS
from numbisect.common.errors import InputError
from numbisect.model.arch import arch_for
from numbisect.model.arch.base import (
    RouterSpec,  # defined with the architecture maps (pure data)
)
from numbisect.model.router import (  # noqa: F401 (this module's readers use them as routing.*)
    choice_scores,
    margins,
    router_bias,
    router_spec,
    router_units,
    scores,
    select,
    weights_for,
)
from numbisect.patching.probes.routing import RoutingProbe, experts_differ  # noqa: F401
from numbisect.pipeline import measure as C
from numbisect.pipeline import metrics as M

MAX_FLIPS_LISTED = 50  # flips listed per layer in the report (the count is always complete)


# -- the report -------------------------------------------------------------------------------
def layer_routing(samples, spec: RouterSpec, ref_ids, eng_ids, ref_logits=None, eng_logits=None,
                  ref_bias=None, eng_bias=None) -> dict:
    """Agreement of one MoE layer over every token of every sample (prompt and completion)."""
    flat_ref, flat_eng = torch.cat(ref_ids), torch.cat(eng_ids)
    agree = M.routing_agreement(flat_ref, flat_eng)
    where = [(s, t) for s, ids in enumerate(ref_ids) for t in range(ids.shape[0])]
    have_logits = bool(ref_logits) and bool(eng_logits)
    out: dict = {"tokens": agree["tokens"], "agree_frac": agree["agree_frac"], "flipped": len(agree["flipped"])}
    completion = [i for i, (s, t) in enumerate(where) if t >= len(samples[s].prompt_ids)]
    flipped = set(agree["flipped"])
    out["completion_tokens"] = len(completion)
    out["completion_agree_frac"] = (
        sum(1 for i in completion if i not in flipped) / len(completion) if completion else None
    )
    if have_logits:
        rl, el = torch.cat([x.double() for x in ref_logits]), torch.cat([x.double() for x in eng_logits])
        err = M.activation_error(rl, el)
        out["logit_error"] = {k: err[k] for k in ("rel_l2", "max_abs", "mean_abs", "cosine")}
        rm, em = margins(rl, spec, ref_bias), margins(el, spec, eng_bias)
        tok_err = (el - rl).abs().max(dim=1).values
        out["margin_p50_all"] = M.aggregate(rm)["p50"]
        out["margin_p50_flipped"] = M.aggregate(rm[agree["flipped"]])["p50"] if flipped else None
    flips = []
    for i in agree["flipped"][:MAX_FLIPS_LISTED]:
        s, t = where[i]
        row = {
            "sample": s,
            "position": t,
            "token_id": int(samples[s].ids[t]),
            "completion": t >= len(samples[s].prompt_ids),
            "ref_experts": sorted(int(e) for e in flat_ref[i]),
            "engine_experts": sorted(int(e) for e in flat_eng[i]),
        }
        if have_logits:
            row.update(ref_margin=rm[i].item(), engine_margin=em[i].item(), logit_max_abs=tok_err[i].item())
        flips.append(row)
    out["flips"] = flips
    return out


def routing_report(samples, spec: RouterSpec, units: list[str], ref_ids: dict, ref_logits: dict,
                   sides: dict[str, tuple[dict, dict]], biases: tuple = (None, None)) -> dict:
    """Per MoE layer and per engine pass (`sides`: name -> (engine ids, engine logits))."""
    layers = []
    for u in units:
        row = {"unit": u, "layer": int(u.split(".")[1])}
        rb = biases[0].get(u) if biases[0] else None
        eb = biases[1].get(u) if biases[1] else None
        for side, (ids, logits) in sides.items():
            if ids.get(u) and ref_ids.get(u):
                row[side] = layer_routing(samples, spec, ref_ids[u], ids[u], ref_logits.get(u), logits.get(u), rb, eb)
            else:
                row[side] = None
        layers.append(row)
    return {"spec": spec.to_dict(), "source": "hooked router (recorded expert ids; margins from captured logits)", "layers": layers}


# -- in a comparison (comparison.Sides) ---------------------------------------------------------------------------
REPLAY_DIRECTIONS = ("ref", "engine")


def check_replay(direction: str | None, config, engine_kind: str, engine_opts: dict | None = None) -> None:
    """Refuse a replay that cannot run, before any model loads."""
    if direction is None:
        return
    if direction not in REPLAY_DIRECTIONS:
        raise InputError(f"--replay-routing must be ref or engine, not {direction!r}")
    if router_spec(config) is None:
        raise InputError(f"--replay-routing needs a MoE model; {arch_for(config).name} is dense (no router to replay)")

    entry = BACKENDS.get(engine_kind)
    if entry is None or not entry.runs:
        raise InputError(f"--replay-routing needs an engine that runs (hf: or vllm:), not {engine_kind}")
    tp = int((engine_opts or {}).get("tensor_parallel_size", 1) or 1)
    if entry.remote(engine_opts or {}):
        raise InputError(f"--replay-routing does not run under tensor parallelism yet (tensor_parallel_size={tp}): "
                         "the expert ids are not forced inside the workers; replay on tensor_parallel_size=1")


def _biases(backend, units) -> dict:
    return {u: router_bias(backend, u) for u in units}


def _flips(a: dict, b: dict, units) -> dict:
    return {u: int(experts_differ(torch.cat(a[u]), torch.cat(b[u])).sum()) if a.get(u) and b.get(u) else None for u in units}


def _replay_trial(sides, direction: str, replay: dict, eng_prop):
    """One forward with `replay` forced on the replaying side: (judged value, k3 per group, ids used)."""
    ref = sides.reference()
    if direction == "ref":
        probe = sides.routing_probe(sides.engine, replay)
        res = sides.engine_forward(probe=probe, full_logits=sides.settings.judges_kl)
        tokens = C.token_report(sides.samples, ref, res, sides.settings, sides.groups, detail=False)
    else:
        probe = sides.routing_probe(sides.ref, replay)
        undo = probe.install()
        try:
            res = sides.ref.forward(sides.samples, full_logits=True)
        finally:
            undo()
        tokens = C.token_report(sides.samples, res, eng_prop, sides.settings, sides.groups, detail=False)
    groups = {g: v["k3"]["mean"] for g, v in tokens["groups"].items()}
    return tokens["value"], groups, probe.ids, probe.replaced


def replay_whatif(sides, direction: str, eng_ids: dict, eng_prop, base_tokens: dict) -> dict:
    """R3-style what-if: how much of the judged metric comes from routing flips.

    `ref`: the engine runs with the reference's expert ids; `engine`: the reference runs
    with the engine's. Every MoE layer replayed at once splits the metric into the part
    due to flips (baseline minus replayed) and the numeric drift left with identical
    routing (the replayed value); then each layer that had flips is replayed alone.
    """
    ref_ids = sides.ref_routing or {}
    units = router_units(sides.ref)
    source = ref_ids if direction == "ref" else eng_ids
    before = _flips(ref_ids, eng_ids, units)
    base = base_tokens["value"]
    sides.say(f"routing replay ({direction}'s expert ids), every MoE layer")
    value, groups, used, replaced = _replay_trial(sides, direction, {u: source[u] for u in units}, eng_prop)
    after = _flips(ref_ids, used, units) if direction == "ref" else _flips(used, eng_ids, units)
    layers = []
    for u in units:
        row = {"unit": u, "layer": int(u.split(".")[1]), "flips_before": before[u], "flips_after": after[u],
               "value_replayed_alone": None, "from_flips": None}
        if before[u]:
            sides.say(f"routing replay ({direction}'s expert ids), {u} alone")
            v, _, used_u, _ = _replay_trial(sides, direction, {u: source[u]}, eng_prop)
            row["value_replayed_alone"] = v
            row["from_flips"] = base - v
            row["flips_after_alone"] = (_flips(ref_ids, used_u, [u]) if direction == "ref" else _flips(used_u, eng_ids, [u]))[u]
        layers.append(row)
    return {
        "direction": direction,
        "replayed_on": "engine" if direction == "ref" else "ref",
        "weights": "own router: the replaying side's own scores at the replayed experts, normalised as its architecture does",
        "metric": sides.settings.metric,
        "group": sides.settings.group,
        "baseline": base,
        "replayed": value,
        "from_flips": base - value,
        "from_drift": value,
        "groups_replayed": groups,
        "groups_baseline": {g: v["k3"]["mean"] for g, v in base_tokens["groups"].items()},
        "tokens_replaced": {u: n for u, n in replaced.items()},
        "layers": layers,
    }

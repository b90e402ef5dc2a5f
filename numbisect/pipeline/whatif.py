"""Precision what-ifs: would running a culprit's arithmetic in fp32 fix the divergence?

For each culprit the search named (and for a systematic culprit, the kinds it named in
every layer, each what-if on all of their units at once: `run_kind_whatifs`):

1. `fp32 unit`: the whole unit computed in float32, its output handed back in the
   engine's dtype. On an hf engine the engine's own module (with its planted faults)
   is copied and run in float32 (`CastAdapter`). On vLLM, whose linear weights are
   prepacked (the module's parameters are empty), it is the reference's module for
   the unit in float32 (same checkpoint), put in through the swap machinery.
   How a what-if is put in place is the engine's backend's (`Backend.install_whatif`:
   numbisect.backends.hf.whatif, numbisect.backends.vllm.model); this module picks
   the what-ifs, the faults they replace, and judges them.
2. `fp32 weighted sum` (MoE blocks and their experts): the engine's own expert
   outputs, one top-k slot at a time (weight 1, so each is the expert's output as the
   engine's kernel rounds it), multiplied by the routing weights and summed in
   float32. Nothing else changes.
3. Each what-if is one engine forward over the trace. The other culprits are swapped
   for the reference's modules, so only this culprit's error is left; "before" is
   that forward without the what-if (the search's baseline when there is one culprit).
4. Planted faults stay on, except the precision faults whose arithmetic the what-if
   recomputes in float32: `fp32 weighted sum` replaces a `moe_combine_*` fault of its
   block; `fp32 unit` replaces the precision faults (`moe_combine_*`, `router_logits_*`,
   `rmsnorm_no_upcast`) at or inside the unit. Noise faults (`weight_noise`,
   `output_noise`) are never replaced: an upcast does not remove noise. On vLLM an
   output noise at the unit itself is planted again on the float32 module; other noise
   at or inside it cannot be (the reference's module replaces the engine's weights):
   the what-if lists it in `faults_not_carried` and its line says so.
5. Verdict per what-if: `fixes` (from above the threshold to at or under it), `helps`
   (to at most half of before), or `no_help`; the culprit's `suggested` fix is the narrowest that fixes it.
"""

from __future__ import annotations

import math

from numbisect.backends.base import WHATIF_UNIT, WHATIF_WSUM, ForwardResult
from numbisect.common.formatting import fmt
from numbisect.patching.arrangement import arranged
from numbisect.patching.faults import apply_faults
from numbisect.pipeline import measure as C
from numbisect.pipeline.comparison import Sides

PRECISION_FAULTS = ("moe_combine", "router_logits", "rmsnorm_no_upcast")
UNIT = WHATIF_UNIT
WSUM = WHATIF_WSUM


def _inside(name: str, unit: str) -> bool:
    return name == unit or name.startswith(unit + ".")


def _block(unit) -> str:
    return unit.name if unit.kind == "moe" else unit.parent


def whatifs_for(unit) -> list[str]:
    """The what-ifs that apply to a unit: the whole unit, and for MoE the weighted sum."""
    return [WSUM, UNIT] if unit.kind in ("moe", "experts") else [UNIT]


def replaced(fault, whatif: str, unit) -> bool:
    """Whether the what-if recomputes exactly this fault's arithmetic in float32."""
    if fault.kind not in PRECISION_FAULTS:
        return False
    if whatif == WSUM:
        return fault.kind == "moe_combine" and fault.unit in (_block(unit), _block(unit) + ".experts")
    # A moe_combine fault planted on a block lives in its experts' weighted sum.
    where = fault.unit + ".experts" if fault.kind == "moe_combine" and not fault.unit.endswith(".experts") else fault.unit
    return _inside(where, unit.name)


def fix_text(whatif: str, unit) -> str:
    if whatif == WSUM:
        return "accumulate the expert weighted sum in fp32"
    return f"upcast {unit.name} ({unit.kind}) to fp32"


# -- a what-if on the engine ------------------------------------------------------------------
def not_carried(sides: Sides, whatif: str, unit) -> list[str]:
    """Planted noise faults this what-if cannot keep (the engine's backend says which: on
    vLLM the fp32 unit is the reference's module, so weight noise at or inside the unit,
    and output noise strictly inside it, are gone)."""
    return sides.engine.whatif_not_carried(whatif, unit, sides.faults)


def forward(sides: Sides, whatif: str | None, unit, others: list[str]):
    """One engine forward: planted faults (less those the what-if replaces), the other
    culprits swapped, then the what-if and the faults it plants again on top of it, all
    in the arrangement's one ledger. `unit`: one unit, or a list (a systematic culprit's:
    the what-if on each of them)."""
    engine = sides.engine
    units = unit if isinstance(unit, list) else [unit]
    kept = [f for f in sides.faults if whatif is None or not any(replaced(f, whatif, u) for u in units)]
    with arranged(engine, sides.ref, kept, others) as ledger:
        if whatif is not None:
            replant = []
            for u in units:
                replant += [f for f in engine.install_whatif(whatif, u, sides.ref, sides.faults, ledger) if f not in replant]
            apply_faults(engine, replant, ledger)
        # decode mode too; full logits only when the KL is judged (as in a search trial)
        return engine.forward(sides.samples, full_logits=sides.settings.judges_kl, mode=sides.mode)


def verdict(before: float, after: float, threshold: float) -> str:
    if after <= threshold < before:
        return "fixes"
    if math.isfinite(after) and after <= 0.5 * before:  # inf -> inf is no help
        return "helps"
    return "no_help"


def describe(t: dict) -> str:
    """One line: 'accumulate the expert weighted sum in fp32: k3-mean 2.9e-01 -> 4.0e-06 (fixes it)'."""
    above = t.get("threshold") is not None and t["value"] > t["threshold"]
    helps = "helps, still above the threshold" if above else "helps"
    what = {"fixes": "fixes it", "helps": helps, "no_help": "does not help"}[t["verdict"]]
    if t["verdict"] == "no_help" and t["value"] == t["before"]:
        what = "changes nothing"
    lost = f"; planted {', '.join(t['faults_not_carried'])} not carried over" if t.get("faults_not_carried") else ""
    return f"{t['fix']}: {t['metric']} {fmt(t['before'])} -> {fmt(t['value'])} ({what}{lost})"


def _judged(sides: Sides, ref, res) -> tuple[float, float | None]:
    """A what-if forward's judged value and its group's k3 mean."""
    st = sides.settings
    tokens = C.token_report(sides.samples, ref, res, st, sides.groups, detail=False)
    return tokens["value"], tokens["groups"][st.group]["k3"]["mean"] if st.group in tokens["groups"] else None


def _trial(sides: Sides, w: str, units: list, fix: str, before: float, judged: tuple) -> dict:
    """One what-if's record: what it replaced and could not carry over, its verdict and line."""
    st = sides.settings
    value, k3 = judged
    t = {"whatif": w, "fix": fix, "metric": st.metric, "threshold": st.threshold, "before": before, "value": value,
         "k3_mean": k3, "replaced_faults": [f.spec for f in sides.faults if any(replaced(f, w, u) for u in units)],
         "faults_not_carried": list(dict.fromkeys(x for u in units for x in not_carried(sides, w, u)))}
    t["verdict"] = verdict(before, value, st.threshold)
    t["line"] = describe(t)
    return t


def _precision(trials: list[dict], what: str) -> dict:
    """The what-ifs and the suggested fix: the narrowest that fixes it, else the one that helps most."""
    fixing = [t for t in trials if t["verdict"] == "fixes"]
    helping = sorted((t for t in trials if t["verdict"] == "helps"), key=lambda t: t["value"])
    best = (fixing or helping or [None])[0]
    return {"whatifs": trials, "suggested": best["line"] if best else f"no precision fix: running {what} in fp32 does not help"}


def run_whatifs(sides: Sides, ref_tokens: ForwardResult, culprits: list[dict], baseline: float | None,
                progress=lambda m: None, names: list[str] | None = None) -> None:
    """Add `precision` (what-ifs and the suggested fix) to each culprit dict, in place.
    `sides`: the engine (its planted faults, its mode), the reference, the samples and
    settings, as the session holds them; `ref_tokens`: the reference's log-probs each
    what-if is measured against (the session's `reference_tokens()`).

    `names`: every culprit of the search (default: those given), each swapped while another's
    what-if runs; `baseline` is used as "before" only when there is no other. A failure raises
    (`run.run` records it per culprit and keeps the search's result)."""
    if sides.engine is None or not culprits:
        return
    names = [c["unit"] for c in culprits] if names is None else list(names)
    for c in culprits:
        unit = sides.engine.unit(c["unit"])
        # a culprit around or inside this one is not swapped for its what-if (it would hide it)
        others = [n for n in names if not _inside(n, unit.name) and not _inside(unit.name, n)]
        if others or baseline is None:
            progress(f"what-if: {unit.name} with the other culprits swapped")
            before, _ = _judged(sides, ref_tokens, forward(sides, None, unit, others))
        else:
            before = baseline
        trials = []
        for w in whatifs_for(unit):
            progress(f"what-if: {unit.name}, {w}")
            trials.append(_trial(sides, w, [unit], fix_text(w, unit), before,
                                 _judged(sides, ref_tokens, forward(sides, w, unit, others))))
        c["precision"] = _precision(trials, unit.name)


def run_kind_whatifs(sides: Sides, ref_tokens: ForwardResult, systematic: dict, baseline: float | None,
                     progress=lambda m: None) -> None:
    """A systematic culprit's what-ifs (the search named kinds, in every layer, not units):
    each what-if put on every unit of those kinds at once, in one forward, judged against
    the search's baseline as a culprit's are; adds `precision` to `systematic`, in place
    (the same fields as a culprit's, with `units`: how many units each what-if was put on).
    `fp32 weighted sum` when every such unit is a MoE block or its experts."""
    if sides.engine is None or baseline is None:
        return
    kinds = set(systematic.get("kinds") or [])
    units = [u for u in sides.engine.units if u.kind in kinds]
    if not units:
        return
    which = [WSUM, UNIT] if all(u.kind in ("moe", "experts") for u in units) else [UNIT]
    named = ", ".join(sorted(kinds))
    trials = []
    for w in which:
        progress(f"what-if: every {named} unit ({len(units)}), {w}")
        fix = "accumulate every MoE block's expert weighted sum in fp32" if w == WSUM else f"upcast every {named} unit to fp32"
        t = _trial(sides, w, units, fix, baseline, _judged(sides, ref_tokens, forward(sides, w, units, [])))
        trials.append({**t, "units": len(units)})
    systematic["precision"] = _precision(trials, f"every {named} unit")

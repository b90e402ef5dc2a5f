"""What the TUI shows, computed from a report dict alone (no textual, no torch).

1. `verdict_line` and `culprit_lines`: the answer in a sentence or two, with evidence.
2. `unit_rows` / `unit_severity`: the unit tree (containment, execution order) with a
   symbol and a number per unit, for the propagated or the local error.
3. `trials_with` / `abbreviate`: the search log, per unit and per trial.
4. `TokenData`: per-sample per-token k3 (baseline.per_sample), group masks (completion,
   prompt, all, and trace groups when the trace file is at hand), heat-strip cells and
   the worst tokens of a group.
5. A `bisect conditions` report (`conditions_of`): its search is over engine settings
   (atoms), not units. `settings_rows`, `op_rows`, `atom_rows`, `reference_rows` and
   `localisation_rows` are its Overview's tables, `report_trials` its trials (atoms
   reverted to the known-good state), `trial_reference` a trial's RL cost against the
   reference.
6. A report of `compare` / `run --engine-config FILE` (`engine_config_of`): where each part
   ran (your settings or the hookable ones), `engine_config_finding` whether the module
   search saw your numbers, `engine_settings_rows` / `engine_op_rows` its Overview's tables.

Every verdict carries a word or a symbol, never only a colour.

Each function takes a report dict (or its `numbisect.report.view` view) and reads it
through the view, as `bisect report show` and `md` do: its strings printable, its
sections of the shapes the view gives. They accept any schema-valid report: numbers
stored as "inf"/"nan" strings, optional fields absent or of an odd shape, unit parents
that form a cycle.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from numbisect.common.errors import InputError
from numbisect.common.formatting import fmt, num, pct
from numbisect.common.safeio import read_bytes
from numbisect.common.textsafe import printable
from numbisect.model.units import Unit, children, unit_graph
from numbisect.report.findings import checkpoint_differs
from numbisect.report.findings import mark as verdict_mark
from numbisect.report.sections.weights import weights_differ
from numbisect.report.sections.conditions import engine_config_finding as engine_config_finding_of
from numbisect.report.sections.conditions import localisations_of
from numbisect.report.view import ReportView, typed_trials, view

METRIC_WORDS = {"k3-mean": "mean k3", "k3-p99": "p99 k3", "kl-mean": "mean KL"}

# Severity of a unit's relative L2 error against the report's unit tolerance.
SEVERITY = {
    # symbol, style, meaning
    "none": ("-", "dim", "not measured"),
    "equal": ("=", "green", "bitwise identical"),
    "ok": (".", "green", "under the unit tolerance"),
    "over": ("!", "yellow", "over the unit tolerance"),
    "far": ("!!", "bold red", "over 10x the unit tolerance"),
}
CULPRIT_MARK = "◆"


def metric_words(metric: str) -> str:
    return METRIC_WORDS.get(metric, metric)


def threshold_of(r: dict | ReportView) -> float:
    """The judged threshold as a float (NaN when the report's is not a number)."""
    t = num(view(r).threshold)
    return math.nan if t is None else t


def unit_tol(r: dict | ReportView) -> float:
    """The unit tolerance as a float (1e-2 when absent, zero or not a number)."""
    return num(view(r).unit_tol) or 1e-2


# -- verdict and culprit -------------------------------------------------------------------
def verdict_line(r: dict | ReportView) -> tuple[str, str, str]:
    """(mark, style, text): the verdict with the judged value against the threshold."""
    rv = view(r)
    held = weights_differ(rv)
    differs = checkpoint_differs(rv.checkpoint_diff) or held
    mark, style = ((verdict_mark(True, differs, held), "bold yellow" if differs else "bold green") if rv.aligned
                   else ("!! DIVERGED", "bold red"))
    ratio = ""
    t, v = num(rv.threshold), num(rv.value)
    if t and v is not None and math.isfinite(t) and math.isfinite(v):
        x = v / t
        ratio = f" ({x:.0f}x)" if x >= 100 else f" ({x:.2g}x)"
    cmp_ = "<=" if rv.aligned else ">"
    cond = conditions_of(rv)
    if cond is not None:  # judged against the known-good configuration; the RL cost is the reference's
        text = f"{metric_words(rv.metric)} vs the known-good configuration {fmt(rv.value)} {cmp_} {fmt(rv.threshold)}"
        rej = _rl(_d(_d(cond.get("vs_reference")).get("user"))).get("seq_frac_rejected")
        if rej is not None:
            text += f" · yours vs the reference: {pct(rej)} of sequences rejected"
        return mark, style, text
    text = f"{metric_words(rv.metric)} {fmt(rv.value)} {cmp_} {fmt(rv.threshold)}{ratio}"
    rl = rv.rl_cost
    if rl.get("seq_frac_rejected") is not None:
        text += f" · {pct(rl['seq_frac_rejected'])} of sequences rejected"
    return mark, style, text


def culprit_lines(r: dict | ReportView) -> list[tuple[str, str]]:
    """(style, sentence) lines: the answer with its evidence, after the log-prob contract
    when the engine's log-probs are processed (the report's first finding)."""
    rv = view(r)
    return contract_line(rv) + _answer_lines(rv) + engine_config_line(rv)


def engine_config_line(r: dict | ReportView) -> list[tuple[str, str]]:
    """With --engine-config, a short line on whether the module search saw your numbers
    (the Overview has the whole section; "your settings alone diverge" is the answer itself)."""
    rv = view(r)
    if engine_config_of(rv) is None:
        return []
    mark, style, _ = engine_config_finding(rv)
    vs = _d(engine_config_of(rv).get("hookable_vs_user"))
    short = {"=": "your engine configuration: the module search sees exactly your numbers",
             "!": f"your engine configuration: the module search sees numbers near yours (k3 {fmt(vs.get('k3_mean'))} apart), "
                  "not yours"}
    return [(style, short[mark])] if mark in short else []


def contract_line(r: dict | ReportView) -> list[tuple[str, str]]:
    """The log-prob contract in one line when it is processed (its advice is in the Overview)."""
    c = view(r).logprob_contract
    if c.get("verdict") != "processed":
        return []
    f = _d(c.get("fitted"))
    top_k = f.get("top_k")
    fitted = [f"temperature {fmt(f.get('temperature'))}"] + ([f"top-p {fmt(f.get('top_p'))}"] if num(f.get("top_p")) != 1 else []) \
        + ([f"top-k {fmt(top_k)}"] if top_k else [])
    whose = "your engine's" if c.get("source") == "engine_config" else "the rollout's"
    return [("bold red", f"!! log-prob contract: {whose} log-probs are processed (fitted: {', '.join(fitted)}), "
                         "not the model's raw ones: what to change is in the Overview")]


def _answer_lines(rv: ReportView) -> list[tuple[str, str]]:
    if conditions_of(rv) is not None:
        return conditions_culprit_lines(rv)
    if engine_config_of(rv) is not None:
        mark, style, sentence = engine_config_finding(rv)
        if mark == "!!":  # the search ran in the hookable configuration: it cannot find what only your settings do
            return [(style, sentence)]
    words = metric_words(rv.metric)
    s = rv.search
    if not s:
        if rv.aligned and weights_differ(rv):  # a weight check's finding: the tokens of one batch need not move
            return [("bold yellow", "tokens aligned, but some units of the engine compute with other weights than the "
                                    "reference's: the Overview names them")]
        if rv.aligned and checkpoint_differs(rv.checkpoint_diff):  # exit 5: the diff's finding, not the tokens'
            return [("bold yellow", "tokens aligned, but the engine's checkpoint differs from the reference's: "
                                    "the Overview names what differs")]
        if rv.aligned:
            return [("green", "aligned: the engine agrees with the reference; nothing to bisect")]
        rank = rv.local_ranking
        top = min(rank, key=rank.get) if rank else None
        fd = rv.first_divergence.get("above_tol")
        hint = "no search in this report (kind compare): run `bisect run`, or live mode, to name a culprit"
        out = [("yellow", hint)]
        clues = []
        if top:
            clues.append(f"largest local error: {top}")
        if fd:
            clues.append(f"first unit over rel-L2 {fmt(rv.unit_tol)}: {fd}")
        if clues:
            out.append(("", "; ".join(clues)))
        return out
    sw = rv.swap
    if sw:
        lines = sw.get("lines") or [f"swap: {s.get('stop_reason')}"]
        return [("bold" if sw.get("fixed") else "yellow", str(lines[0]))]
    verdict = s["verdict"]
    culprits = rv.culprits
    if verdict == "culprits" and culprits:
        out = []
        for c in culprits:
            out.append(
                ("bold magenta", f"{c['unit']}: swapping it alone takes {words} from {fmt(s['baseline'])} to {fmt(c['alone'])}")
            )
        ev = [f"{CULPRIT_MARK} culprit" + ("s" if len(culprits) > 1 else ""), f"threshold {fmt(rv.threshold)}"]
        if len(culprits) == 1:
            c = culprits[0]
            ev.append(f"all others swapped: {fmt(c['complement'])}")
            if c.get("local_rank"):
                ev.append(f"local rank {c['local_rank']}")
        else:
            ev.append(f"{s['trials_used']} trials")
        out.append(("", " · ".join(ev)))
        return out
    if verdict == "aligned":
        return [("green", f"aligned: {words} {fmt(s['baseline'])} <= {fmt(rv.threshold)} before any swap")]
    if verdict == "diffuse":
        if rv.diffuse_kinds:
            return [("yellow", "diffuse: only every kind together reaches the threshold; see the per-layer contributions (Trials)")]
        return [("yellow", "diffuse: no set smaller than every layer reaches the threshold; see the per-layer contributions (Trials)")]
    return [("yellow", f"{verdict}: {s['stop_reason']}")]


# -- units ---------------------------------------------------------------------------------
def unit_metrics(u: dict, view: str) -> dict | None:
    """A unit's error block for `view` ("propagated" or "local")."""
    return u.get(view)


def unit_severity(u: dict, view: str, tol: float) -> tuple[str, str, float | None]:
    """(severity key, value string, value) of a unit's relative L2 error."""
    m = unit_metrics(u, view)
    if not m:
        return "none", "-", None
    v = num(m.get("rel_l2"))
    if v is None:
        return "none", "-", None
    ul = m.get("ulps") or {}
    if ul.get("bitwise_equal") or v == 0:
        key = "equal"
    elif v <= tol:
        key = "ok"
    elif v <= 10 * tol:
        key = "over"
    else:
        key = "far"
    return key, fmt(v), v


def legend(tol: float) -> str:
    return f"rel-L2: =same .<={fmt(tol)} !>{fmt(tol)} !!>{fmt(10 * tol)} {CULPRIT_MARK}culprit"


@dataclass
class UnitRow:
    name: str
    label: str  # short name under its parent
    depth: int
    kind: str
    data: dict | None  # the report's unit entry (None for the model root)


def _units(rv: ReportView) -> list[Unit]:
    out = []
    for i, u in enumerate(rv.units):
        if u["name"] == "model":  # the tree's root: a unit of that name cannot be placed
            continue
        out.append(Unit(u["name"], u["kind"], u.get("layer"), u.get("parent") or "model", i))
    return out


def unit_rows(r: dict | ReportView) -> list[UnitRow]:
    """Depth-first rows: model > layers > attn / moe > router / experts, in execution order.

    Each unit shows once (the first entry of a repeated name); units whose parents form a
    cycle, or that are not under the model, are not shown."""
    rv = view(r)
    by_name: dict[str, dict] = {}
    for u in rv.units:
        by_name.setdefault(u["name"], u)
    g = unit_graph(_units(rv))
    rows: list[UnitRow] = []
    seen = {"model"}
    stack = [(c, "model", 1) for c in reversed(children(g, "model"))]
    while stack:  # iterative: a deep or cyclic containment cannot overflow the stack
        name, parent, depth = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        u = by_name.get(name)
        label = name[len(parent) + 1 :] if parent != "model" and name.startswith(parent + ".") else name
        rows.append(UnitRow(name, label, depth, u["kind"] if u else "model", u))
        stack.extend((c, name, depth + 1) for c in reversed(children(g, name)) if c not in seen)
    return rows


def ancestors(r: dict | ReportView, name: str) -> list[str]:
    """The units containing `name`, innermost first (a cycle of parents ends the list)."""
    parents: dict[str, str] = {}
    for u in view(r).units:
        parents.setdefault(u["name"], u.get("parent") or "model")
    out: list[str] = []
    p = parents.get(name)
    while p and p != "model" and p != name and p not in out:
        out.append(p)
        p = parents.get(p)
    return out


def visible_units(r: dict | ReportView, text: str) -> set[str] | None:
    """Units matching a filter (name or kind contains the text), plus their ancestors.

    None when the filter is empty (everything shows)."""
    text = text.strip().lower()
    if not text:
        return None
    rv = view(r)
    keep = set()
    for u in rv.units:
        if text in u["name"].lower() or text == u["kind"].lower():
            keep.add(u["name"])
            keep.update(ancestors(rv, u["name"]))
    return keep


def culprit_names(r: dict | ReportView) -> set[str]:
    return {c["unit"] for c in view(r).culprits}


# -- trials --------------------------------------------------------------------------------
def trials_with(trials: list[dict], r: dict | ReportView, name: str) -> list[tuple[dict, str]]:
    """Trials in which `name` was swapped: (trial, "itself" or "via PARENT")."""
    ups = ancestors(r, name)
    out = []
    for t in trials:
        sw = set(t["swapped"])
        if name in sw:
            out.append((t, "itself"))
        else:
            via = next((a for a in ups if a in sw), None)
            if via:
                out.append((t, f"via {via}"))
    return out


def _ranges(nums: list[int]) -> str:
    nums = sorted(set(nums))
    parts, start = [], None
    for i, n in enumerate(nums):
        if start is None:
            start = n
        if i + 1 == len(nums) or nums[i + 1] != n + 1:
            parts.append(str(start) if start == n else f"{start}-{n}")
            start = None
    return ",".join(parts)


def _compact(names) -> str:
    per_rest: dict[str, list[int]] = {}
    top: list[str] = []
    for name in names:
        parts = name.split(".")
        if len(parts) >= 2 and parts[0] == "layers" and parts[1].isascii() and parts[1].isdigit() and len(parts[1]) < 10:
            per_rest.setdefault(".".join(parts[2:]) or "layer", []).append(int(parts[1]))
        else:
            top.append(name)
    return " ".join([f"{k}[{_ranges(v)}]" for k, v in per_rest.items()] + top)


def candidate_universe(r: dict | ReportView) -> list[str]:
    """The search's candidates: children of the model and of each layer (not layers); a
    conditions report's atoms."""
    cond = conditions_of(r)
    if cond is not None:
        return [str(a.get("atom")) for a in atoms_of(cond)]
    units = view(r).units
    kinds = {u["name"]: u["kind"] for u in units}
    out = []
    for u in units:
        parent = u.get("parent") or "model"
        if u["kind"] != "layer" and (parent == "model" or kinds.get(parent) == "layer"):
            out.append(u["name"])
    return out


def abbreviate(swapped: list[str], universe: list[str] | None = None, width: int = 48) -> str:
    """A swapped set in few characters: `moe.experts[2]`, `attn[0-3] moe[0,1] embed`,
    or `all 19 but moe[2]` when that is shorter."""
    if not swapped:
        return "nothing (baseline)"
    text = _compact(swapped)
    if universe:
        sw, uni = set(swapped), set(universe)
        rest = [u for u in universe if u not in sw]
        extra = sorted(sw - uni)
        alt = f"all {len(universe)}" + (f" but {_compact(rest)}" if rest else "") + (f" + {_compact(extra)}" if extra else "")
        if len(alt) < len(text):
            text = alt
    if len(text) > width:
        text = text[: width - 1] + "…"
    return text


def value_mark(value, threshold) -> str:
    """"fixed" when the value is at or under the threshold, "?" when either is not a number."""
    v, t = num(value), num(threshold)
    if v is None or t is None or math.isnan(v) or math.isnan(t):
        return "?"
    return "fixed" if v <= t else ""


# -- conditions (bisect conditions) ----------------------------------------------------------
def _d(x) -> dict:
    return x if isinstance(x, dict) else {}


def _rl(side: dict) -> dict:
    return _d(side.get("rl_cost"))


def conditions_of(r: dict | ReportView) -> dict | None:
    """The `conditions` section of a `bisect conditions` report; None for any other report."""
    rv = view(r)
    c = rv.r.get("conditions")
    return c if rv.kind == "conditions" and isinstance(c, dict) else None


def report_trials(r: dict | ReportView) -> list[dict]:
    """The report's search trials: a conditions report's (each reverts atoms) or the units'."""
    rv = view(r)
    cond = conditions_of(rv)
    if cond is None:
        return list(rv.trials)
    return typed_trials(cond.get("trials"))


def section(cond: dict, key: str) -> dict:
    """A conditions report's sub-section `key` (search, localisation, ...); {} when absent or odd."""
    return _d(cond.get(key))


def atoms_of(cond: dict) -> list[dict]:
    return [a for a in cond.get("atoms") or [] if isinstance(a, dict)] if isinstance(cond.get("atoms"), list) else []


_UNSET = object()  # a setting one side leaves out


def setting_text(v) -> str:
    """A setting's value in one short line (JSON for lists and objects)."""
    if isinstance(v, (dict, list)):
        return json.dumps(v, sort_keys=True, ensure_ascii=True)
    if isinstance(v, bool) or v is None:
        return json.dumps(v)
    return fmt(v) if isinstance(v, float) else str(v)


def _is_atom(key: str, atoms: set[str]) -> bool:
    """Whether setting `key` differs in effect: an atom stands for it (enforce_eager is the
    `compiled` atom; compilation_config its own and the custom-op atoms)."""
    if key == "enforce_eager":
        return "compiled" in atoms
    if key == "compilation_config":
        return bool(atoms & {"compilation_config", "custom_ops"}) or any(a.startswith("custom_op:") for a in atoms)
    return key in atoms


def settings_rows(cond: dict) -> list[tuple[str, str, str, str]]:
    """(mark, setting, yours, known-good) for every setting either side gives, the ones that
    differ first. Mark "≠": it differs in effect (an atom stands for it); "~": written
    differently, the same in effect (a side leaves out numbisect's default); " ": equal.
    A setting one side leaves out reads "(not set)"."""
    user, good = _d(cond.get("user")), _d(cond.get("good"))
    atoms = {str(a.get("atom")) for a in atoms_of(cond)}
    rows = []
    for k in sorted(set(user) | set(good), key=str):
        a = setting_text(user[k]) if k in user else "(not set)"
        b = setting_text(good[k]) if k in good else "(not set)"
        mark = " " if user.get(k, _UNSET) == good.get(k, _UNSET) else "≠" if _is_atom(str(k), atoms) else "~"
        rows.append((mark, str(k), a, b))
    return sorted(rows, key=lambda x: {"≠": 0, "~": 1}.get(x[0], 2))


def op_rows(cond: dict) -> list[tuple[str, str, str, str]]:
    """(mark, custom op, yours, known-good) as the engines reported the ops ("≠": the states
    differ); differing first."""
    ops = _d(cond.get("custom_ops"))
    user, good = _d(ops.get("user")), _d(ops.get("good"))

    def state(side, k):
        v = side.get(k)
        return "on" if v is True else "off" if v is False else "-" if k not in side else setting_text(v)

    rows = [("≠" if state(user, k) != state(good, k) else " ", str(k), state(user, k), state(good, k))
            for k in sorted(set(user) | set(good), key=str)]
    return sorted(rows, key=lambda x: x[0] == " ")


def atom_result(a: dict) -> tuple[str, str]:
    """(word, style) of an atom's result: culprit, changes log-probs, bitwise invariant, not measured."""
    if a.get("culprit") is True:
        return f"{CULPRIT_MARK} CULPRIT", "bold magenta"
    if a.get("bitwise_invariant") is True:
        return "= bitwise invariant here", "green"
    if a.get("alone") is None:
        return "- not measured", "dim"
    return "! changes log-probs", "yellow"


def atom_rows(cond: dict) -> list[dict]:
    """One row per atom: name, alone (k3 vs good with only it in the user's state), result
    word and style, description, and its run against the reference (k3 mean, rejected)."""
    out = []
    for a in atoms_of(cond):
        word, style = atom_result(a)
        ref = _d(a.get("vs_reference"))
        out.append({"atom": str(a.get("atom")), "alone": fmt(a.get("alone")), "result": word, "style": style,
                    "description": "" if a.get("description") is None else str(a.get("description")),
                    "ref_k3": fmt(_d(_d(ref.get("groups")).get("completion")).get("k3_mean")),
                    "ref_rejected": pct(_rl(ref).get("seq_frac_rejected"))})
    return out


REFERENCE_COLUMNS = ("k3 mean", "rejected", "TIS", "IcePop", "geo-mean", "seq k3")


def reference_cells(side: dict) -> tuple[str, ...]:
    """A run against the reference: completion k3 mean, then the RL cost (fractions of sequences)."""
    rl = _rl(side)
    k3 = _d(_d(side.get("groups")).get("completion")).get("k3_mean")
    return (fmt(k3), pct(rl.get("seq_frac_rejected")), pct(rl.get("seq_frac_tis")), pct(rl.get("seq_frac_icepop")),
            pct(rl.get("seq_frac_geo")), pct(rl.get("seq_frac_k3")))


def reference_rows(cond: dict) -> list[tuple[str, tuple[str, ...]]]:
    """Your configuration and the known-good one against the reference."""
    vr = _d(cond.get("vs_reference"))
    return [(label, reference_cells(_d(vr.get(side)))) for side, label in (("user", "yours"), ("good", "known-good")) if side in vr]


def trial_reference(t: dict) -> dict:
    """A conditions trial's run against the reference (k3 mean, RL cost); {} when absent."""
    return _d(_d(t.get("metrics")).get("vs_reference"))


def localisation_rows(cond: dict, loc: dict | None = None) -> list[dict]:
    """The localisation's units as the report lists them: unit, local output equal or not,
    rel-L2 and max abs of the user's state against the good one (fed the same inputs).
    `loc`: one of several localisations (default: the section's `localisation`)."""
    loc = _d(loc if loc is not None else cond.get("localisation"))
    units = loc.get("units")
    out = []
    for u in units if isinstance(units, list) else []:
        if not isinstance(u, dict):
            continue
        eq = u.get("bitwise_equal")
        out.append({"unit": str(u.get("unit")), "equal": eq is True,
                    "state": "= equal" if eq is True else "≠ differs" if eq is False else "-",
                    "rel_l2": fmt(u.get("rel_l2")), "max_abs": fmt(u.get("max_abs"))})
    return out


def conditions_culprit_lines(r: dict | ReportView) -> list[tuple[str, str]]:
    """The answer of a conditions report: the guilty atoms with their evidence."""
    rv = view(r)
    cond = conditions_of(rv) or {}
    s = _d(cond.get("search"))
    verdict = s.get("verdict")
    names = [str(c) for c in cond.get("culprits") or []] if isinstance(cond.get("culprits"), list) else []
    by = {str(a.get("atom")): a for a in atoms_of(cond)}
    if verdict == "culprits" and names:
        out = []
        for n in names:
            a = by.get(n, {})
            out.append(("bold magenta", f"{n}: with only it in your state, k3 vs the known-good configuration is "
                                        f"{fmt(a.get('alone'))} (all of yours: {fmt(s.get('baseline'))})"))
        ev = [f"{CULPRIT_MARK} guilty setting" + ("s" if len(names) > 1 else ""), f"threshold {fmt(rv.threshold)}",
              f"{s.get('trials_used')} trials"]
        locs = localisations_of(cond)
        for loc in locs:
            it = "it" if len(locs) == 1 else str(loc.get("atom"))  # several: say whose units
            if loc.get("done") is True:
                named = loc.get("named") if isinstance(loc.get("named"), list) else []
                ev.append(f"units {it} changes: " + (", ".join(map(str, named)) or "none"))
            else:
                ev.append("not localised" if len(locs) == 1 else f"{it} not localised")
        out.append(("", " · ".join(ev)))
        return out
    if verdict == "aligned":
        return [("green", "aligned: your settings give the known-good configuration's log-probs"
                          + (" bitwise" if cond.get("bitwise_equal") is True else ""))]
    return [("yellow", f"{verdict}: {s.get('stop_reason')}")]


# -- engine_config (compare / run --engine-config) ------------------------------------------
def engine_config_of(r: dict | ReportView) -> dict | None:
    """The `engine_config` section (the user's vLLM settings and where each part ran); None
    when the report has none."""
    ec = view(r).r.get("engine_config")
    return ec if isinstance(ec, dict) else None


FINDING_STYLE = {"=": "green", "!!": "bold red", "!": "yellow", "?": "dim"}


def engine_config_finding(r: dict | ReportView) -> tuple[str, str, str]:
    """(mark, style, sentence): whether the module search (run in the hookable configuration)
    saw the numbers of the user's own configuration (`numbisect.report.sections.conditions.engine_config_finding`)."""
    rv = view(r)
    mark, sentence = engine_config_finding_of(engine_config_of(rv), rv.aligned, rv.value, rv.threshold)
    return mark, FINDING_STYLE[mark], sentence


def trials_note(r: dict | ReportView) -> str:
    """The Trials caption's end when the search ran in another configuration than the
    verdict's (--engine-config with a child): its trials' values are the hookable one's."""
    rv = view(r)
    ec = engine_config_of(rv)
    if ec is None or ec.get("child") is not True:
        return ""
    return f"; the trials ran in the hookable configuration (yours: {fmt(rv.value)}, the Overview)"


PARTS = {"tokens": "token comparison (log-probs, k3, KL, RL cost)", "units": "per-unit captures, self-check",
         "search": "module search, what-ifs"}


def engine_part_rows(ec: dict) -> list[tuple[str, str]]:
    """(part, where it ran: yours or hookable) for each part the section names."""
    parts = _d(ec.get("parts"))
    where = {"user": "your settings", "hookable": "hookable settings"}
    return [(PARTS.get(str(k), str(k)), where.get(v, v) if isinstance(v, str) else setting_text(v)) for k, v in parts.items()]


def engine_settings_rows(ec: dict) -> list[tuple[str, str, str, str]]:
    """(mark, setting, yours, hookable) for every setting either side gives or `changed`
    names, the changed ones first. Mark "≠": the hookable configuration changed it; "~":
    written out, the same in effect (a default, or custom ops in the states your engine
    reported); " ": equal. A setting one side leaves out reads "(not set)"."""
    user, hook = _d(ec.get("user")), _d(ec.get("hookable"))
    changed = {str(c) for c in ec.get("changed") or []} if isinstance(ec.get("changed"), list) else set()
    rows = []
    for k in sorted(set(user) | set(hook) | changed, key=str):
        a = setting_text(user[k]) if k in user else "(not set)"
        b = setting_text(hook[k]) if k in hook else "(not set)"
        mark = "≠" if str(k) in changed else " " if user.get(k, _UNSET) == hook.get(k, _UNSET) else "~"
        rows.append((mark, str(k), a, b))
    return sorted(rows, key=lambda x: {"≠": 0, "~": 1}.get(x[0], 2))


def engine_op_rows(ec: dict) -> tuple[list[str], list[str]]:
    """The custom ops the user's engine reported on and off ([] and [] when it did not say)."""
    ops = _d(ec.get("custom_ops"))

    def names(key):
        v = ops.get(key)
        return [setting_text(x) if not isinstance(x, str) else x for x in v] if isinstance(v, list) else []

    return names("enabled"), names("disabled")


# -- tokens --------------------------------------------------------------------------------
HEAT_CHARS = "▁▂▃▄▅▆▇█"


@dataclass
class TokenData:
    """Per-token k3 of every sample, and the masks of the token groups."""

    per_sample: list[dict]
    threshold: float
    trace_groups: dict[str, list[list[int]]] = field(default_factory=dict)  # group -> per sample 0/1 per token
    token_ids: list[list[int]] | None = None
    note: str = ""  # why trace groups are missing, if they are

    @property
    def groups(self) -> list[str]:
        return ["completion", "prompt", "all", *sorted(self.trace_groups)]

    def mask(self, i: int, group: str) -> list[bool]:
        """Over the predicted positions j (token j+1) of sample i."""
        ps = self.per_sample[i]
        n, p = len(ps["k3"]), ps["prompt_len"]
        if group == "completion":
            return [j + 1 >= p for j in range(n)]
        if group == "prompt":
            return [j + 1 < p for j in range(n)]
        if group == "all":
            return [True] * n
        flags = self.trace_groups.get(group)
        if flags is None:
            return [False] * n
        f = flags[i][1:]
        return [bool(f[j]) if j < len(f) else False for j in range(n)]

    def k3(self, i: int) -> list[float | None]:
        """Sample i's per-token k3 as floats ("inf"/"nan" strings read as such; None kept)."""
        return [num(v) for v in self.per_sample[i]["k3"]]

    def values(self, i: int, group: str) -> list[float]:
        return [v for v, m in zip(self.k3(i), self.mask(i, group)) if m and v is not None]

    def level(self, v: float) -> int:
        """0..7 by decade around the threshold t: level L < t*10**(L-3); 7 is >= 1000 t
        (and NaN, which is worse than any number)."""
        if math.isnan(v):
            return 7
        if v <= 0 or not self.threshold > 0:
            return 0
        if math.isinf(v) or math.isinf(self.threshold):
            return 7 if math.isinf(v) else 0
        return max(0, min(7, math.floor(math.log10(v / self.threshold)) + 4))

    def scale(self) -> str:
        t = self.threshold
        parts = [f"{HEAT_CHARS[L]}<{fmt(t * 10.0 ** (L - 3), 0)}" for L in range(7)]
        return " ".join(parts + [f"{HEAT_CHARS[7]}>={fmt(t * 1e3, 0)}", "·=not in group"])

    def worst(self, group: str, k: int = 10) -> list[dict]:
        rows = []
        for i, ps in enumerate(self.per_sample):
            for j, (v, m) in enumerate(zip(self.k3(i), self.mask(i, group))):
                if m and v is not None:
                    tid = self.token_ids[i][j + 1] if self.token_ids and i < len(self.token_ids) and j + 1 < len(self.token_ids[i]) else None
                    rows.append({"sample": ps["sample"], "position": j + 1, "token_id": tid, "value": v})
        # NaN first (worst), then by value
        rows.sort(key=lambda d: (not math.isnan(d["value"]), -d["value"] if not math.isnan(d["value"]) else 0.0, d["sample"], d["position"]))
        return rows[:k]


def _resolve(path: str, report_path: str | None) -> Path | None:
    p = Path(path)
    cands = [p]
    if report_path and not p.is_absolute():
        base = Path(report_path).resolve().parent
        cands += [base / p, base.parent / p, base.parent.parent / p]
    for c in cands:
        try:
            if c.is_file():
                return c
        except (OSError, ValueError):  # a name the OS refuses (NUL, too long)
            continue
    return None


def _flags_ok(flags, n: int) -> bool:
    return isinstance(flags, list) and len(flags) == n and all(isinstance(f, int) and not isinstance(f, bool) for f in flags)


def _trace_rows(data: bytes) -> list[dict] | None:
    """The trace's JSONL rows (prompt_ids, completion_ids, groups), or None when they
    are not ones the groups can be read from (another format, odd shapes)."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        return None
    rows = []
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):
            return None
        if not isinstance(row, dict):
            return None
        ids = [row.get("prompt_ids", []), row.get("completion_ids", [])]
        if not all(isinstance(x, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in x) for x in ids):
            return None
        groups = row.get("groups") or {}
        n = len(ids[0]) + len(ids[1])
        if not isinstance(groups, dict) or not all(isinstance(k, str) and _flags_ok(v, n) for k, v in groups.items()):
            return None
        rows.append(row)
    return rows


def token_data(r: dict | ReportView, report_path: str | None = None) -> TokenData:
    """The report's per-token k3; trace groups when the trace file (same sha256) is found
    and is a JSONL trace whose groups cover every token (otherwise a note says why not)."""
    rv = view(r)
    td = TokenData(per_sample=rv.per_sample, threshold=num(rv.threshold) or 0.0)
    tr = rv.trace
    want = [g for g in tr.get("groups") or [] if g not in ("completion", "prompt", "all")]
    found = _resolve(tr["path"], report_path)
    if found is None:
        if want:
            td.note = f"trace {tr['path']} not found: groups {', '.join(want)} unavailable"
        return td
    where = printable(found)
    try:
        data = read_bytes(found, "trace")
    except InputError as e:
        td.note = printable(f"{e.message}: trace groups not shown")
        return td
    if hashlib.sha256(data).hexdigest() != tr.get("sha256"):
        td.note = f"trace {where} differs from the one in the report: trace groups not shown"
        return td
    rows = _trace_rows(data)
    if rows is None:
        td.note = f"trace {where}: not a JSONL trace with readable groups; trace groups not shown"
        return td
    if len(rows) != len(td.per_sample):
        return td
    names = sorted({g for row in rows for g in (row.get("groups") or {})})
    ids = [list(row.get("prompt_ids", [])) + list(row.get("completion_ids", [])) for row in rows]
    td.token_ids = ids
    for g in names:
        td.trace_groups[printable(g)] = [list((row.get("groups") or {}).get(g) or [0] * len(i)) for row, i in zip(rows, ids)]
    return td

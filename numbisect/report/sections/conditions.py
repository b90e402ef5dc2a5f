"""The text of a report's `conditions` section (`bisect conditions`) and `engine_config`
section (`compare` / `run --engine-config`): torch-free, read by `numbisect.report.summary` for the
summary and `bisect report show`, `report md` and the TUI."""

from __future__ import annotations

from numbisect.common.formatting import fmt, num


def _pct(x) -> str:
    return f"{100 * x:.1f}%" if isinstance(x, (int, float)) and not isinstance(x, bool) else fmt(x)


def conditions_lines(cond) -> list[str]:
    """One line per finding: the search, both configurations against the reference (RL cost),
    each atom (culprit, changes log-probs, or bitwise invariant here), the localisation."""
    if not isinstance(cond, dict):
        return []
    out = ["engine conditions: your settings against the known-good configuration"]
    s = _d(cond.get("search"))
    out.append(f"  search: {s.get('verdict')} after {s.get('trials_used')} trials: {s.get('stop_reason')}")
    vr = _d(cond.get("vs_reference"))  # every field read is type-checked: a report is anyone's file
    for side in ("user", "good"):
        r = _d(vr.get(side))
        rl = _d(r.get("rl_cost"))
        k3 = _d(_d(r.get("groups")).get("completion")).get("k3_mean")
        out.append(f"  {side:<4} vs reference: completion k3 mean {fmt(k3)}, sequences rejected {_pct(rl.get('seq_frac_rejected'))}"
                   f" (TIS {_pct(rl.get('seq_frac_tis'))}, IcePop {_pct(rl.get('seq_frac_icepop'))}, geo-mean {_pct(rl.get('seq_frac_geo'))},"
                   f" seq k3 {_pct(rl.get('seq_frac_k3'))})")
    for a in _l(cond.get("atoms")):
        if not isinstance(a, dict):
            continue
        tag = ("CULPRIT" if a.get("culprit") else "bitwise invariant here" if a.get("bitwise_invariant")
               else "not measured" if a.get("alone") is None else "changes log-probs")
        ref = _d(_d(a.get("vs_reference")).get("rl_cost"))
        out.append(f"  {str(a.get('atom')):<28} alone: k3 {fmt(a.get('alone'))}, {tag}; {a.get('description')}"
                   + (f"; vs reference: sequences rejected {_pct(ref.get('seq_frac_rejected'))}" if ref else ""))
    for loc in localisations_of(cond):
        if loc.get("done"):
            out.append(f"  under {loc.get('atom')}: units {localised_what(loc)}: {', '.join(map(str, _l(loc.get('named')))) or 'none'}")
            chain = chained_line(loc.get("units_chained"))
            if chain:
                out.append(f"  {chain}")
        else:
            out.append(f"  under {loc.get('atom')}: not localised ({loc.get('why')})")
    return out


def localisations_of(cond) -> list[dict]:
    """Every localisation of a conditions section: `localisations` when several culprits
    were localised, else the one `localisation`; [] when none (or not objects)."""
    if not isinstance(cond, dict):
        return []
    many = cond.get("localisations")
    if isinstance(many, list) and any(isinstance(x, dict) for x in many):
        return [x for x in many if isinstance(x, dict)]
    one = cond.get("localisation")
    return [one] if isinstance(one, dict) and one else []


def chained_line(ch) -> str | None:
    """How much of the compiled path the units compiled alone reproduce, in one line."""
    if not isinstance(ch, dict) or num(ch.get("k3")) is None:
        return None
    path, ratio = num(ch.get("compiled_path_k3")), num(ch.get("ratio"))
    tail = ""
    if path is not None and ratio is not None and 0 <= ratio < float("inf"):
        why = ("the named units account for it" if 0.5 <= ratio <= 2 else
               "most of it is across units (fusions, the glue between them)" if ratio < 0.5 else
               "the units alone round more than the whole graph does")
        tail = f"; the compiled path alone: k3 {fmt(path)} (ratio {ratio:.2f}: {why})"
    return f"every leaf unit compiled alone, chained on the engine's own inputs: k3 {fmt(num(ch.get('k3')))} against eager{tail}"


def localised_what(loc: dict) -> str:
    """What the named units of a localisation are: under the compiled path, units whose code
    compiled alone differs from its eager code; under model_impl, units whose code differs
    between vLLM's transformers backend and its own implementation; under a custom op, units
    whose local output differs when fed the good state's inputs."""
    if loc.get("compiled_units") is not None:
        return "whose code compiled alone differs"
    if loc.get("atom") == "model_impl":
        return "whose code differs between vLLM's transformers backend and its own (fed the same inputs)"
    return "whose local output differs"


def _d(x) -> dict:
    return x if isinstance(x, dict) else {}


def _l(x) -> list:
    return x if isinstance(x, list) else []


def engine_config_finding(ec, aligned: bool, value, threshold) -> tuple[str, str]:
    """(mark, sentence): whether the module search, run in the hookable configuration, saw
    the numbers of the user's own configuration (the one the verdict judges). Mark "=":
    exactly; "!!": the user's settings alone diverge (the search cannot find it); "!": near
    them, not them; "?": not compared."""
    ec = _d(ec)
    if ec.get("child") is not True:
        return "=", ("your settings run with hooks as they are: the token comparison, the captures and the search all "
                     "ran in them; the module search sees exactly your numbers")
    vs, hb = _d(ec.get("hookable_vs_user")), _d(ec.get("hookable_baseline"))
    if vs.get("bitwise") is True:
        return "=", "the hookable configuration's log-probs are bitwise equal to yours: the module search sees exactly your numbers"
    if not aligned and hb.get("verdict") == "aligned":
        return "!!", (f"your settings alone diverge: yours {fmt(value)} > {fmt(threshold)}, the hookable configuration's "
                      f"{fmt(hb.get('value'))} is under it; the module search runs in the hookable one and cannot find it: "
                      f"`bisect conditions --engine-config {ec.get('file') or 'FILE'}` names the setting")
    if vs.get("bitwise") is False:
        return "!", (f"the hookable configuration's log-probs differ from yours (k3 {fmt(vs.get('k3_mean'))}, max |diff| "
                     f"{fmt(vs.get('max_abs_diff'))}): the module search sees numbers near yours, not yours")
    return "?", "the hookable configuration's log-probs were not compared with yours"


def engine_config_lines(v) -> list[str]:
    """A report's `engine_config` section (`compare` / `run --engine-config`), for the summary
    and `bisect report show`: which parts ran in the user's configuration and which in the
    hookable one, then whether the module search saw the user's numbers."""
    ec = v.r.get("engine_config")
    if not isinstance(ec, dict):
        return []
    src = f" ({ec.get('file')})" if ec.get("file") else ""
    mark, sentence = engine_config_finding(ec, v.aligned, v.value, v.threshold)
    if ec.get("child") is not True:
        return [f"engine config{src}: {sentence}"]
    changed = ", ".join(map(str, ec.get("changed") if isinstance(ec.get("changed"), list) else [])) or "nothing"
    hb = _d(ec.get("hookable_baseline"))
    return [f"engine config: token metrics in your settings{src} (child process); captures and search in the hookable one "
            f"(changed: {changed}), {hb.get('verdict', '?')} against the reference (value {fmt(hb.get('value'))})",
            f"{'  ' if mark == '=' else mark + ' '}{sentence}"] + user_modes_lines(_d(ec.get("engine_modes")))


def user_modes_lines(em: dict) -> list[str]:
    """Decode mode: the user's engine's decode run against its own prefill run (completion k3)."""
    if not em:
        return []
    dvp = _d(em.get("decode_vs_prefill"))
    lp = _d(dvp.get("logprob_diff"))

    def k3(sec):
        return fmt(_d(_d(_d(sec).get("groups")).get("completion")).get("k3_mean"))

    frac = num(lp.get("frac_equal"))  # a report's number: an integer too large for a float is an infinity here
    same = f"{100 * frac:.1f}%" if frac is not None and 0 <= frac <= 1 else "?"
    return [f"  in your settings, completion k3 mean: decode vs reference {k3(em.get('decode_vs_reference'))}, prefill vs "
            f"reference {k3(em.get('prefill_vs_reference'))}, decode vs prefill {k3(dvp)} (max |diff| "
            f"{fmt(lp.get('max_abs'))}, identical on {same} of {lp.get('tokens', 0)} completion tokens)"]

"""Text lines for a decode-mode report's `engine_modes` section (from the report alone;
numbisect.pipeline.decode computes the section; read through `numbisect.report.view`). Torch-free,
for `bisect report show` and `md`."""

from __future__ import annotations

from numbisect.common.formatting import fmt, num
from numbisect.report.view import ReportView, view


def render_lines(r: dict | ReportView) -> list[str]:
    """Summary lines for a decode-mode report (nothing for other reports)."""
    v = view(r)
    em = v.engine_modes
    if not em or em.get("mode") != "decode":
        return []
    metric = v.settings.get("metric", "k3-mean")
    dvp = em["decode_vs_prefill"]

    def k3(sec, g="completion"):
        v = (sec or {}).get("groups", {}).get(g) or {}
        return fmt(v.get("k3_mean"))

    lp = dvp.get("logprob_diff") or {}
    fu = dvp.get("first_unit") or {}
    ns = em.get("not_swappable") or {}
    ec = v.r.get("engine_config")
    where = ("; below the hookable configuration's runs, yours are in the engine config line"
             if isinstance(ec, dict) and ec.get("child") is True else "")
    out = [
        f"engine mode: decode (prompt prefilled, completion decoded one token per step, every token forced to the trace's){where}",
        f"  completion k3 mean: decode vs reference {k3(em.get('decode_vs_reference'))}, prefill vs reference "
        f"{k3(em.get('prefill_vs_reference'))}, decode vs prefill (same engine) {k3(dvp)}",
        f"  decode vs prefill log-probs: max |diff| {fmt(lp.get('max_abs'))}, identical on "
        f"{100 * lp.get('frac_equal', 0):.1f}% of {lp.get('tokens', 0)} completion tokens; first unit not bitwise equal: "
        f"{fu.get('bitwise') or 'none'}",
    ]
    dec = num((em.get("decode_vs_reference") or {}).get("value"))
    pre = num((em.get("prefill_vs_reference") or {}).get("value"))
    own = num(dvp.get("value"))
    if dec is not None and pre is not None and own is not None:
        out.append("  " + _attribution(dec, pre, own, metric))
    if ns.get("units"):
        kinds = ", ".join(ns.get("kinds") or [])
        out.append(f"  not swappable in decode mode: {len(ns['units'])} units ({kinds}): {ns.get('reason', '')}")
    return out


def markdown_lines(r: dict | ReportView) -> list[str]:
    """The same, as a Markdown paragraph and list (for `bisect report md`)."""
    lines = render_lines(r)
    if not lines:
        return []
    head = "**Engine in decode mode**: prompt prefilled, completion decoded one token per step, every token forced to the trace's."
    return ["", head, ""] + [f"- {ln.strip()}" for ln in lines[1:]]


def _attribution(dec: float, pre: float, own: float, metric: str) -> str:
    if own == 0:
        return f"decode and prefill give the same log-probs: the {metric} against the reference is the same on either path"
    if own >= 0.5 * dec:
        return f"decode differs from prefill by {fmt(own)} ({metric}), a large part of the mismatch: look at the decode kernels"
    return f"decode differs from prefill by only {fmt(own)} ({metric}); the mismatch is mostly present in prefill as well"

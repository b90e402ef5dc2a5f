"""`bisect report plot`: a report's two pictures, drawn with matplotlib from the report alone.

1. `depth_series(r)`: the per-unit error along the depth (unit order as the report lists
   it): propagated and local relative L2 error, and the units to mark (the culprits; a
   systematic culprit's units; a `conditions` report's culprit setting, whose localisation
   gives one series: your settings against the known-good ones).
2. `trial_series(r)`: the search's trials: the judged value per trial, its role
   (baseline, all swapped, search), and the threshold.
3. `figure(r)`: a matplotlib `Figure` with one axes per picture the report has data for;
   `write(r, path)` saves it as PNG or SVG (by the suffix), atomically.

matplotlib is an optional extra (`pip install 'numbisect[plot]'`), imported only here,
inside the functions that draw, with the Agg canvas (no display needed); without it
`require()` raises one InputError line (exit 2). Log scales cannot show 0 (a bitwise equal
unit, a trial at the floor): such points sit on a bottom line, drawn hollow, labelled "0".
Torch-free (the report layer): reads report dicts through `numbisect.report.view`.
"""

from __future__ import annotations

import io
import math
import os
from pathlib import Path
from urllib.parse import quote

from numbisect.common.errors import InputError
from numbisect.common.formatting import fmt, num
from numbisect.common.safeio import write_bytes_atomic
from numbisect.report.view import ReportView, get, rel, typed_trials, view

FORMATS = {".png": "png", ".svg": "svg"}
MAX_LABELS = 64  # unit names on the depth axis; beyond this only each layer's first unit is named
MAX_NAMED = 4  # culprits named one by one on the depth axes; more are named as one line


def require():
    """The matplotlib module, or one clear InputError line when it is not installed."""
    try:
        import matplotlib  # lazy: an optional extra (numbisect[plot])
    except ImportError:
        raise InputError("bisect report plot needs matplotlib, which is not installed",
                         hint="pip install 'numbisect[plot]' (or: pip install matplotlib)") from None
    return matplotlib


def plot_format(path: str | os.PathLike) -> str:
    """'png' or 'svg' from the file's suffix; anything else is one InputError line."""
    fmt_ = FORMATS.get(Path(path).suffix.lower())
    if fmt_ is None:
        raise InputError(f"cannot tell the image format of {os.fsdecode(path)!r}: name it .png or .svg")
    return fmt_


# -- what is drawn: plain data, no matplotlib ---------------------------------------------------
def _finite(x) -> float | None:
    x = num(x)
    return x if x is not None and math.isfinite(x) else None


def depth_series(r: dict | ReportView) -> dict | None:
    """Units along the depth: names, kinds, propagated and local rel-L2 (None where not
    measured), the indices of the units to mark and their label; None when the report has
    no per-unit measures."""
    v = view(r)
    units = v.units
    if units:
        names = [u["name"] for u in units]
        marked = [c["unit"] for c in v.named_culprits]
        sy = v.systematic  # {kinds, units (a count), layers, value, ...}: every unit of those kinds
        kinds = [k for k in sy.get("kinds") or [] if isinstance(k, str)] if isinstance(sy.get("kinds"), list) else []
        marked += [u["name"] for u in units if u.get("kind") in kinds]
        idx = sorted({names.index(m) for m in marked if m in names})
        if kinds:
            label = f"systematic culprit: kind {', '.join(kinds)} ({len(idx)} units)"
        elif len(idx) > MAX_NAMED:
            label = f"culprits: {len(idx)} units"
        else:
            label = "culprit: " + ", ".join(f"{names[i]} ({units[i].get('kind')})" for i in idx) if idx else None
        return {"names": names, "kinds": [u.get("kind") for u in units], "title": "Per-unit error along the depth",
                "series": {"propagated": [_finite(rel(u, "propagated")) for u in units],
                           "local": [_finite(rel(u, "local")) for u in units]},
                "marked": idx, "label": label}
    loc = get(v.r, "conditions", "localisation")
    lu = [u for u in (get(loc, "units") or []) if isinstance(u, dict) and isinstance(u.get("unit"), str)]
    if lu:
        atom = loc.get("atom")
        names = [u["unit"] for u in lu]
        return {"names": names, "kinds": [None] * len(names),
                "title": f"Per-unit error along the depth: your settings vs the known-good ones ({atom} localised)",
                "series": {"propagated": [_finite(u.get("rel_l2")) for u in lu]},
                "marked": [i for i, u in enumerate(lu) if u.get("bitwise_equal") is False],
                "label": f"culprit: {atom} (units not bitwise equal)"}
    return None


def trial_series(r: dict | ReportView) -> dict | None:
    """The search's trials: index, judged value, role, swapped count; the threshold and the
    metric's name; None when the report has no trials."""
    v = view(r)
    trials, s = v.trials, v.search or {}
    metric = f"{v.metric or 'value'} ({v.group or 'completion'} tokens)"
    threshold = num(v.threshold)
    if not trials:
        c = get(v.r, "conditions")
        trials = typed_trials(get(c, "trials"))
        s = get(c, "search") or {}
        threshold = num(s.get("threshold"))
        metric = f"{v.metric or 'value'} vs the known-good settings"
    if not trials:
        return None
    return {"index": [t.get("index", i) for i, t in enumerate(trials)],
            "value": [_finite(t.get("value")) for t in trials],
            "role": [str(t.get("role") or "search") for t in trials],
            "swapped": [len(t["swapped"]) for t in trials],
            "threshold": threshold if threshold is not None and math.isfinite(threshold) else None,
            "metric": metric, "strategy": s.get("strategy"), "stop_reason": s.get("stop_reason")}


# -- drawing ----------------------------------------------------------------------------------
def _floor(values) -> float:
    """Where zeros sit on a log axis: a decade under the smallest positive value."""
    pos = [x for x in values if x is not None and x > 0]
    return 10 ** math.floor(math.log10(min(pos)) - 1) if pos else 1e-8


def _draw_depth(ax, d: dict) -> None:
    names = d["names"]
    xs = list(range(len(names)))
    allv = [x for s in d["series"].values() for x in s]
    floor = _floor(allv)
    styles = {"propagated": ("o", "-", "tab:blue"), "local": ("s", "--", "tab:orange")}
    for key, ys in d["series"].items():
        marker, ls, color = styles[key]
        name = f"{key} rel-L2" if len(d["series"]) > 1 else "rel-L2"
        pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
        ax.plot([x for x, _ in pts], [max(y, floor) for _, y in pts], ls=ls, marker=marker, ms=4, color=color, label=name)
        zeros = [x for x, y in pts if y == 0]
        if zeros:
            ax.plot(zeros, [floor] * len(zeros), ls="none", marker=marker, ms=7, mfc="white", color=color,
                    label=f"{name} 0 (bitwise equal), drawn at {fmt(floor)}")
    ax.set_yscale("log")
    for n, i in enumerate(d["marked"]):
        ax.axvline(i, color="tab:red", alpha=0.35, lw=6, label=d["label"] if n == 0 else None)
    if d["marked"] and d["label"]:
        top = max([y for y in allv if y is not None] + [floor])
        ax.annotate(d["label"], xy=(d["marked"][0], top), xytext=(4, -4), textcoords="offset points",
                    color="tab:red", fontsize=9, va="top")
    if len(names) <= MAX_LABELS:
        ax.set_xticks(xs, names, rotation=90, fontsize=7)
    else:  # each layer's first unit only
        firsts = [i for i, n in enumerate(names) if i == 0 or n.split(".")[:2] != names[i - 1].split(".")[:2]]
        ax.set_xticks(firsts, [names[i] for i in firsts], rotation=90, fontsize=7)
    ax.set_xlabel("unit (model order, input to output)")
    ax.set_ylabel("relative L2 error vs reference (log)")
    ax.set_title(d["title"])
    ax.grid(True, which="major", axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="best", framealpha=0.8)


def _draw_trials(ax, t: dict) -> None:
    vals = [y for y in t["value"] if y is not None]
    floor = _floor(vals + ([t["threshold"]] if t["threshold"] else []))
    colors = {"baseline": "tab:red", "all-swapped": "tab:green"}
    others = iter(["tab:blue", "tab:purple", "tab:orange", "tab:brown", "tab:cyan", "tab:olive", "tab:pink", "tab:gray"])
    for role in dict.fromkeys(t["role"]):
        colors.setdefault(role, next(others, "tab:blue"))
    for role in dict.fromkeys(t["role"]):
        pts = [(x, y) for x, y, r in zip(t["index"], t["value"], t["role"]) if r == role and y is not None]
        if not pts:
            continue
        ax.plot([x for x, _ in pts], [max(y, floor) for _, y in pts], ls="none", marker="o", ms=6,
                color=colors[role], label=role)
    zeros = [x for x, y in zip(t["index"], t["value"]) if y == 0]
    if zeros:
        ax.plot(zeros, [floor] * len(zeros), ls="none", marker="o", ms=10, mfc="none", color="black", label=f"0, drawn at {fmt(floor)}")
    if t["threshold"]:
        ax.axhline(t["threshold"], color="black", ls=":", label=f"threshold {fmt(t['threshold'])}")
    ax.set_yscale("log")
    ax.set_xlim(min(t["index"]) - 0.5, max(t["index"]) + 0.5)
    ax.set_xticks(t["index"] if len(t["index"]) <= 40 else t["index"][::max(1, len(t["index"]) // 20)])
    ax.set_xlabel("trial")
    ax.set_ylabel(t["metric"] + " (log)")
    ax.set_title("The search's trials" + (f" ({t['strategy']})" if t["strategy"] else ""))
    ax.grid(True, which="major", axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="best", framealpha=0.8)


def figure(r: dict | ReportView):
    """The report's figure (a matplotlib Figure on the Agg canvas): the depth axes, the
    trials axes, or both; InputError when the report has neither."""
    require()
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # lazy: an optional extra (numbisect[plot])
    from matplotlib.figure import Figure  # lazy: an optional extra (numbisect[plot])

    v = view(r)
    d, t = depth_series(v), trial_series(v)
    panels = [p for p in ((_draw_depth, d), (_draw_trials, t)) if p[1]]
    if not panels:
        raise InputError(f"nothing to plot: this {v.kind or 'report'} report has no per-unit errors and no trials")
    fig = Figure(figsize=(10, 4.8 * len(panels)), layout="constrained")
    FigureCanvasAgg(fig)
    for ax, (draw, data) in zip(fig.subplots(len(panels), 1, squeeze=False)[:, 0], panels):
        draw(ax, data)
    fig.suptitle(f"numbisect {v.kind or ''} report: {v.verdict or '?'}, {v.metric or 'value'} {fmt(num(v.value))}"
                 f" (threshold {fmt(num(v.threshold))})", fontsize=10)
    return fig


def render(r: dict | ReportView, fmt_: str = "png") -> bytes:
    """The figure as PNG or SVG bytes (SVG keeps its text as text, so it can be searched)."""
    matplotlib = require()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "numbisect", "path.simplify": True}):
        fig = figure(r)
        buf = io.BytesIO()
        meta = {"Software": None} if fmt_ == "png" else {"Date": None}
        fig.savefig(buf, format=fmt_, dpi=100, metadata=meta)
    return buf.getvalue()


def plot_link(markdown: str, path: str | os.PathLike) -> str:
    """`bisect report md --plot`: the Markdown with the figure linked under its verdict line
    (the path as given, percent-encoded, so no character of it is markup)."""
    lines = markdown.split("\n")
    at = 3 if len(lines) > 3 and lines[0].startswith("### ") else 0
    link = f"![numbisect: per-unit error and trials]({quote(os.fsdecode(path))})"
    return "\n".join(lines[:at] + ["", link] + lines[at:])


def write(r: dict | ReportView, path: str | os.PathLike) -> None:
    """Draw the report's figure into `path` (.png or .svg), atomically."""
    write_bytes_atomic(path, render(r, plot_format(path)))

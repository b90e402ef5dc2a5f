"""Two GRPO runs' per-step figures side by side: an SVG plot (written by hand, no plotting
library) and a Markdown table, from the JSON files `examples/trl_grpo.py --json` writes.

    python scripts/plot_training_loop.py BUG.json FIXED.json --svg docs/how-to/training-loop.svg [--table]

Three panels, one per figure (TRL's mismatch `sampling/sampling_logp_difference/mean`, its
mean importance-sampling ratio, the reward); in each, the run with the planted sync bug in
red, the fixed run in blue, the step where the trigger fired marked with a ring.
"""

from __future__ import annotations

import argparse
import json
from html import escape

PANELS = (("mismatch", "mismatch (mean |logp trainer - logp vLLM|)"), ("is_ratio", "mean importance-sampling ratio"),
          ("reward", "reward"))
RUNS = (("#c0392b", "sync bug planted"), ("#2471a3", "sync fixed"))
W, H, PAD_L, PAD_R, PAD_T, PAD_B, GAP = 300, 210, 58, 14, 30, 34, 20


def _ticks(lo: float, hi: float) -> list[float]:
    return [lo + (hi - lo) * i / 4 for i in range(5)]


def panel(x0: float, key: str, title: str, runs: list[dict]) -> list[str]:
    """One panel's SVG elements at x offset x0."""
    vals = [r[key] for run in runs for r in run["rows"] if r[key] is not None]
    steps = [r["step"] for run in runs for r in run["rows"]]
    lo, hi = min(vals), max(vals)
    if key == "is_ratio":
        lo, hi = min(lo, 1.0), max(hi, 1.0)
    span = (hi - lo) or abs(hi) or 1.0
    lo, hi = lo - 0.05 * span, hi + 0.05 * span
    s0, s1 = min(steps), max(steps)
    pw, ph = W - PAD_L - PAD_R, H - PAD_T - PAD_B

    def px(step):
        return x0 + PAD_L + (step - s0) / ((s1 - s0) or 1) * pw

    def py(v):
        return PAD_T + (hi - v) / (hi - lo) * ph

    out = [f'<text x="{x0 + PAD_L + pw / 2:.1f}" y="16" text-anchor="middle" font-size="12">{escape(title)}</text>',
           f'<rect x="{x0 + PAD_L}" y="{PAD_T}" width="{pw}" height="{ph}" fill="none" stroke="#888"/>']
    for t in _ticks(lo, hi):
        out.append(f'<line x1="{x0 + PAD_L - 3}" x2="{x0 + PAD_L}" y1="{py(t):.1f}" y2="{py(t):.1f}" stroke="#888"/>')
        out.append(f'<text x="{x0 + PAD_L - 5}" y="{py(t) + 3:.1f}" text-anchor="end" font-size="9">{t:.3g}</text>')
    for s in range(s0, s1 + 1):
        out.append(f'<text x="{px(s):.1f}" y="{PAD_T + ph + 13}" text-anchor="middle" font-size="9">{s}</text>')
    out.append(f'<text x="{x0 + PAD_L + pw / 2:.1f}" y="{H - 6}" text-anchor="middle" font-size="10">GRPO step</text>')
    if key == "is_ratio" and lo < 1.0 < hi:
        out.append(f'<line x1="{x0 + PAD_L}" x2="{x0 + PAD_L + pw}" y1="{py(1.0):.1f}" y2="{py(1.0):.1f}" stroke="#bbb" stroke-dasharray="3,3"/>')
    for (color, _), run in zip(RUNS, runs):
        pts = [(px(r["step"]), py(r[key])) for r in run["rows"] if r[key] is not None]
        out.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.8" points="{" ".join(f"{x:.1f},{y:.1f}" for x, y in pts)}"/>')
        for r in run["rows"]:
            if r[key] is None:
                continue
            out.append(f'<circle cx="{px(r["step"]):.1f}" cy="{py(r[key]):.1f}" r="2.5" fill="{color}"/>')
            if r.get("fired"):
                out.append(f'<circle cx="{px(r["step"]):.1f}" cy="{py(r[key]):.1f}" r="6" fill="none" stroke="{color}" stroke-width="1.5"/>')
    return out


def svg(runs: list[dict]) -> str:
    width = len(PANELS) * W + (len(PANELS) - 1) * GAP
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{H + 24}" font-family="sans-serif">',
             f'<rect width="{width}" height="{H + 24}" fill="white"/>']
    for i, (key, title) in enumerate(PANELS):
        parts += panel(i * (W + GAP), key, title, runs)
    x = PAD_L
    for color, label in RUNS:
        parts.append(f'<line x1="{x}" x2="{x + 18}" y1="{H + 14}" y2="{H + 14}" stroke="{color}" stroke-width="2"/>')
        parts.append(f'<text x="{x + 22}" y="{H + 18}" font-size="10">{escape(label)}</text>')
        x += 150
    parts.append(f'<circle cx="{x + 6}" cy="{H + 14}" r="6" fill="none" stroke="#333"/>')
    parts.append(f'<text x="{x + 16}" y="{H + 18}" font-size="10">trigger fired (bundle written)</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def table(runs: list[dict]) -> str:
    """Markdown: one row per step, both runs' mismatch / IS ratio / reward / weight verdict."""
    bug, fixed = ({r["step"]: r for r in run["rows"]} for run in runs)
    head = ("| step | mismatch, bug | mismatch, fixed | IS ratio, bug | IS ratio, fixed | reward, bug | reward, fixed "
            "| weight check after TRL's sync, bug |\n|---:|---:|---:|---:|---:|---:|---:|:---|\n")
    rows = []
    for s in sorted(set(bug) | set(fixed)):
        b, f = bug.get(s, {}), fixed.get(s, {})

        def v(r, k, spec=".3g"):
            return "-" if r.get(k) is None else format(r[k], spec)

        verdict = b.get("weights") or "-"
        if b.get("weights") and b["weights"] != "ok":
            units = [u.rsplit(" ", 1) for u in b["weights"].split(", ")]
            verdict = f"layers.2.* {units[0][1]} ({len(units)} units)" if all(u[0].startswith("layers.2.") for u in units) else b["weights"]
        rows.append(f"| {s}{' (fired)' if b.get('fired') else ''} | {v(b, 'mismatch')} | {v(f, 'mismatch')} | {v(b, 'is_ratio', '.4f')} "
                    f"| {v(f, 'is_ratio', '.4f')} | {v(b, 'reward')} | {v(f, 'reward')} | {verdict} |")
    return head + "\n".join(rows) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bug")
    ap.add_argument("fixed")
    ap.add_argument("--svg", required=True)
    ap.add_argument("--table", action="store_true", help="also print the Markdown table")
    a = ap.parse_args(argv)
    runs = [json.load(open(p)) for p in (a.bug, a.fixed)]
    with open(a.svg, "w") as f:
        f.write(svg(runs))
    if a.table:
        print(table(runs), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Numbers as report text: `fmt` (a metric, 2 significant digits in e-notation when small
or large) and `pct` (a fraction as a percentage); `num` reads a report's number. A value that is not a number (a hostile
report's) is shown printable, as it is.

Torch-free and UI-free: the text reports (numbisect.report.summary, numbisect.report.tools,
numbisect.report.sections), the TUI and the core's progress lines all import these.
"""

from __future__ import annotations

import math

from numbisect.common.textsafe import clip, printable


def fmt(x, digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, str):
        return printable(x)
    if isinstance(x, bool) or not isinstance(x, (int, float)):  # a hostile report's value, shown as it is
        return printable(x)
    if x == 0:
        return "0"
    try:
        return f"{x:.{digits}e}" if abs(x) < 1e-2 or abs(x) >= 1e4 else f"{x:.{digits + 2}g}"
    except OverflowError:  # an integer too large for a float
        return printable(clip(x, 40))


def pct(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return printable(clip(x, 40))
    try:
        return f"{100 * x:.1f}%"
    except OverflowError:
        return printable(clip(x, 40))


def num(x) -> float | None:
    """A report number as a float, the one reader of a report's numbers (text, Markdown,
    diff, routing lines, TUI): None stays None, a bool is None, a number string
    ("inf", "-inf", "nan" as the report stores non-finite floats, or "1e-3") becomes a
    float, an integer too large for a float becomes an infinity; anything else is None."""
    if x is None or isinstance(x, bool):
        return None
    if isinstance(x, int):
        return float(x) if abs(x) < 2**1023 else (math.inf if x > 0 else -math.inf)
    if isinstance(x, float):
        return x
    if isinstance(x, str):
        try:
            return float(x)
        except ValueError:
            return None
    return None

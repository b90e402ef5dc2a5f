"""`--threshold` text: a number at or above 0, `floor` or `floorxN` (N times the calibrated
noise floor). Torch-free: the CLI parses it while reading its arguments; the floor itself
is measured later (numbisect.commands.calibrate.resolve_threshold)."""

from __future__ import annotations

import math
import re

from numbisect.common.errors import InputError

_FLOOR = re.compile(r"^floor(?:x(?P<n>.+))?$")


def parse_threshold(text: str) -> tuple[float | None, float | None]:
    """(number, None) for a plain threshold, (None, factor) for floor / floorxN."""
    text = str(text).strip()
    m = _FLOOR.match(text)
    if m:
        n = m.group("n")
        if n is None:
            return None, 1.0
        try:
            factor = float(n)
        except ValueError:
            factor = math.nan
        if not (factor > 0 and math.isfinite(factor)):
            raise InputError(f"bad --threshold {text!r}: floorxN needs a positive number N, e.g. floorx10")
        return None, factor
    try:
        v = float(text)
    except ValueError:
        raise InputError(f"bad --threshold {text!r}: give a number, floor, or floorxN (e.g. floorx10)") from None
    if not (v >= 0 and math.isfinite(v)):
        raise InputError(f"bad --threshold {text!r}: must be a number at or above 0")
    return v, None

"""JSON-safe values for reports (`sanitize`): torch-free, so `bisect report diff --json`
and the core write the same JSON."""

from __future__ import annotations

import math


def sanitize(obj):
    """JSON-safe: inf/nan floats become strings, tuples lists."""
    if isinstance(obj, float):
        if math.isnan(obj):
            return "nan"
        if math.isinf(obj):
            return "inf" if obj > 0 else "-inf"
        return obj
    if isinstance(obj, dict):
        return {str(k): sanitize(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [sanitize(v) for v in obj]
    return obj

"""The report as its readers see it: one view over a report dict that every renderer reads.

`bisect report show` (numbisect.report.summary), `report md` and `report diff`
(numbisect.report.tools), the routing, decode-mode and recurrent-state lines
(numbisect.report.sections: routing, decode, recurrent) and the TUI (numbisect.tui.model and
its widgets) read a report through `ReportView` instead of each walking the dict itself:

1. The report is made printable once (`textsafe.printable_tree`): every string a reader
   gets from the view is escaped (no terminal escapes, no line breaks).
2. Each section has one accessor that says what shape a reader gets: a section that is
   absent or not of its type reads as empty (`{}`, `[]`) or None, entries of a list that
   are not objects are left out, numbers are given as stored (a reader that computes
   with one reads it with `formatting.num`: "inf"/"nan" strings, huge integers).

A reader must not modify what the view returns (it may be the report itself).

Torch-free and UI-free (the report layer, tests/test_layering.py): `bisect report ...` imports this.
"""

from __future__ import annotations

from numbisect.common.formatting import num
from numbisect.common.textsafe import printable_tree


def get(d, *keys):
    """d[k1][k2]... or None when any level is missing or not a dict."""
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def _dict(x) -> dict:
    return x if isinstance(x, dict) else {}


def typed_trials(trials) -> list[dict]:
    """Trials as renderers read them: objects only, `swapped` a list of strings (a copy of a
    trial where it was not one), so no reader meets a number where it iterates names."""
    out = []
    for t in _dicts(trials):
        sw = t.get("swapped")
        if not (isinstance(sw, list) and all(isinstance(x, str) for x in sw)):
            t = {**t, "swapped": [str(x) for x in sw] if isinstance(sw, list) else []}
        out.append(t)
    return out


def _dicts(x) -> list[dict]:
    return [e for e in x if isinstance(e, dict)] if isinstance(x, list) else []


class ReportView:
    """Typed, escaped accessors over one report (`view(report)` makes or reuses one)."""

    def __init__(self, report: dict):
        self.r = printable_tree(report)

    # -- envelope ----------------------------------------------------------------------------
    @property
    def kind(self):
        return self.r.get("kind")

    @property
    def verdict(self):
        return self.r.get("verdict")

    @property
    def aligned(self) -> bool:
        return self.r.get("verdict") == "aligned"

    @property
    def created(self):
        return self.r.get("created")

    @property
    def tool_version(self):
        return self.r.get("tool_version")

    @property
    def schema_version(self):
        return self.r.get("schema_version")

    @property
    def environment(self) -> dict:
        return self.r.get("environment") or {}

    @property
    def command(self) -> list:
        return self.r.get("command") or []

    # -- verdict settings --------------------------------------------------------------------
    @property
    def settings(self) -> dict:
        """The `threshold` section: metric, group, threshold, unit_tol, threshold_origin."""
        return self.r.get("threshold") or {}

    @property
    def metric(self):
        return self.settings.get("metric")

    @property
    def group(self):
        return self.settings.get("group")

    @property
    def threshold(self):
        """The judged threshold as stored (a number, or "inf"/"nan")."""
        return self.settings.get("threshold")

    @property
    def unit_tol(self):
        return self.settings.get("unit_tol")

    @property
    def threshold_origin(self) -> dict | None:
        """Where a `--threshold floor[xN]` came from; None for a plain number."""
        o = self.settings.get("threshold_origin")
        return o if isinstance(o, dict) else None

    # -- inputs ------------------------------------------------------------------------------
    @property
    def inputs(self) -> dict:
        return self.r.get("inputs") or {}

    def side(self, which: str) -> dict:
        """The `ref` or `engine` input: backend, path, dtype, arch, options, sha256, mode."""
        return self.inputs.get(which) or {}

    @property
    def ref(self) -> dict:
        return self.side("ref")

    @property
    def engine(self) -> dict:
        return self.side("engine")

    @property
    def engine_recorded(self) -> bool:
        """The engine ran no model: its log-probs are the ones the trace recorded (the
        `rollout` engine, written with no dtype)."""
        return self.engine.get("dtype") is None

    @property
    def engine_mode(self):
        return self.engine.get("mode", "prefill")

    @property
    def trace(self) -> dict:
        return self.inputs.get("trace") or {}

    @property
    def faults(self) -> list[dict]:
        """Planted faults (spec, unit)."""
        return _dicts(self.inputs.get("faults") or [])

    @property
    def systematic(self) -> dict:
        """The search's kind-level culprit (kinds, units, value, per_kind, per_layer); {} if none."""
        sy = (self.search or {}).get("systematic")
        return sy if isinstance(sy, dict) else {}

    @property
    def diffuse_kinds(self) -> dict:
        """A diffuse search where only every kind together fixes it (kinds, per_kind: alone and
        complement, per_layer); {} if none."""
        d = (self.search or {}).get("diffuse_kinds")
        return d if isinstance(d, dict) else {}

    @property
    def checkpoint_diff(self) -> dict:
        """What differs between the two checkpoints (numbisect.model.ckptdiff); {} when not compared."""
        d = self.inputs.get("checkpoint_diff")
        return d if isinstance(d, dict) else {}

    @property
    def logprob_contract(self) -> dict:
        """Whether a rollout's log-probs are raw, processed or logits (numbisect.pipeline.contract); {} if not judged."""
        c = self.r.get("logprob_contract")
        return c if isinstance(c, dict) else {}

    # -- baseline ----------------------------------------------------------------------------
    @property
    def baseline(self) -> dict:
        return self.r.get("baseline") or {}

    @property
    def value(self):
        """The judged value as stored."""
        return self.baseline.get("value")

    @property
    def groups(self) -> dict:
        """Token group -> tokens, k3 {mean, p99, max}, kl {mean}, top1_agree."""
        return self.baseline.get("groups") or {}

    @property
    def rl_cost(self) -> dict:
        """The RL cost section (empty when absent): fractions and their `thresholds`."""
        return self.baseline.get("rl_cost") or {}

    @property
    def worst_tokens(self) -> list:
        return self.baseline.get("worst_tokens") or []

    @property
    def per_sample(self) -> list:
        return self.baseline.get("per_sample") or []

    # -- units -------------------------------------------------------------------------------
    @property
    def units(self) -> list[dict]:
        """Unit entries (name, kind, layer, parent, propagated, local) in report order."""
        return [u for u in (self.r.get("units") or []) if isinstance(u, dict) and "name" in u]

    @property
    def unit_map(self) -> dict[str, dict]:
        """Name -> unit entry (a repeated name: its last entry)."""
        return {u["name"]: u for u in self.units}

    def unit(self, name: str) -> dict | None:
        """The first unit entry of that name."""
        return next((u for u in self.units if u["name"] == name), None)

    @property
    def local_ranking(self) -> dict:
        return self.r.get("local_ranking") or {}

    @property
    def first_divergence(self) -> dict:
        return self.r.get("first_divergence") or {}

    # -- search ------------------------------------------------------------------------------
    @property
    def search(self) -> dict | None:
        """The search section (strategy, verdict, trials_used, stop_reason, baseline,
        contributions); None when absent (`compare`). May be empty."""
        s = self.r.get("search")
        return s if isinstance(s, dict) else None

    @property
    def searched(self) -> bool:
        """Whether the report named culprits by a search (a `run` that was not a plain swap)."""
        s = self.r.get("search") or {}
        return self.r.get("kind") == "run" and bool(s) and s.get("strategy") != "swap"

    @property
    def swap(self) -> dict | None:
        """A `run --swap` report's swap section (its search block is the swap's); None when
        absent. May be empty."""
        sw = self.r.get("swap")
        return sw if isinstance(sw, dict) else None

    @property
    def swap_lines(self) -> list:
        lines = _dict(self.swap).get("lines")
        return lines if isinstance(lines, list) else []

    @property
    def culprits(self) -> list:
        """Every culprit entry, as the report lists them."""
        return self.r.get("culprits") or []

    @property
    def named_culprits(self) -> list[dict]:
        """Culprit entries that are objects naming a unit."""
        return [c for c in self.culprits if isinstance(c, dict) and c.get("unit")]

    @property
    def contributions(self) -> dict:
        """A diffuse search's per-layer contributions."""
        return _dict(self.search).get("contributions") or {}

    @property
    def trials(self) -> list[dict]:
        """The search's trials (objects), each with `swapped` a list of strings."""
        return typed_trials(self.r.get("trials"))

    def trial_groups(self, t: dict) -> dict[str, dict]:
        """A trial's per-group metrics (entries that are objects)."""
        m = t.get("metrics")
        g = m.get("groups") if isinstance(m, dict) else None
        return {k: v for k, v in g.items() if isinstance(v, dict)} if isinstance(g, dict) else {}

    @property
    def post_search_errors(self) -> list[dict]:
        """Steps after the search that failed (step, unit, error)."""
        return _dicts(self.r.get("post_search_errors"))

    @property
    def self_check(self) -> dict | None:
        return self.r.get("self_check") or None

    # -- optional sections -------------------------------------------------------------------
    @property
    def routing(self) -> dict | None:
        return self.r.get("routing") or None

    @property
    def routing_replay(self) -> dict | None:
        return self.r.get("routing_replay") or None

    @property
    def indexer_selection(self) -> dict | None:
        return self.r.get("indexer_selection") or None

    @property
    def engine_modes(self) -> dict | None:
        return self.r.get("engine_modes") or None

    @property
    def capture(self) -> dict | None:
        return self.r.get("capture") or None

    @property
    def recurrent_state(self) -> dict:
        """Linear attention's recurrent-state section (numbisect.pipeline.recurrent); {} when absent
        or not an object (numbisect.report.sections.recurrent reads its layers and points)."""
        return _dict(self.r.get("recurrent_state"))


def rel(u: dict | None, side: str) -> float | None:
    """A unit's relative L2 error on `side` ("propagated" or "local") as a float."""
    return num(get(u, side, "rel_l2"))


def bitwise(u: dict | None, side: str):
    """Whether a unit's output on `side` is bitwise equal (None when not measured)."""
    return get(u, side, "ulps", "bitwise_equal")


_last: list = [None, None]  # the last report viewed, and its view


def view(report) -> ReportView:
    """The view of `report` (a dict, or a view); the last one made is reused when the same
    report comes again and needed no escaping (the TUI asks many times)."""
    if isinstance(report, ReportView):
        return report
    if _last[0] is report:
        return _last[1]
    v = ReportView(report)
    if v.r is report:
        _last[0], _last[1] = report, v
    return v

"""Live mode's work, without textual: what the app's worker threads call.

1. `LiveConfig`: what `bisect tui --ref ... --engine ... --trace ...` asked for, plus the
   equivalent `bisect run` command line (recorded in the report, so it reproduces it).
   `--engine-config FILE` is the spec's `engine_config`: the session runs the user's
   settings and the hookable ones exactly as `bisect run --engine-config` does.
2. `open_session`: load both backends (slow: this runs in a worker thread).
3. `run_search`: `numbisect.commands.run.run` exactly as `bisect run` calls it, and the report
   built exactly as `bisect run` builds it, so an exported report equals the CLI's
   apart from `created` and the durations. The comparison's body is handed out as soon
   as it exists (`run.run`'s `on_baseline` hook), before the trials.
4. `swap_trial`: one engine forward with some units swapped (not part of the report).

Every callback may raise `Cancelled` (the app is quitting): the run stops at the next
trial boundary and the engine is left unswapped.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable

from numbisect.backends import BACKENDS
from numbisect.common.errors import InputError
from numbisect.pipeline.provenance import new_report
from numbisect.search.search import STRATEGIES


class Cancelled(Exception):
    """The app asked the worker to stop."""


@dataclass
class LiveConfig:
    spec: object  # numbisect.session.session.Spec
    settings: object  # numbisect.pipeline.measure.Settings
    strategy: str = "hierarchical"  # hierarchical, linear or ddmin
    max_trials: int | None = None  # stop the search after this many trials
    argv: list[str] = field(default_factory=list)  # the equivalent `bisect run ...` command
    backends: dict | None = None  # already-open backends ("ref", "engine"): tests share them
    autostart: bool = True  # start the search as soon as the app is up


def run_argv(argv: list[str]) -> list[str]:
    """`bisect tui --ref ...` -> `bisect run --ref ...`: the command that reproduces the run."""
    out = list(argv)
    for i, a in enumerate(out[1:], start=1):
        if a == "tui":
            out[i] = "run"
            break
    return out


def open_session(cfg: LiveConfig, progress: Callable[[str], None]):
    from numbisect.session.session import (  # lazy: keeps torch out of importing numbisect.tui.live
        Session,  # lazy: keeps torch out of importing numbisect.tui.live
    )

    return Session.open(cfg.spec, cfg.settings, progress=progress, backends=dict(cfg.backends or {}))


def report_of(session, cfg: LiveConfig, body: dict) -> dict:
    """The report `bisect run` writes for this body."""
    return new_report("run", cfg.argv, session.inputs(), cfg.settings.to_dict(), body)


def run_search(session, cfg: LiveConfig, progress, on_trial, on_baseline=None) -> tuple[dict, int]:
    """Compare, self-check and search; returns (report, exit code) as `bisect run` would."""
    from numbisect.commands.run import (  # lazy: keeps torch out of importing numbisect.tui.live
        run,  # lazy: keeps torch out of importing numbisect.tui.live
    )

    def tell(body: dict) -> None:
        on_baseline(report_of(session, cfg, copy.deepcopy(body)))

    body, code = run(
        session,
        swap=[],
        strategy=cfg.strategy,
        max_trials=cfg.max_trials,
        log=None,
        resume=None,
        progress=progress,
        on_trial=on_trial,
        on_baseline=tell if on_baseline is not None else None,
    )
    return report_of(session, cfg, body), int(code)


def swap_trial(session, names: list[str], label: str, before: float | None) -> dict:
    """One trial with `names` swapped: value before and after, and every group's numbers."""
    if session.engine is None:
        raise InputError("swaps need an engine that runs (hf: or vllm:)")
    if not names:
        raise InputError("nothing to swap")
    value, summary = session.trial(list(names))
    th = session.settings.threshold
    return {
        "label": label,
        "units": list(names),
        "before": before,
        "after": value,
        "fixed": value <= th,
        "metrics": summary,
        "metric": session.settings.metric,
        "threshold": th,
    }


def check_live(cfg: LiveConfig) -> None:
    """Cheap checks before the app starts, so bad input is a one-line CLI error."""
    from numbisect.model.rlformats import (  # lazy: keeps torch out of importing numbisect.tui.live
        load_any,  # lazy: keeps torch out of importing numbisect.tui.live
    )
    from numbisect.patching.faults import (  # lazy: keeps torch out of importing numbisect.tui.live
        parse_fault,  # lazy: keeps torch out of importing numbisect.tui.live
    )
    from numbisect.pipeline.measure import (  # lazy: keeps torch out of importing numbisect.tui.live
        group_names,
        parse_spec,
    )

    parse_spec(cfg.spec.ref, "--ref")
    kind, _ = parse_spec(cfg.spec.engine, "--engine")
    if BACKENDS[kind].source == "trace":
        runners = " or ".join(e.form(k) for k, e in BACKENDS.items() if e.runs)
        raise InputError(f"bisect tui runs trials: --engine must be {runners} (not {kind})")
    from numbisect.pipeline import (  # lazy: keeps torch out of importing numbisect.tui.live
        decode as D,  # lazy: keeps torch out of importing numbisect.tui.live
    )

    D.check_mode(kind, cfg.spec.engine_mode)
    D.check_tp(cfg.spec.engine_mode, {**(cfg.spec.engine_opts or {}), **(cfg.spec.engine_config or {})})  # the settings' degree too
    if cfg.spec.engine_config is not None:  # the file was read and checked where parsed; here what it asks of the engine
        from numbisect.session.userengine import (  # lazy: keeps torch out of importing numbisect.tui.live
            UserEngine,  # lazy: keeps torch out of importing numbisect.tui.live
        )

        UserEngine.check(cfg.spec, kind)
    if cfg.strategy not in STRATEGIES:
        raise InputError(f"unknown strategy {cfg.strategy!r}; choose one of {', '.join(STRATEGIES)}")
    for f in cfg.spec.faults:
        parse_fault(f)
    trace = load_any(cfg.spec.trace, cfg.spec.trace_format, cfg.spec.trace_fields)
    D.check_trace(trace, cfg.spec.engine_mode)
    from numbisect.backends.base import (  # lazy: keeps torch out of importing numbisect.tui.live
        load_config,  # lazy: keeps torch out of importing numbisect.tui.live
    )
    from numbisect.model.groups import (  # lazy: keeps torch out of importing numbisect.tui.live
        add_groups,
        parse_group_defs,
    )

    add_groups(trace, load_config(parse_spec(cfg.spec.ref, "--ref")[1]), parse_group_defs(cfg.spec.group_defs))
    if cfg.settings.group not in group_names(trace) + ["all"]:
        raise InputError(f"unknown group {cfg.settings.group!r}; this trace has: {', '.join(group_names(trace))}")

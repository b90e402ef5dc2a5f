"""`bisect tui`: explore a report, or run a bisection live and watch it.

1. Explorer: `BisectApp(report=load_report(path), report_path=path)`; read-only.
2. Live: `BisectApp(live=LiveConfig(...))`. A thread worker opens the session and runs
   `numbisect.commands.run.run` as `bisect run` does, posting typed messages (`messages.py`):
   progress lines, the baseline as soon as the comparison ends, each trial, the final
   report. The UI never waits on a model.
3. The app keeps the state (the report shown, its trials, the error view, the selected
   unit, manual swap trials); the main screen's widgets draw it (`widgets/`).
4. Actions are key bindings with ids (footer, help screen); the mouse works on tabs,
   the tree, the tables, the footer and dialog buttons.
5. A report's strings are shown printable (`textsafe.printable_tree`: escape sequences
   and line breaks escaped) and never read as markup (widgets draw `Text`); the report
   as read (`source`) is what export writes. `preflight` draws every text the app would
   draw from a report, so `bisect tui` refuses one it cannot show with one line, before
   the app starts.
6. A `bisect conditions` report (engine settings, not units) opens on its own answer: the
   guilty setting in the answer bar, its settings, atoms, RL cost against the reference
   and localisation in the Overview (`widgets/conditions.py`), its trials (atoms reverted)
   in the Trials tab.
7. A report of `compare` / `run --engine-config` shows its `engine_config` section in the
   Overview (`widgets/engine_config.py`): whether the module search, run in the hookable
   configuration, saw your numbers; "your settings alone diverge" is then the answer bar's.
   A live run with `--engine-config FILE` runs as `bisect run --engine-config` does (the
   session derives both configurations), so its report carries the section too.
"""

from __future__ import annotations

import os
import threading
import traceback
from pathlib import Path

from rich.text import Text
from textual import work
from textual.app import App
from textual.binding import Binding
from textual.screen import ModalScreen
from textual.widgets import Input, Static, TabbedContent, Tree
from textual.worker import get_current_worker

from numbisect.common.errors import InputError, NumbisectError
from numbisect.common.formatting import fmt
from numbisect.common.jsonsafe import sanitize
from numbisect.common.safeio import check_not_an_input
from numbisect.common.textsafe import clip, path_text, printable, printable_tree
from numbisect.report.document import load_report, write_json_atomic
from numbisect.report.view import view as report_view
from numbisect.tui import model as M
from numbisect.tui.live import (
    Cancelled,
    LiveConfig,
    open_session,
    run_search,
    swap_trial,
)
from numbisect.tui.messages import (
    BaselineReady,
    Progress,
    RunDone,
    SwapDone,
    TrialDone,
    WorkFailed,
)
from numbisect.tui.screens.dialogs import ErrorScreen, PathScreen
from numbisect.tui.screens.help import HelpScreen
from numbisect.tui.screens.main import TABS, MainScreen
from numbisect.tui.widgets.culprit import CulpritPanel
from numbisect.tui.widgets.overview import OverviewPanel, overview_text
from numbisect.tui.widgets.token_view import TokenView, strips_text, worst_text
from numbisect.tui.widgets.trials import (
    TrialsPanel,
    log10_floor,
    condition_trial_text,
    role,
    trial_text,
)
from numbisect.tui.widgets.unit_detail import UnitDetail, detail_text
from numbisect.tui.widgets.unit_tree import UnitTree, row_label

LIVE_ACTIONS = {"run_search", "swap_unit", "swap_kind"}


def _draw_all(r: dict, report_path: str | None) -> None:
    """Every text the app draws from report `r` (already printable), once."""
    M.verdict_line(r)
    M.culprit_lines(r)
    M.trials_note(r)
    overview_text(r)
    tol = M.unit_tol(r)
    M.legend(tol)
    culprits = M.culprit_names(r)
    rv = report_view(r)
    first = rv.first_divergence.get("above_tol")
    M.visible_units(r, "")
    rows = M.unit_rows(r)
    trials = M.report_trials(r)
    cond = M.conditions_of(r) is not None
    for row in rows:
        for view in ("propagated", "local"):
            row_label(row, view, tol, culprits, first)
        detail_text(r, row.name, "propagated", trials, [])
    detail_text(r, "model", "propagated", trials, [])
    detail_text(r, BisectApp._default_unit(r), "local", trials, [])
    td = M.token_data(r, report_path)
    td.scale()
    for g in td.groups:
        strips_text(td, g)
        worst_text(td, g)
    th = M.threshold_of(r)
    metric = rv.metric
    universe = M.candidate_universe(r)
    for t in trials:
        trial_text(t, th, metric)
        if cond:
            condition_trial_text(t, th)
            M.reference_cells(M.trial_reference(t))
        role(t)
        M.abbreviate(t["swapped"], universe, width=60)
        M.value_mark(t["value"], th)
        log10_floor(t["value"], -12.0)


def preflight(report: dict, report_path: str | None) -> None:
    """Refuse, with one InputError line, a (schema-valid) report the TUI cannot draw:
    every text the app would draw is drawn once here, before the app starts."""
    try:
        _draw_all(printable_tree(report), report_path)
    except Exception as e:  # a report the readers do not handle: one line, not a traceback
        if os.environ.get("NUMBISECT_DEBUG"):
            raise
        name = printable(clip(report_path or "report", 300))
        raise InputError(f"{name}: the TUI cannot show this report ({type(e).__name__}: {printable(clip(e, 200))})") from None


class BisectApp(App[int]):
    TITLE = "numbisect"
    CSS_PATH = Path(__file__).parent / "app.tcss"  # absolute: subclasses elsewhere find it too
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (120, "-wide")]
    VERTICAL_BREAKPOINTS = [(0, "-short"), (32, "-tall")]
    ENABLE_COMMAND_PALETTE = False
    BINDINGS = [
        Binding("q", "quit", "Quit", id="quit"),
        Binding("question_mark,f1", "help", "Help", key_display="?", id="help"),
        Binding("r", "run_search", "Run", id="run"),
        Binding("s", "swap_unit", "Swap", id="swap"),
        Binding("S", "swap_kind", "Kind", key_display="S", id="swap_kind"),
        Binding("l", "toggle_error", "Prop/Local", id="toggle_error"),
        Binding("slash", "filter", "Filter", key_display="/", id="filter"),
        Binding("e", "export", "Export", id="export"),
        Binding("o", "open", "Open", id="open"),
        Binding("g", "cycle_group", "Group", show=False, id="group"),
        Binding("1", "tab('overview')", "Overview", show=False, id="tab_overview"),
        Binding("2", "tab('units')", "Units", show=False, id="tab_units"),
        Binding("3", "tab('tokens')", "Tokens", show=False, id="tab_tokens"),
        Binding("4", "tab('trials')", "Trials", show=False, id="tab_trials"),
        Binding("escape", "leave_filter", show=False),
    ]

    def __init__(self, report: dict | None = None, report_path: str | None = None, live: LiveConfig | None = None):
        super().__init__()
        if report is None and live is None:
            raise ValueError("BisectApp needs a report or a live configuration")
        self.source = report  # the report as read or built: what export writes
        self.report = printable_tree(report) if report is not None else None  # what is shown
        self.report_path = report_path
        self.live = live
        self.live_shown = live is not None  # the report shown is the live run's (not an opened file)
        self.final = report is not None  # the report is complete (exportable)
        self.trials: list[dict] = M.report_trials(self.report) if self.report else []
        self.view = "propagated"
        self.filter_text = ""
        self.selected = self._default_unit(self.report)
        self.manual: list[dict] = []
        self.session = None
        self.busy: str | None = None  # "search" or "swap" while a worker uses the engine
        self.status = ""
        self.last_code: int | None = None
        self._session_lock = threading.Lock()
        self._quitting = False
        self.failure: Exception | None = None  # an error that ended the app (see _handle_exception)
        self.main = MainScreen()

    # -- set-up ---------------------------------------------------------------------------
    def get_default_screen(self) -> MainScreen:
        return self.main

    def main_ready(self) -> None:
        """Called by the main screen once its widgets exist."""
        self._set_titles()
        self.refresh_all()
        if self.live is not None:
            self.set_status("live: press r to run the search" if not self.live.autostart else "starting")
            if self.live.autostart:
                self.action_run_search()
        else:
            self.set_status(printable(f"read-only report {self.report_path or ''}; ? for help"))

    def _set_titles(self) -> None:
        if self.live_shown and self.live is not None:
            spec = self.live.spec
            self.sub_title = f"live: {spec.ref} ({spec.ref_dtype}) vs {spec.engine} ({spec.engine_dtype})"
        else:
            self.sub_title = printable(f"report {self.report_path or ''}")

    @staticmethod
    def _default_unit(report: dict | None) -> str:
        if not report:
            return "model"
        rv = report_view(report)
        if rv.culprits:
            return rv.culprits[0]["unit"]
        return rv.first_divergence.get("above_tol") or "model"

    def _handle_exception(self, error: Exception) -> None:
        """An error inside the app: remembered (`failure`) for `bisect tui` to report in one
        line, instead of Textual's traceback; NUMBISECT_DEBUG=1 keeps the traceback."""
        if os.environ.get("NUMBISECT_DEBUG"):
            super()._handle_exception(error)
            return
        self._return_code = 1
        if self._exception is None:
            self._exception = error
            self._exception_event.set()
        self.failure = error
        self._close_messages_no_wait()

    def _show(self, report: dict) -> None:
        """Make `report` the one shown (a printable copy) and the one exported (as is)."""
        self.source = report
        self.report = printable_tree(report)

    # -- drawing --------------------------------------------------------------------------
    def set_status(self, text: str) -> None:
        self.status = text
        t = Text()
        if self.busy:
            t.append(f"[{self.busy}] ", style="bold")
        t.append(printable(text))
        self.main.query_one("#status", Static).update(t)

    def _live_intro(self) -> str:
        """What a live run is doing, for the Overview until its baseline exists."""
        cfg = self.live
        sp, st = cfg.spec, cfg.settings
        lines = [
            f"live run: {' '.join(cfg.argv) or 'bisect run'}",
            "",
            f"reference  {path_text(sp.ref)} ({sp.ref_dtype})",
            f"engine     {path_text(sp.engine)} ({sp.engine_dtype})",
            f"trace      {path_text(sp.trace)}",
            f"faults     {', '.join(sp.faults) or 'none planted'}",
            *([f"settings   {path_text(sp.engine_config_path or 'your engine settings')} (--engine-config: the token comparison in "
               "yours, the search in the hookable ones)"] if sp.engine_config is not None else []),
            f"judged on  {M.metric_words(st.metric)} of {st.group} tokens, threshold {fmt(st.threshold)}",
            f"search     {cfg.strategy}" + (f", at most {cfg.max_trials} trials" if cfg.max_trials else ""),
            "",
            f"now: {self.status or 'starting'}",
        ]
        return "\n".join(lines)

    def _note(self) -> str:
        if self.report is None:
            return f"live: {self.status or 'starting'}"
        if self.live_shown and not self.final:
            return f"searching... {self.status}" if self.busy == "search" else "search not finished"
        return ""

    def refresh_all(self) -> None:
        s = self.main
        r = self.report
        note = self._note()
        s.query_one(CulpritPanel).show(r, note)
        s.query_one(OverviewPanel).show(r, self._live_intro() if r is None and self.live else note)
        tol = M.unit_tol(r) if r else 1e-2
        s.query_one("#unit-legend", Static).update(M.legend(tol))
        s.query_one(UnitTree).populate(r, self.view, self.filter_text, keep=self.selected)
        self.refresh_detail()
        s.query_one(TokenView).show(M.token_data(r, self.report_path) if r else None)
        self.refresh_trials()

    def refresh_trials(self) -> None:
        r = self.report
        th = M.threshold_of(r) if r else (self.live.settings.threshold if self.live else 1e-3)
        metric = report_view(r).metric if r else (self.live.settings.metric if self.live else "k3-mean")
        universe = M.candidate_universe(r) if r else []
        cond = r is not None and M.conditions_of(r) is not None
        self.main.query_one(TrialsPanel).reset(self.trials, th, metric, universe, conditions=cond,
                                               note=M.trials_note(r) if r is not None else "")

    def refresh_detail(self) -> None:
        manual = [m for m in self.manual if self.selected in m["units"]]
        self.main.query_one(UnitDetail).show(self.report, self.selected, self.view, self.trials, manual)

    def refresh_answer(self) -> None:
        note = self._note()
        self.main.query_one(CulpritPanel).show(self.report, note)

    # -- widget events --------------------------------------------------------------------
    def on_tree_node_highlighted(self, event: Tree.NodeHighlighted) -> None:
        if isinstance(event.node.data, str) and event.node.data != self.selected:
            self.selected = event.node.data
            self.refresh_detail()

    def on_input_changed(self, event: Input.Changed) -> None:
        if event.input.id == "unit-filter":
            self.filter_text = event.value
            self.main.query_one(UnitTree).populate(self.report, self.view, self.filter_text, keep=self.selected)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id == "unit-filter":
            self.main.query_one(UnitTree).focus()

    # -- actions --------------------------------------------------------------------------
    def check_action(self, action: str, parameters) -> bool | None:
        if self._quitting:
            return False
        if isinstance(self.screen, ModalScreen) and action not in ("quit",):
            return False  # a dialog is open: the keys are its own
        if action in LIVE_ACTIONS:
            if self.live is None or not self.live_shown:
                return False
            return None if self.busy else True
        return True

    def action_help(self) -> None:
        if isinstance(self.screen, HelpScreen):
            return
        self.push_screen(HelpScreen([b for b in self.BINDINGS if isinstance(b, Binding) and b.id], self.live is not None))

    def action_tab(self, name: str) -> None:
        """Show a tab and focus its main widget (so arrows work at once)."""
        if name in TABS:
            self.main.query_one(TabbedContent).active = name
            focus = {"overview": "#overview-scroll", "units": "#unit-tree", "tokens": "#strips-scroll", "trials": "#trials-table"}
            self.main.query_one(focus[name]).focus()

    def action_toggle_error(self) -> None:
        self.view = "local" if self.view == "propagated" else "propagated"
        self.main.query_one(UnitTree).populate(self.report, self.view, self.filter_text, keep=self.selected)
        self.refresh_detail()
        self.set_status(f"unit tree shows {self.view} error")

    def action_filter(self) -> None:
        self.action_tab("units")
        self.main.query_one("#unit-filter", Input).focus()

    def action_leave_filter(self) -> None:
        if self.focused is not None and self.focused.id == "unit-filter":
            self.main.query_one(UnitTree).focus()

    def action_cycle_group(self) -> None:
        self.action_tab("tokens")
        g = self.main.query_one(TokenView).cycle_group()
        self.set_status(f"token group: {g}")

    # export / open
    def _default_export(self) -> str:
        if self.report_path and not self.live_shown:
            return f"{Path(self.report_path).stem}-export.json"
        return "numbisect-report.json"

    def action_export(self) -> None:
        if self.report is None or not self.final:
            self.notify("nothing to export yet: the run has not finished", severity="warning", markup=False)
            return
        self.push_screen(PathScreen("Export the report to", self._default_export(), "Export"), self._export_to)

    def _export_to(self, path: str | None) -> None:
        if not path:
            return
        try:  # NaN / Infinity literals (a schema-valid report may hold them) as the schema's "nan" / "inf"
            self._check_export(path)
            write_json_atomic(path, sanitize(self.source))
        except NumbisectError as e:
            self.push_screen(ErrorScreen("cannot export", e.message))
            return
        except OSError as e:
            self.push_screen(ErrorScreen("cannot export", f"cannot write {path_text(path)}: {e.strerror or e}"))
            return
        except (ValueError, TypeError, RecursionError) as e:  # not JSON data: said, never the app's end
            self.push_screen(ErrorScreen("cannot export", f"cannot write {path_text(path)}: {type(e).__name__}: {e}"))
            return
        self.set_status(f"report written to {path_text(path)}")
        self.notify(f"report written to {path_text(path)}", markup=False)

    def _check_export(self, path: str) -> None:
        """An export never overwrites an input, links followed: the trace or a file of either
        model's directory (the live run's, or those the report names)."""

        def d(x) -> dict:
            return x if isinstance(x, dict) else {}

        if self.live is not None:
            sp = self.live.spec
            trace = sp.trace
            dirs = {f"--{side}": ("model", spec.partition(":")[2]) for side, spec in (("ref", sp.ref), ("engine", sp.engine))}
        else:
            ins = d(self.source.get("inputs")) if isinstance(self.source, dict) else {}
            trace = d(ins.get("trace")).get("path")
            dirs = {f"--{side}": ("model", d(ins.get(side)).get("path")) for side in ("ref", "engine")}
        check_not_an_input(path, "export", {"--trace": trace if isinstance(trace, str) else None},
                           {k: v for k, v in dirs.items() if isinstance(v[1], str) and v[1]})

    def action_open(self) -> None:
        if self.busy:
            self.notify("wait for the running trial or search to finish", severity="warning", markup=False)
            return
        self.push_screen(PathScreen("Open a report", self.report_path or "", "Open"), self._open)

    def _open(self, path: str | None) -> None:
        if not path:
            return
        try:
            r = load_report(path)
            preflight(r, path)
        except NumbisectError as e:
            self.push_screen(ErrorScreen("cannot open report", e.message))
            return
        self.open_report(r, path)

    def open_report(self, r: dict, path: str) -> None:
        self._show(r)
        self.report_path = path
        self.live_shown = False
        self.final = True
        self.trials = M.report_trials(self.report)
        self.manual = []
        self.selected = self._default_unit(self.report)
        self._set_titles()
        self.refresh_all()
        self.refresh_bindings()
        self.set_status(f"opened {path_text(path)} (read-only)")

    # live: search and swaps
    def action_run_search(self) -> None:
        if self.live is None or not self.live_shown:
            self.notify("running needs live mode: bisect tui --ref hf:DIR --engine ... --trace T", severity="warning", markup=False)
            return
        if self.busy:
            self.notify(f"busy ({self.busy}): wait for it to finish", severity="warning", markup=False)
            return
        self._set_busy("search")
        self.trials = []
        self.final = False
        self.last_code = None
        self.refresh_trials()
        self.refresh_answer()
        self._search_worker()

    def _swap_target(self, whole_kind: bool) -> tuple[list[str], str] | None:
        name = self.selected
        u = report_view(self.report).unit(name) if self.report else None
        if u is None:
            self.notify("select a unit in the Units tab first", severity="warning", markup=False)
            return None
        if not whole_kind:
            return [name], name
        from numbisect.patching.swap import (  # lazy: keeps torch out of importing numbisect.tui.app
            units_of_kinds,  # lazy: keeps torch out of importing numbisect.tui.app
        )

        names = units_of_kinds(self.session.engine, [u["kind"]])
        return names, f"all {len(names)} {u['kind']} units"

    def _swap(self, whole_kind: bool) -> None:
        if self.live is None or not self.live_shown:
            self.notify("swap trials need live mode", severity="warning", markup=False)
            return
        if self.busy:
            self.notify(f"busy ({self.busy}): wait for it to finish", severity="warning", markup=False)
            return
        if self.session is None or self.report is None:
            self.notify("the engine is not loaded yet", severity="warning", markup=False)
            return
        target = self._swap_target(whole_kind)
        if target is None:
            return
        names, label = target
        self._set_busy("swap")
        self.set_status(f"swap trial: {label}")
        self._swap_worker(names, label, report_view(self.report).value)

    def action_swap_unit(self) -> None:
        self._swap(False)

    def action_swap_kind(self) -> None:
        self._swap(True)

    def _set_busy(self, what: str | None) -> None:
        self.busy = what
        self.refresh_bindings()

    # -- workers (threads) ---------------------------------------------------------------
    def _ensure_session(self, say) -> None:
        with self._session_lock:
            if self.session is None:
                self.session = open_session(self.live, say)

    @work(thread=True, group="engine", name="search")
    def _search_worker(self) -> None:
        worker = get_current_worker()

        def check() -> None:
            if worker.is_cancelled or self._quitting:
                raise Cancelled()

        def say(msg: str) -> None:
            check()
            self.post_message(Progress(msg))

        def on_trial(trial) -> None:
            self.post_message(TrialDone(trial.to_dict()))
            check()

        try:
            self._ensure_session(say)
            report, code = run_search(self.session, self.live, say, on_trial, on_baseline=lambda r: self.post_message(BaselineReady(r)))
            self.post_message(RunDone(report, code))
        except Cancelled:
            pass
        except NumbisectError as e:
            self.post_message(WorkFailed("run", e.message + (f" ({e.hint})" if e.hint else "")))
        except Exception as e:  # a bug: one line here, the traceback when debugging
            if os.environ.get("NUMBISECT_DEBUG"):
                traceback.print_exc()
            self.post_message(WorkFailed("run", f"internal error: {type(e).__name__}: {e}"))
        finally:
            if self._quitting:
                self._close_session()

    @work(thread=True, group="engine", name="swap")
    def _swap_worker(self, names: list[str], label: str, before: float | None) -> None:
        try:
            self.post_message(SwapDone(swap_trial(self.session, names, label, before)))
        except NumbisectError as e:
            self.post_message(WorkFailed("swap", e.message))
        except Exception as e:
            if os.environ.get("NUMBISECT_DEBUG"):
                traceback.print_exc()
            self.post_message(WorkFailed("swap", f"internal error: {type(e).__name__}: {e}"))
        finally:
            if self._quitting:
                self._close_session()

    # -- messages from the workers --------------------------------------------------------
    def on_progress(self, msg: Progress) -> None:
        self.set_status(msg.text)
        if self.report is None or not self.final:
            self.refresh_answer()
            if self.report is None and self.live is not None:
                self.main.query_one(OverviewPanel).show(None, self._live_intro())

    def on_baseline_ready(self, msg: BaselineReady) -> None:
        if not self.live_shown:
            return
        self._show(msg.report)
        self.final = False
        if self.selected == "model":
            self.selected = self._default_unit(self.report)
        self.refresh_all()

    def on_trial_done(self, msg: TrialDone) -> None:
        if not self.live_shown:
            return
        trial = printable_tree(msg.trial)
        self.trials.append(trial)
        self.main.query_one(TrialsPanel).add_trial(trial)
        self.refresh_detail()

    def on_run_done(self, msg: RunDone) -> None:
        self._set_busy(None)
        if not self.live_shown:
            return
        self._show(msg.report)
        r = self.report
        self.final = True
        self.last_code = msg.code
        rv = report_view(r)
        self.trials = M.report_trials(r)
        self.selected = self._default_unit(r) if self.selected in ("model", None) or rv.culprits else self.selected
        self.refresh_all()
        s = rv.search or {}
        cul = ", ".join(c["unit"] for c in rv.culprits) or "none"
        self.set_status(f"search done: {s.get('verdict')} ({s.get('trials_used')} trials); culprit: {cul}; e to export")
        self.notify(f"search done: culprit {cul}" if rv.culprits else f"search done: {s.get('verdict')}", markup=False)

    def on_swap_done(self, msg: SwapDone) -> None:
        self._set_busy(None)
        res = printable_tree(msg.result)
        self.manual.append(res)
        self.refresh_detail()
        words = M.metric_words(res["metric"])
        verdict = "under the threshold" if res["fixed"] else "still over the threshold"
        text = f"swap {res['label']}: {words} {fmt(res['before'])} -> {fmt(res['after'])} ({verdict})"
        self.set_status(text)
        self.notify(text, timeout=8, markup=False)

    def on_work_failed(self, msg: WorkFailed) -> None:
        self._set_busy(None)
        self.set_status(f"{msg.what} failed: {msg.message}")
        self.refresh_answer()
        self.push_screen(ErrorScreen(f"{msg.what} failed", msg.message))

    # -- shutdown -------------------------------------------------------------------------
    def _close_session(self) -> None:
        with self._session_lock:
            if self.session is not None:
                self.session.close()
                self.session = None

    def on_unmount(self) -> None:
        self._quitting = True
        if not self.busy:
            self._close_session()

    async def action_quit(self) -> None:
        self._quitting = True
        if self.busy:
            self.set_status("stopping after the current step...")
        self.workers.cancel_group(self, "engine")
        if not self.busy:
            self._close_session()
        self.exit(self.last_code or 0)

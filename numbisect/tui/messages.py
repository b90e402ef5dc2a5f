"""Typed messages the live-mode workers post to the app (from their threads).

1. `Progress`: a status line (model loading, reference pass, each trial).
2. `BaselineReady`: the comparison finished; a report without trials yet.
3. `TrialDone`: one search trial (a `numbisect.search.search.Trial` as a dict).
4. `RunDone`: the final report, built as `bisect run` builds it, and its exit code.
5. `SwapDone`: a manual swap trial (selected unit or its kind) with before and after.
6. `WorkFailed`: a one-line error (an InputError, a backend error, ...).
"""

from __future__ import annotations

from textual.message import Message


class Progress(Message):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text


class BaselineReady(Message):
    def __init__(self, report: dict) -> None:
        super().__init__()
        self.report = report


class TrialDone(Message):
    def __init__(self, trial: dict) -> None:
        super().__init__()
        self.trial = trial


class RunDone(Message):
    def __init__(self, report: dict, code: int) -> None:
        super().__init__()
        self.report = report
        self.code = code


class SwapDone(Message):
    def __init__(self, result: dict) -> None:
        super().__init__()
        self.result = result  # label, units, before, after, metrics, fixed


class WorkFailed(Message):
    def __init__(self, what: str, message: str) -> None:
        super().__init__()
        self.what = what
        self.message = message

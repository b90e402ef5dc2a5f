"""Exit codes and the errors that carry them to the command line."""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    ALIGNED = 0  # the engine agrees with the reference (under the threshold)
    DIVERGED = 1  # diverged (with `run`: culprits named)
    USAGE = 2  # usage or input error
    BACKEND = 3  # backend or load error; a failed swap self-check
    NO_CULPRIT = 4  # diverged, but no culprit set found within --max-trials (or only the --engine-config settings diverge)
    CHECKPOINT_DIFFERS = 5  # the tokens are within the threshold, but the engine's checkpoint differs (weights or config)
    INTERRUPTED = 130  # Ctrl-C


def exception_line(e: BaseException) -> str:
    """An exception as one line: its type and the first line of its message (`Type: line`;
    the type alone when the message is empty or blank)."""
    line = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {line}" if line else type(e).__name__


class NumbisectError(Exception):
    """An error the user can act on: one line, no traceback."""

    code = ExitCode.USAGE

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint


class InputError(NumbisectError):
    """Bad user input: a trace, an option, a checkpoint directory."""

    code = ExitCode.USAGE


class BackendError(NumbisectError):
    """A backend could not load or run."""

    code = ExitCode.BACKEND

"""The errors of the live API: each one line naming the problem and what would work.

They are `InputError`s (exit code 2 on the command line): the user's objects, not
numbisect, are what cannot be used as given. Nothing was changed in the engine or the
model when one is raised.
"""

from __future__ import annotations

from numbisect.common.errors import InputError


class LiveError(InputError):
    """A live reference or engine numbisect cannot work with as it is."""


class EngineSettingError(LiveError):
    """The engine was started with a setting under which numbisect's hooks cannot give a
    right answer (compiled, prefix caching on, processed log-probs)."""


class EngineClosedError(LiveError):
    """The engine was shut down already."""


class ReferenceModelError(LiveError):
    """The reference model cannot be compared as given (family, dtype, device)."""


class SyncError(LiveError):
    """The user's sync, run by `Probe.check_sync`, raised: the message says what the engine
    holds after it (put back as found under poison control; else what the sync finished)."""


class HookNotFiredError(LiveError):
    """A hook numbisect placed on the engine never fired: its answer would be wrong."""

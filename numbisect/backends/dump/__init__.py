"""The `dump` backend: activations an engine wrote with `numbisect.dump`, compared without
running anything (`runner.py`: `DumpBackend`, `open_dump`, the registry's loader, and
`write_dump`, which writes one from a backend that runs)."""

from numbisect.backends.dump.runner import DumpBackend, open_dump, write_dump  # noqa: F401  (the package's API)

"""What the layers above reach of the hf kind beyond a Backend: its `ReferenceServices`
(numbisect.backends.protocols), opened through the registry
(`numbisect.backends.services(kind)`): a trainer's transformers model in memory wrapped as
the reference (numbisect.live.attach), nothing loaded, nothing installed
(`HFBackend.of`, numbisect.backends.hf.runner)."""

from __future__ import annotations

from numbisect.backends.hf.runner import HFBackend

of = HFBackend.of  # a backend on a transformers model already in memory

__all__ = ["of"]

"""The `hf` backend: a transformers model on a local checkpoint.

- `runner.py`: `HFBackend` (loading, batched and decode-mode forwards, captures, feeds)
  and `open_hf`, the registry's loader.
- `swap.py`: a donor (reference) module swapped in behind a `CastAdapter`.
- `faults.py`: the faults only a transformers model needs its own way (the experts'
  low-precision sum; a router's experts chosen again after a perturbed gate).
- `routing.py`: the routing probe, a forward hook on each router.
- `rope.py`: MLA's rotary part as a module per attention (the `rope` units).
- `whatif.py`: the precision what-ifs (the engine's own module in float32; the experts
  one top-k slot at a time, summed in float32).
"""

from numbisect.backends.hf.runner import HFBackend, open_hf  # noqa: F401  (the package's API)

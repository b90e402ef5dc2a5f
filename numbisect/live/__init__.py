"""numbisect inside the training loop: a trainer's model and a running engine, live.

- `attach(reference=..., engine=...)` -> `Probe` (probe.py): the comparison `bisect
  compare` makes, and the weight-sync check, over objects in memory;
- `engine.py`: the engine kind this layer attaches to and what it reaches of it, through
  the registry (`ENGINE`: numbisect.backends.services; the engine's own code lives in
  numbisect/backends/vllm/, never imported here); its settings, checked (refused in one
  line when hooks could not give a right answer), never changed;
- `weights.py`: per unit, is the engine computing with the reference's weights
  (ok, unwritten, stale, corrupted, buffer differs, missing);
- `poison.py`: poison control (`Probe.poisoned`, `Probe.check_sync`): the engine's weights
  overwritten with seeded random values before the user's sync, so a tensor it never
  wrote is `unwritten` whatever the engine held before;
- `cold.py`: the warm-vs-cold oracle (`Probe.warm_vs_cold`): the same weights loaded cold
  by a fresh engine in a child process (numbisect.backends.vllm.cold), compared per unit
  with the live one;
- `prefix.py`: right after a sync, whether the engine's prefix cache holds KV the old
  weights computed (`Probe.check_prefix_cache`);
- `sync.py`: a weight push as RL frameworks make it (vLLM's own `load_weights`);
- `sharded.py`: the weight check on an FSDP2-sharded trainer (`attach_sharded`, on every
  rank; collective-safe: the ranks agree before anything is gathered);
- `transfer.py`: a push through the engine's weight-transfer API (its transport and the
  workers' ledger in numbisect.backends.vllm.transfer): the weight version and the units
  a push never named, in every check;
- `errors.py`: the typed errors, each one line.
"""

from numbisect.live.errors import (
    EngineClosedError,
    EngineSettingError,
    HookNotFiredError,
    LiveError,
    ReferenceModelError,
    SyncError,
)
from numbisect.live.cold import WarmCold
from numbisect.live.poison import PoisonError, Poisoned
from numbisect.live.prefix import PrefixCacheCheck
from numbisect.live.probe import LiveReport, Probe, attach
from numbisect.live.sharded import ShardedError, ShardedProbe, attach_sharded
from numbisect.live.weights import WeightCheck

__all__ = ["attach", "attach_sharded", "ShardedProbe", "ShardedError", "Probe", "LiveReport", "WeightCheck", "PrefixCacheCheck", "LiveError", "EngineSettingError",
           "EngineClosedError", "HookNotFiredError", "ReferenceModelError", "SyncError", "PoisonError", "Poisoned", "WarmCold"]

"""numbisect: find the module that makes a rollout engine disagree with its reference.

1. A token trace (`trace`) runs through a reference backend and an engine backend
   (`backends`), with forward hooks capturing each canonical unit (`units`, `arch`).
2. `metrics` turns log-probs and captures into k1/k2/k3, full KL, RL cost and
   per-unit activation error.
3. `swap` transplants reference modules into the engine; `search` looks for the
   smallest set of swapped units that makes the divergence vanish.
4. `report` writes one versioned JSON document; `cli` and `tui` show it.
"""

__version__ = "0.1.0"

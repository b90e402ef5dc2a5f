"""numbisect: find the module that makes a rollout engine disagree with its reference.

A stack of layers, each a package here; a module imports only its own layer and those
below (ARCHITECTURE.md; tests/test_layering.py checks it). Top to bottom:

1. `cli`, `tui`: the `bisect` command and the Textual app; `live`: the same verbs over live
   objects (a trainer's model, a running vLLM engine), and the weight-sync check.
2. `commands`: one module per verb (`run`, `selftest`, `calibrate`, `conditions`) over a
   `session`, which opens and checks the inputs and holds both backends.
3. `search`: the culprit search over the unit graph (pure, torch-free); `pipeline`: one
   comparison of the reference and the engine over a trace, and what it measures.
4. `backends`: the registry and one folder per engine (`hf`, `vllm`, `dump`); `patching`:
   the engine-neutral changes a backend carries out (faults, swaps, probes), each undone
   by a ledger; `model`: architecture maps, units, traces, the checkpoint diff.
5. `report`: the versioned JSON document and its readers (torch-free); `common`: errors,
   safe IO, text and number formatting; `dump`: the writer an engine's process imports.
"""

__version__ = "0.1.0"

"""The small interface every backend implements (`Backend`), and what the backends share.

A backend loads one checkpoint, runs a list of samples, and returns per-token
log-probs, optionally full-vocabulary log-probs and the canonical captures of the
units asked for. Canonical form: one tensor per sample, `[tokens, ...]`, padding
removed; at a layer boundary the residual stream summed; `lm_head` holds the T-1
rows of logits that predict tokens 1..T-1.
"""

from __future__ import annotations

import errno
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from numbisect.common.errors import BackendError, InputError
from numbisect.common.safeio import check_input, loads_json, read_text
from numbisect.model.arch import ArchMap, arch_for
from numbisect.model.units import Unit, nearby_names
from numbisect.patching.ledger import Ledger
from numbisect.patching.modules import (  # noqa: F401 (the backends' names for them)
    LAYER_FLAGS,
    carry_layer_flags,
    get_module,
    hidden_arg,
    plant_weight_noise,
    with_hidden,
)
from numbisect.patching.torchops import (
    LOWP,
    LowpNorm,
    noise_hook,
    round_input_hook,
    round_logits_hook,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ForwardResult:
    token_logprobs: list[torch.Tensor]  # per sample [T-1] float32: log p(ids[t] | ids[:t]), t = 1..T-1
    full_logprobs: list[torch.Tensor] | None = None  # per sample [T-1, V] float32, when asked
    captures: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # unit -> per sample output
    inputs: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # unit -> per sample input
    # NaN marks a position with no log-prob (a rollout's own log-probs cover its completion
    # only); otherwise (partial False: an engine that ran) a NaN is a broken value, judged
    # as inf, as is a NaN on the reference side in either case.
    partial: bool = False


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise InputError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}") from None


def check_checkpoint(path: str) -> dict:
    """The parsed config.json of a checkpoint directory; InputError for a directory that is
    missing, has no config or no safetensors weights, or a config.json that is not a
    regular file (a FIFO, a link to /dev/zero), too large, not JSON (nested too deeply
    included) or not a JSON object."""
    p = Path(path)
    try:
        os.stat(p)
    except OSError as e:  # missing; a name too long, a symbolic link loop: said as what it is
        if e.errno not in (errno.ENOENT, errno.ENOTDIR):
            raise InputError(f"cannot read checkpoint directory {path}: {e.strerror or e}") from None
    if not p.is_dir():
        raise InputError(f"checkpoint directory not found: {path}")
    cfg = p / "config.json"
    if not os.path.lexists(cfg):
        raise InputError(f"{path}: no config.json in the checkpoint directory")
    if not list(p.glob("*.safetensors")):
        pickles = [f.name for f in p.glob("*.bin")] + [f.name for f in p.glob("*.pt")]
        extra = f" (found {', '.join(pickles)}: pickled weights are never loaded)" if pickles else ""
        raise InputError(f"{path}: no *.safetensors weights in the checkpoint directory{extra}")
    obj = loads_json(read_text(cfg, "config.json", limit=CONFIG_LIMIT), str(cfg))
    if not isinstance(obj, dict):
        raise InputError(f"{cfg}: config.json must hold a JSON object, not {type(obj).__name__}")
    return obj


CONFIG_LIMIT = 16 * 2**20  # a config.json larger than this is not a model config
HEADER_LIMIT = 100 * 2**20  # the safetensors format's own limit on a header
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2")
POSITIVE_INTS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "intermediate_size", "moe_intermediate_size", "head_dim", "max_position_embeddings",
                 "num_experts", "num_local_experts", "num_experts_per_tok", "n_routed_experts")


def check_weights(path: str, config: dict) -> None:
    """Read only the header of every `*.safetensors` file of a checkpoint and refuse, naming
    the file (and tensor): a file that is not a regular file, a header that is not JSON, a
    file shorter than its header says (truncated), and an integer (or bool) tensor unless
    config.json declares a quantization (`quantization_config`): integer weights in a
    float checkpoint would be cast silently."""
    quantized = bool(config.get("quantization_config") or config.get("quantization"))
    for f in sorted(Path(path).glob("*.safetensors")):
        check_input(f, "weights file")
        size = f.stat().st_size
        try:
            with open(f, "rb") as fh:
                head = fh.read(8)
                n = int.from_bytes(head, "little") if len(head) == 8 else -1
                if n < 2 or n > HEADER_LIMIT or 8 + n > size:
                    raise InputError(f"{f}: not a safetensors file, or truncated (header of {n} bytes, file of {size})")
                raw = fh.read(n)
        except OSError as e:
            raise InputError(f"cannot read weights file {f}: {e.strerror or e}") from None
        header = loads_json(raw, f"{f}: safetensors header")
        if not isinstance(header, dict):
            raise InputError(f"{f}: the safetensors header is not a JSON object")
        end = 0
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            offs = meta.get("data_offsets") if isinstance(meta, dict) else None
            dtype = meta.get("dtype") if isinstance(meta, dict) else None
            if (not isinstance(dtype, str) or not isinstance(offs, list) or len(offs) != 2
                    or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offs) or offs[0] > offs[1]):
                raise InputError(f"{f}: tensor {name}: bad safetensors header entry")
            end = max(end, offs[1])
            if dtype not in FLOAT_DTYPES and not quantized:
                raise InputError(f"{f}: tensor {name} is {dtype}, not a float type, and config.json declares no "
                                 "quantization (quantization_config): refusing to cast it silently")
        if 8 + n + end > size:
            raise InputError(f"{f}: truncated: its header describes {8 + n + end} bytes, the file has {size}")


def check_config_fields(cfg: dict, where: str) -> None:
    """Refuse config.json size fields (top level or text_config) that are not positive
    integers: transformers takes them as given and the model would fail to build."""
    for scope in (cfg, cfg.get("text_config")):
        if not isinstance(scope, dict):
            continue
        for key in POSITIVE_INTS:
            v = scope.get(key)
            if v is None and key in scope and key in ("head_dim", "num_key_value_heads"):
                continue  # derived by transformers when null
            if key in scope and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise InputError(f"{where}: {key}: expected int >= 1 (a positive integer), got {json.dumps(v)[:40]}")
    if "text_config" in cfg and not isinstance(cfg["text_config"], dict):
        raise InputError(f"{where}: text_config must be an object")


def load_config(path: str):
    """The transformers config of a local checkpoint (no hub, no remote code); the
    config.json and the weights' headers checked first (`check_checkpoint`,
    `check_config_fields`, `check_weights`)."""
    raw = check_checkpoint(path)
    check_config_fields(raw, f"{path}/config.json")
    check_weights(path, raw)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception as e:  # transformers raises many kinds for a bad config
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        raise InputError(f"{path}/config.json: {' '.join(lines[:2]) or type(e).__name__}") from None


ENGINE_MODES = ("prefill", "decode")

# The precision what-ifs (numbisect.pipeline.whatif) a backend installs.
WHATIF_UNIT = "fp32 unit"  # the whole unit computed in float32
WHATIF_WSUM = "fp32 weighted sum"  # an MoE block's expert weighted sum accumulated in float32


class Backend:
    """One way to run a model over a token trace: the interface the core calls.

    Capabilities (class attributes):
    - `kind`: the backend's name in the registry (`numbisect.backends.BACKENDS`).
    - `modes`: how `forward` may run the trace: "prefill" (every token in one forward)
      and, where the backend has it, "decode" (prompt prefilled, then one forced token
      per step).
    - `module_names`: the table of the architecture map (`ArchMap.hf` / `ArchMap.vllm`)
      that names the modules of its model.
    - `remote`: the model lives in worker processes: the core arranges its state with
      `prepare(faults, swapped, donor)` / `undo()` (numbisect.patching.arrangement), not with
      the methods below, and runs no precision what-if on it.
    - `batch_size`: samples per call of the model (a routing probe counts calls by it).

    State changes: each records its undo in the `Ledger` it is given
    (numbisect.patching.ledger), so the caller puts the model back by undoing the ledger.
    A backend that cannot make one raises an InputError naming itself (`lacks`), never
    another engine's way. `plant_fault` here plants the faults that act on any module's
    call; the others are the engine's own:
    - `plant_fault(fault, ledger)`: a numbisect.patching.faults.Fault, already checked.
    - `swap_unit(unit, donor, ledger)`: put the donor's (the reference's) module for `unit`
      in place, adapted to this engine's calling convention.
    - `install_routing_probe(probe, ledger)`: route each MoE layer's expert choice
      through `probe.route(unit, call, logits, weights, ids)` (numbisect.pipeline.routing).
    - `install_whatif(whatif, unit, donor, faults, ledger)`: put the what-if
      (`WHATIF_UNIT`, `WHATIF_WSUM`) in place over the planted `faults`; returns those
      to plant again on top of it. `whatif_not_carried(whatif, unit, faults)`: the
      specs of the noise faults it loses.
    """

    kind = "base"
    modes: tuple[str, ...] = ("prefill",)
    module_names = "hf"
    remote = False
    batch_size = 1
    # Its activations were recorded by an engine elsewhere (a dump): read per sample
    # (`sample(i, units, inputs)`), never computed here; nothing can be planted or swapped.
    recorded = False

    def __init__(self, path: str, dtype: str):
        self.adopt(path, dtype, load_config(path))

    def adopt(self, path: str, dtype: str, config) -> None:
        """Set up from a transformers `config` already in memory: `__init__` after reading a
        checkpoint's, and a backend wrapped around a live model (numbisect.live), whose
        `path` is a label ("live:...") and whose config is the model's own."""
        self.path = path
        self.dtype_name = dtype
        self.dtype = parse_dtype(dtype)
        self.config = config
        self.arch: ArchMap = arch_for(self.config)
        self.units: list[Unit] = self.arch.units(self.config)
        self.unit_by_name = {u.name: u for u in self.units}
        self.vocab_size: int = self.config.get_text_config().vocab_size

    # -- what every backend implements -------------------------------------------------
    def forward(
        self,
        samples,
        *,
        full_logits: bool = False,
        capture: list[str] | tuple[str, ...] = (),
        capture_inputs: list[str] | tuple[str, ...] = (),
        feed: dict[str, list[torch.Tensor]] | None = None,
        mode: str = "prefill",
    ) -> ForwardResult:
        raise NotImplementedError

    def check_mode(self, mode: str) -> None:
        check_engine_mode(self.kind, mode, self.modes)

    @property
    def root(self) -> nn.Module:
        raise NotImplementedError

    def close(self) -> None:
        pass

    # -- state changes (see the class docstring) ----------------------------------------
    def lacks(self, what: str) -> InputError:
        return InputError(f"the {self.kind} backend cannot {what}")

    def plant_fault(self, fault, ledger: Ledger) -> None:
        mod = self.module(fault.unit)
        if fault.kind == "weight_noise":
            plant_weight_noise(mod, fault, ledger)
        elif fault.kind == "output_noise":
            ledger.hooks(mod, post=noise_hook(fault.unit, fault.value), with_kwargs=False)
        elif fault.kind == "router_logits":  # the router GEMM in low precision: input and logits rounded
            dtype = LOWP[fault.dtype]
            ledger.hooks(mod, pre=round_input_hook(dtype), post=round_logits_hook(dtype), with_kwargs=False)
        elif fault.kind == "rmsnorm_no_upcast":
            ledger.replace(self.root, self.module_path(fault.unit), LowpNorm(mod, LOWP[fault.dtype]))
        else:
            raise self.lacks(f"plant the fault {fault.kind} (at {fault.unit})")

    def swap_unit(self, unit: Unit, donor, ledger: Ledger) -> None:
        raise self.lacks(f"swap units (asked to swap {unit.name})")

    def install_routing_probe(self, probe, ledger: Ledger) -> None:
        raise self.lacks("record or replay expert routing")

    def install_whatif(self, whatif: str, unit: Unit, donor, faults, ledger: Ledger) -> list:
        raise self.lacks(f"run the precision what-if {whatif!r} (on {unit.name})")

    def install_selection_probe(self, probe, ledger: Ledger) -> None:
        """Record each sparse-attention indexer's picked keys and scores (numbisect.pipeline.selection)."""
        raise self.lacks("record sparse attention's token selection (indexer)")

    def install_state_probe(self, probe, ledger: Ledger) -> None:
        """Record each linear-attention unit's recurrent state after a forward (numbisect.pipeline.recurrent)."""
        raise self.lacks("read the recurrent state of linear attention")

    def whatif_not_carried(self, whatif: str, unit: Unit, faults) -> list[str]:
        return []

    # -- shared -------------------------------------------------------------------------
    def unit(self, name: str) -> Unit:
        try:
            return self.unit_by_name[name]
        except KeyError:
            near = nearby_names(name, list(self.unit_by_name))
            hint = f"; nearby: {', '.join(near)}" if near else ""
            raise InputError(f"no unit {name!r} in {self.arch.name}{hint}") from None

    def module_path(self, name: str) -> str:
        u = self.unit(name)
        p = self.arch.path(self.module_names, u)
        if p is None:
            raise InputError(f"unit {name} has no module in the {self.kind} backend of {self.arch.name}")
        return p

    def module(self, name: str) -> nn.Module:
        return get_module(self.root, self.module_path(name))

    def describe(self) -> dict:
        return {"backend": self.kind, "path": self.path, "dtype": self.dtype_name, "arch": self.arch.name}


def check_engine_mode(kind: str, mode: str, modes: tuple[str, ...]) -> None:
    """InputError unless a backend of `kind` that runs in `modes` can run in `mode`."""
    if mode not in ENGINE_MODES:
        raise InputError(f"unknown engine mode {mode!r}; choose one of {', '.join(ENGINE_MODES)}")
    if mode not in modes:
        raise InputError(f"--engine-mode {mode} is not available on the {kind} engine (it runs: {', '.join(modes)})")


def fail(e: BaseException, what: str) -> BackendError:
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    # pydantic puts the useful line second ("1 validation error for X" / "Value error, ...")
    msg = " ".join(lines[:2]) if lines else type(e).__name__
    if len(msg) > 300:
        msg = msg[:297] + "..."
    return BackendError(f"{what}: {msg}")

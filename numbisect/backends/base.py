"""The small interface every backend implements, and the hook machinery they share.

A backend loads one checkpoint, runs a list of samples, and returns per-token
log-probs, optionally full-vocabulary log-probs and the canonical captures of the
units asked for. Canonical form: one tensor per sample, `[tokens, ...]`, padding
removed; at a layer boundary the residual stream summed; `lm_head` holds the T-1
rows of logits that predict tokens 1..T-1.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from numbisect.arch import ArchMap, arch_for
from numbisect.errors import BackendError, InputError
from numbisect.units import Unit, nearby_names

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
    """Refuse a directory that is missing, has no config or no safetensors weights."""
    p = Path(path)
    if not p.is_dir():
        raise InputError(f"checkpoint directory not found: {path}")
    cfg = p / "config.json"
    if not cfg.is_file():
        raise InputError(f"{path}: no config.json in the checkpoint directory")
    if not list(p.glob("*.safetensors")):
        pickles = [f.name for f in p.glob("*.bin")] + [f.name for f in p.glob("*.pt")]
        extra = f" (found {', '.join(pickles)}: pickled weights are never loaded)" if pickles else ""
        raise InputError(f"{path}: no *.safetensors weights in the checkpoint directory{extra}")
    try:
        return json.loads(cfg.read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"{cfg}: unreadable config.json ({e})") from None


def load_config(path: str):
    """The transformers config of a local checkpoint (no hub, no remote code)."""
    check_checkpoint(path)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception as e:  # transformers raises many kinds for a bad config
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        raise InputError(f"{path}/config.json: {' '.join(lines[:2])}") from None


def get_module(root: nn.Module, path: str) -> nn.Module:
    return root.get_submodule(path)


def set_module(root: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, new)


def first(x: Any) -> torch.Tensor:
    return x[0] if isinstance(x, (tuple, list)) else x


def hidden_arg(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The hidden-states input of a module call: first positional tensor or `hidden_states`."""
    if "hidden_states" in kwargs:
        return kwargs["hidden_states"]
    for a in args:
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return a
    return None


def with_hidden(args: tuple, kwargs: dict, x: torch.Tensor, new: torch.Tensor) -> tuple[tuple, dict]:
    """(args, kwargs) of a module call with its hidden-states input `x` (as `hidden_arg`
    found it) replaced by `new`."""
    if "hidden_states" in kwargs:
        return args, {**kwargs, "hidden_states": new}
    i = next(i for i, a in enumerate(args) if a is x)
    return args[:i] + (new,) + args[i + 1 :], kwargs


ENGINE_MODES = ("prefill", "decode")


class Backend:
    """One way to run a model over a token trace."""

    kind = "base"
    # How `forward` may run the trace: "prefill" (every token in one forward) and, where
    # the backend has it, "decode" (prompt prefilled, then one forced token per step).
    modes: tuple[str, ...] = ("prefill",)

    def __init__(self, path: str, dtype: str):
        self.path = path
        self.dtype_name = dtype
        self.dtype = parse_dtype(dtype)
        self.config = load_config(path)
        self.arch: ArchMap = arch_for(self.config)
        self.units: list[Unit] = self.arch.units(self.config)
        self.unit_by_name = {u.name: u for u in self.units}
        self.vocab_size: int = self.config.get_text_config().vocab_size
        self._originals: dict[str, nn.Module] = {}  # module path -> original module, while swapped

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
        p = self.arch.path(self.kind, u)
        if p is None:
            raise InputError(f"unit {name} has no module in the {self.kind} backend of {self.arch.name}")
        return p

    def module(self, name: str) -> nn.Module:
        return get_module(self.root, self.module_path(name))

    def replace(self, name: str, new: nn.Module) -> None:
        """Put `new` where unit `name` lives; `restore()` puts the originals back."""
        path = self.module_path(name)
        if path not in self._originals:
            self._originals[path] = get_module(self.root, path)
        set_module(self.root, path, new)

    def original(self, name: str) -> nn.Module:
        path = self.module_path(name)
        return self._originals.get(path) or get_module(self.root, path)

    def restore(self) -> None:
        # Innermost paths first so that a parent put back last is the original one.
        for path in sorted(self._originals, key=len, reverse=True):
            set_module(self.root, path, self._originals[path])
        self._originals.clear()

    def describe(self) -> dict:
        return {"backend": self.kind, "path": self.path, "dtype": self.dtype_name, "arch": self.arch.name}


def check_engine_mode(kind: str, mode: str, modes: tuple[str, ...]) -> None:
    """InputError unless a backend of `kind` that runs in `modes` can run in `mode`."""
    if mode not in ENGINE_MODES:
        raise InputError(f"unknown engine mode {mode!r}; choose one of {', '.join(ENGINE_MODES)}")
    if mode not in modes:
        raise InputError(f"--engine-mode {mode} is not available on the {kind} engine (it runs: {', '.join(modes)})")


def register(mod: nn.Module, handles: list, pre: Callable | None = None, post: Callable | None = None) -> None:
    if pre is not None:
        handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
    if post is not None:
        handles.append(mod.register_forward_hook(post, with_kwargs=True))


def fail(e: BaseException, what: str) -> BackendError:
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    # pydantic puts the useful line second ("1 validation error for X" / "Value error, ...")
    msg = " ".join(lines[:2]) if lines else type(e).__name__
    if len(msg) > 300:
        msg = msg[:297] + "..."
    return BackendError(f"{what}: {msg}")

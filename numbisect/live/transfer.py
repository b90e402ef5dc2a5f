"""A push through the engine's weight-transfer API, and the check around it.

The engine's side (vLLM 0.32's weight-transfer API: an in-process transport, `push`, the
ledger `watch` keeps in each worker, the weight version) lives in
numbisect.backends.vllm.transfer, reached through the registry (numbisect.live.engine's
`ENGINE`); its names are this module's API too (`BACKEND`, `register`, `send`, `push`,
`watch`, `weight_version`). Here, in checkpoint terms:

- `last_push(llm, arch, config, names)`: the last push of a watched engine judged against
  the reference's names: the units it never named (`units_not_pushed`) and whether the
  engine serves a mixed state (some units pushed, others not, the push finished);
- `annotate(check, llm, arch, config)`: a weight check (`WeightCheck`) given the engine's
  weight version and, on a watched engine, the last push. `Probe.check_weights` does this
  on every check, so every report and replay bundle records the version.
"""

from __future__ import annotations

from numbisect.live.engine import ENGINE
from numbisect.model.ckptdiff import apply_renames, unit_of, unit_prefixes

BACKEND = ENGINE.TRANSFER_BACKEND  # the in-process transport's name: LLM(weight_transfer_config={"backend": BACKEND})
register = ENGINE.register_transfer  # () -> BACKEND: the in-process transport registered with vLLM (once)
send = ENGINE.transfer_send  # (items) -> update_info naming tensors left in this process
push = ENGINE.transfer_push  # (llm, items, version=None, chunks=1): a push through the weight-transfer API
watch = ENGINE.watch_pushes  # (llm): a ledger of every push in each of the engine's workers
weight_version = ENGINE.weight_version  # (llm) -> the engine's weight version, or None


def last_push(llm, arch, config, names: list[str]) -> dict | None:
    """The last update session of a watched engine, judged against the reference's
    checkpoint `names`: its session number, chunks, whether it finished (or its error), the
    units of `names` it never named and whether the engine serves a mixed state; None on an
    engine not watched (`watch`)."""
    s = ENGINE.last_session(llm)
    if s is None:
        return None
    prefixes = unit_prefixes(arch, config)
    renames = getattr(arch, "ckpt_renames", {}) or {}

    def unit(n: str) -> str:
        return unit_of(apply_renames(n, renames), prefixes) or "(no unit)"

    pushed = {unit(n) for n in s["names"]}
    every = list(dict.fromkeys(unit(n) for n in names))
    order = {u.name: i for i, u in enumerate(arch.units(config))}
    missing = sorted((u for u in every if u not in pushed), key=lambda u: order.get(u, len(order)))  # the model's order
    state = "under way" if not s["finished"] and not s["error"] else "finished" if s["finished"] else "raised"
    return {"session": s["session"], "chunks": s["chunks"], "state": state, "error": s["error"],
            "tensors": len(set(s["names"])), "units_not_pushed": missing,
            "mixed_state": bool(missing) and len(missing) < len(every) and s["finished"]}


def annotate(check, llm, arch, config, names: list[str]):
    """`check` (a WeightCheck) given the engine's weight version and its last push (module doc, 4)."""
    if llm is None:
        return check
    check.weight_version = weight_version(llm)
    check.push = last_push(llm, arch, config, names)
    if check.push and check.push["units_not_pushed"] and check.push["state"] != "under way":
        units = check.push["units_not_pushed"]
        note = (f"the last push ({check.push['state']}) never named {len(units)} unit(s): "
                f"{', '.join(units[:6])}{', ...' if len(units) > 6 else ''}")
        for u in check.units:
            if u.unit in units and u.status != "ok":
                u.summary = f"{u.summary}; not in the last push" if u.summary else "not in the last push"
        check.push["note"] = note
    return check


__all__ = ["BACKEND", "register", "send", "push", "watch", "weight_version", "last_push", "annotate"]

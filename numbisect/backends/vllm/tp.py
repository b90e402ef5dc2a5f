"""vLLM with tensor parallelism: log-probs, swaps and captures inside each worker.

With `tensor_parallel_size=N` the model lives in N worker processes, each holding a
shard, so nothing can be hooked or replaced from the driver. Everything goes through
`llm.apply_model(fn)`, which pickles `fn` to every worker and returns each worker's
result (it needs `VLLM_ALLOW_INSECURE_SERIALIZATION=1`, and `fn` must be importable:
the module-level functions below, bound with `functools.partial`).

1. Start: `LLM(..., tensor_parallel_size=N, distributed_executor_backend="mp")`, each
   worker bound to its own core (`VLLM_CPU_OMP_THREADS_BIND`, "0|1" for two).
2. Log-probs: `generate` with prompt log-probs, exactly as the in-process backend.
3. Swaps: `apply_swap_spec` in every worker (each loads the donor checkpoint once).
   Whole units (embed, norms, attention, MLP/MoE blocks, layers, the logits) return
   the full tensor on every rank, as vLLM's own modules do after their all-reduce. The
   routed experts' weighted sum (and glm4_moe's shared expert) are the exception: vLLM
   all-reduces them after the module, so once swapped they return the full sum on
   rank 0 and zeros on the other ranks. A Gated DeltaNet's output projection, swapped,
   gathers its input (each rank's heads) first. Planted faults are planted in every
   worker (an output noise on a unit held in shards, such as `attn.out_gate`, is drawn
   per rank's shard: a fault at the same unit, not the same numbers as with one rank).
4. Captures: forward hooks in every worker, read back after each sample, put in
   canonical form: units whose output is replicated (every rank holds the full tensor:
   everything vLLM all-reduces or gathers inside the unit) are taken from rank 0 and
   checked to be equal on every rank; the routed experts' sum (and a shared expert
   reduced by its block) is a row-parallel partial sum per rank, so the ranks' tensors
   are added; the logits are gathered on rank 0 by vLLM's logits processor already;
   per-head units (a Gated DeltaNet's `out_gate`, MLA's `rope`) put the ranks' heads
   side by side, a Gated DeltaNet's `conv` and `gates` part by part (`GATHER`; swapped,
   their donor takes every rank's input and hands each rank its shard back). The
   recurrent-state probe reads each rank's heads from its mamba cache and puts them
   together the same way.
5. Prefix reuse: the driver plans as for an in-process engine (`numbisect.patching.prefix`);
   every worker records and replays its own layers' outputs (replicated on every rank).
6. Teacher forcing (local error): each sample's reference inputs go to every worker, whose
   pre-hooks hand them to the units (`worker_feed`; MLA's rope gets its rank's heads).
7. Precision what-ifs: put in every worker (`worker_whatif`), a float32 module fitted to its
   shard as a swap is.
8. Not yet under tensor parallelism: input captures, the local pass of the recurrent state
   and of the indexer's selection.
"""

from __future__ import annotations

import functools
import os

import torch

from numbisect.backends.base import WHATIF_UNIT, Backend, ForwardResult, fail
from numbisect.backends.options import check_vllm_opts
from numbisect.backends.vllm import hookpoints, moe, startup
from numbisect.backends.vllm.model import (
    VIEW_KEY,
    VLLMModel,
    apply_swap_spec,
    donor_of,
    forget_donor,
    swap_ledger,
    undo_swap_spec,
    view,
)
from numbisect.backends.vllm.recurrent import install_probe
from numbisect.backends.vllm.runner import (
    _canonical_output,
    _feed,
    adopted,
    bad_input,
    import_vllm,
    quiet_stderr,
    shutdown,
)
from numbisect.common.errors import BackendError, InputError
from numbisect.common.procenv import environ
from numbisect.patching.faults import apply_faults, parse_fault
from numbisect.patching.ledger import Ledger
from numbisect.patching.prefix import PrefixCache
from numbisect.patching.probes.state import StateProbe
from numbisect.patching.swap import SwapSpec

# How the ranks' captures of a unit kind become one canonical tensor.
# The logits: vLLM's logits processor gathers the vocabulary shards on rank 0 (the
# others may hold none). Every other kind: "replicated" (rank 0, equal on every rank).
# The routed experts' weighted sum, and a shared expert whose down projection leaves
# its all-reduce to the MoE block (glm4_moe), are row-parallel partial sums: "sum".
# A Gated DeltaNet's gated norm (`out_gate`) runs on each rank's own value heads, a
# contiguous block of them in rank order: "cat" (the ranks' [tokens, heads/N * head dim]
# side by side). MLA's rotary part (`rope`, packed [tokens, (heads + 1) * rope]:
# numbisect.backends.mla_rope) holds each rank's query heads and the one shared key:
# "mla" (the ranks' query heads side by side, then the key, equal on every rank).
# A Gated DeltaNet's conv (channels q, k, v) and gates ((a, b) in, (g, beta) out) hold
# each rank's heads of every part, part by part: "parts" (`part_sizes`: each part's
# blocks put side by side, then the next part).
GATHER = {"experts": "sum", "shared_expert": "sum", "lm_head": "rank0", "out_gate": "cat", "rope": "mla",
          "conv": "parts", "gates": "parts"}

# Swapped units whose vLLM module takes a rank's shard of the input: the linear
# attention's output projection (RowParallelLinear, all-reduced inside) is handed its
# heads' part of the gated norm's output, the donor's nn.Linear wants all of it: the
# input is gathered from the ranks first, and the donor's full output (what the
# all-reduce gave) returned on every rank.
GATHER_INPUT = ("out_proj",)


def part_sizes(kind: str, config) -> list[int]:
    """The whole widths of the parts a "parts" unit's tensor is made of (conv: q, k, v;
    gates: the two per-head halves), each split evenly over the ranks."""
    text = config.get_text_config()
    if kind == "conv":
        key = text.linear_num_key_heads * text.linear_key_head_dim
        return [key, key, text.linear_num_value_heads * text.linear_value_head_dim]
    return [text.linear_num_value_heads] * 2


def regroup(per_rank: list[torch.Tensor], sizes: list[int]) -> torch.Tensor:
    """The ranks' shards of a "parts" tensor (each rank's blocks of every part, along the
    last dimension) as one canonical tensor: every rank's block of part 0, then of part 1..."""
    world = len(per_rank)
    split = [t.split([n // world for n in sizes], dim=-1) for t in per_rank]
    return torch.cat([blocks[j] for j in range(len(sizes)) for blocks in split], dim=-1)


def shard(t: torch.Tensor, sizes: list[int], rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s shard of a canonical "parts" tensor (`regroup` undone)."""
    return torch.cat([part.chunk(world, dim=-1)[rank] for part in t.split(sizes, dim=-1)], dim=-1)


def _tp():
    from vllm.distributed import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()


# -- functions that run inside each worker (pickled by reference) ------------------------------
def worker_rank(model) -> tuple[int, int]:
    return _tp()


def worker_swap(model, spec: SwapSpec, engine_dtype: str) -> list[str]:
    """`apply_swap_spec`, then each swapped module fitted to its shard (`_fit_swapped`)."""
    names = apply_swap_spec(model, spec, engine_dtype)
    _fit_swapped(view(model, engine_dtype), names, swap_ledger(model))  # undone with the swaps
    return names


def _fit_swapped(engine, names: list[str], ledger: Ledger) -> None:
    """Step 3 for the swapped units `names` of this worker (nothing at one rank): a routed
    experts' sum kept on rank 0 only, a sharded input gathered, a "parts" donor run on every
    rank's input; each change in `ledger`."""
    rank, world = _tp()
    if world == 1:
        return
    for name in names:
        kind = engine.unit(name).kind
        if kind in GATHER_INPUT:
            ledger.setattr(engine.module(name), "forward", _gathering(engine.module(name).forward))
            continue
        if GATHER.get(kind) == "parts":  # the donor computes every head from every rank's input
            inner = engine.module(name).inner
            ledger.setattr(inner, "forward", _by_parts(inner.forward, part_sizes(kind, engine.config), rank, world))
            continue
        if GATHER.get(kind) != "sum":
            continue
        # The swapped module computes the whole sum; the block's all-reduce adds the ranks.
        obj, attr = (engine.module(name).routed_experts, "forward_modular") if kind == "experts" else (engine.module(name), "forward")
        full = getattr(obj, attr)

        def only_rank0(*args, _full=full, **kwargs):
            out = _full(*args, **kwargs)
            return out if rank == 0 else torch.zeros_like(out)

        ledger.setattr(obj, attr, only_rank0)


_WHATIF = "_numbisect_whatif"  # model.__dict__ key: the ledger of the what-if in force


def worker_whatif(model, whatif: str, unit: str, donor_path: str, donor_dtype: str, faults: list[str],
                  engine_dtype: str) -> int:
    """A precision what-if in this worker, over the faults and swaps already in place: the
    engine's own `install_whatif` (the reference's module in float32, fitted to the shard as a
    swap is; or the experts' sum in float32 in the fused-MoE runner), then the faults it
    plants again on top (`faults`: all the session's, as specs). `worker_unwhatif` undoes it."""
    worker_unwhatif(model)
    engine = view(model, engine_dtype)
    ledger = Ledger()
    model.__dict__[_WHATIF] = ledger
    u = engine.unit(unit)
    replant = engine.install_whatif(whatif, u, donor_of(donor_path, donor_dtype), [parse_fault(f) for f in faults], ledger)
    if whatif == WHATIF_UNIT:
        _fit_swapped(engine, [unit], ledger)
    apply_faults(engine, replant, ledger)
    return len(replant)


def worker_unwhatif(model) -> None:
    ledger = model.__dict__.pop(_WHATIF, None)
    if ledger is not None:
        ledger.undo()


def _gathering(forward):
    """`forward` on the input gathered from every rank along its last dimension."""
    from vllm.distributed import tensor_model_parallel_all_gather

    def gathered(x, *args, **kwargs):
        return forward(tensor_model_parallel_all_gather(x.contiguous(), dim=-1), *args, **kwargs)

    return gathered


def _by_parts(forward, sizes: list[int], rank: int, world: int):
    """`forward` on the "parts" input gathered from every rank (`regroup`), its output cut
    back to this rank's shard (`shard`)."""
    from vllm.distributed import tensor_model_parallel_all_gather

    def whole(x, *args, **kwargs):
        full = tensor_model_parallel_all_gather(x.contiguous(), dim=-1)
        out = forward(regroup(list(full.chunk(world, dim=-1)), sizes), *args, **kwargs)
        return shard(out, sizes, rank, world)

    return whole


def worker_forget(model, donor_path: str | None = None) -> None:
    """Everything numbisect keeps in this worker taken back (an engine numbisect did not
    start is left as found): swaps, faults, hooks, feeds, what-ifs undone, the prefix
    recordings and the view of the model dropped, the donor loaded from `donor_path` too."""
    for undo in (worker_unwhatif, worker_unswap, worker_unfault, worker_unhook, worker_unfeed, worker_state_unprobe):
        undo(model)
    model.__dict__.pop("_numbisect_prefix", None)
    model.__dict__.pop(VIEW_KEY, None)
    if donor_path is not None:
        forget_donor(donor_path)


def worker_unswap(model) -> None:
    undo_swap_spec(model)


def worker_faults(model, specs: list[str], engine_dtype: str) -> int:
    """Plant faults (`numbisect.patching.faults` specs) in this worker's shard; `worker_unfault` undoes them.
    Noise is seeded from the unit name, so every rank draws the same."""
    worker_unfault(model)
    model.__dict__["_numbisect_planted"] = apply_faults(view(model, engine_dtype), [parse_fault(s) for s in specs])
    return len(specs)


def worker_unfault(model) -> None:
    planted = model.__dict__.pop("_numbisect_planted", None)
    if planted is not None:
        planted.undo()


def worker_hooks(model, units: list[str], engine_dtype: str) -> int:
    """Register capture hooks on `units`; outputs pile up until `worker_take`."""
    worker_unhook(model)
    engine = view(model, engine_dtype)
    seen: dict[str, list] = {u: [] for u in units}
    hooks = Ledger()
    for name in units:
        kind = engine.unit(name).kind
        mod = engine.module(name)
        if kind == "experts":
            moe.record_routed(mod.routed_experts, seen[name], hooks, scale=moe.output_scale(mod))
            continue

        def post(m, args, kwargs, out, name=name, kind=kind):
            t = _canonical_output(kind, out) if out is not None else None
            if isinstance(t, torch.Tensor):
                seen[name].append(t.detach().to("cpu", copy=True))

        # A gated shared expert (Qwen3.5-MoE) is read before its gate, as in-process (runner.py).
        hooks.hooks(moe.shared_capture_point(mod) if kind == "shared_expert" else mod, post=post)
    model.__dict__["_numbisect_hooks"] = (hooks, seen)
    return len(hooks)


def mla_shard(t: torch.Tensor, rope: int, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s part of a canonical MLA `rope` tensor ([.., (heads + 1) * rope]: every query
    head, then the shared key; `_gather`'s "mla" undone): its block of query heads and the key."""
    queries = t[..., :-rope]
    return torch.cat([queries.chunk(world, dim=-1)[rank], t[..., -rope:]], dim=-1)


def worker_feed(model, feed: dict, engine_dtype: str) -> int:
    """Teacher forcing in this worker, for one sample: a pre-hook on each unit of `feed` (unit ->
    the reference's input, or the two parts of a residual add) hands the unit that input, as
    the in-process engine does (`runner._feed`). Every fed input is replicated on the ranks
    (hidden states, the residual stream) but MLA's `rope`, whose query heads are sharded: each
    rank is handed its own heads and the key. `worker_unfeed` removes the hooks."""
    worker_unfeed(model)
    engine = view(model, engine_dtype)
    rank, world = _tp()
    hooks = Ledger()
    for name, fed in feed.items():
        kind = engine.unit(name).kind
        if GATHER.get(kind) == "mla" and world > 1:
            fed = mla_shard(fed, engine.config.get_text_config().qk_rope_head_dim, rank, world)
        elif GATHER.get(kind, "replicated") not in ("replicated", "sum", "rank0"):
            raise BackendError(f"{name}: its input is held in shards across the ranks; it cannot be fed")

        def pre(m, args, kwargs, kind=kind, fed=fed):
            args, kwargs = list(args), dict(kwargs)
            _feed(kind, args, kwargs, fed)
            return tuple(args), kwargs

        hooks.hooks(engine.module(name), pre=pre)
    model.__dict__["_numbisect_feed"] = hooks
    return len(feed)


def worker_unfeed(model) -> None:
    hooks = model.__dict__.pop("_numbisect_feed", None)
    if hooks is not None:
        hooks.undo()


def worker_take(model) -> dict[str, list[torch.Tensor]]:
    """The outputs captured since the last call (and forget them)."""
    _, seen = model.__dict__.get("_numbisect_hooks", (None, {}))
    out = {u: list(v) for u, v in seen.items()}
    for v in seen.values():
        v.clear()
    return out


def worker_unhook(model) -> None:
    hooks, _ = model.__dict__.pop("_numbisect_hooks", (None, {}))
    if hooks is not None:
        hooks.undo()


def worker_state_probe(model, engine_dtype: str) -> str:
    """The recurrent-state probe (`recurrent.install_probe`) on this worker's linear units,
    recording into a probe of its own until `worker_state_unprobe`; returns where it reads."""
    worker_state_unprobe(model)
    engine = view(model, engine_dtype)
    probe, ledger = StateProbe(engine), Ledger()
    install_probe(engine, probe, ledger)
    model.__dict__["_numbisect_state"] = (probe, ledger)
    return probe.source


def worker_state_take(model) -> dict[str, torch.Tensor]:
    """This rank's states of its heads since the last call, [heads / N, k_dim, v_dim] per unit."""
    probe, _ = model.__dict__.get("_numbisect_state", (None, None))
    return probe.take() if probe is not None else {}


def worker_state_unprobe(model) -> None:
    _, ledger = model.__dict__.pop("_numbisect_state", (None, None))
    if ledger is not None:
        ledger.undo()


def worker_prefix_begin(model, swapped: list[str], source: list[str] | None, upto: int, clear: bool,
                        engine_dtype: str) -> int:
    """Prefix reuse inside this worker (`numbisect.patching.prefix`): replay layers 0..upto-1 from the
    recording of the trial that swapped `source`, record the others. The driver keeps the
    same cache of swapped sets and decides; every worker mirrors its recordings."""
    cache = model.__dict__.setdefault("_numbisect_prefix", PrefixCache())
    if clear:
        cache.clear()
    rec = None
    if upto:
        rec = next((r for r in cache.recordings if r.swapped == frozenset(source)), None)
        if rec is None:
            raise BackendError("prefix reuse: a worker lost the recording to replay; run with --no-prefix-reuse")
    ctx = cache.run(view(model, engine_dtype), swapped, rec, upto)
    ctx.__enter__()
    model.__dict__["_numbisect_prefix_run"] = ctx
    return upto


def worker_prefix_end(model, failed: bool) -> None:
    """Put the layers back; on success the recording joins this worker's cache."""
    ctx = model.__dict__.pop("_numbisect_prefix_run", None)
    if ctx is None:
        return
    if failed:
        err = BackendError("the trial failed")
        ctx.__exit__(BackendError, err, None)
    else:
        ctx.__exit__(None, None, None)


# -- the driver side ----------------------------------------------------------------------------
# Head counts vLLM splits across ranks without checking them itself: its Gated DeltaNet
# (Qwen3.5, Qwen3-Next) gives each rank `heads / N` of them and fails inside the first
# forward ("shape '[1, 36, -1, 128]' is invalid") when N does not divide them.
SHARDED_HEADS = ("linear_num_key_heads", "linear_num_value_heads")


def check_shardable(config, tp: int, path: str) -> None:
    """Refuse, before any worker starts, a degree the checkpoint's heads cannot be split by,
    and more workers than this machine has cores (each worker is bound to its own)."""
    text = config.get_text_config()
    for name in SHARDED_HEADS:
        n = getattr(text, name, None)
        if isinstance(n, int) and n % tp:
            raise InputError(f"tensor_parallel_size={tp} does not divide {name}={n} of {path}: "
                             f"vLLM splits these heads across its {tp} workers")
    cpus = os.cpu_count() or 1
    if tp > cpus and (os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or "").count("|") != tp - 1:
        raise InputError(f"tensor_parallel_size={tp} needs {tp} cores and this machine has {cpus}: "
                         "vLLM-CPU binds each worker to its own (or give VLLM_CPU_OMP_THREADS_BIND one CPU list per worker)")


class VLLMTPBackend(Backend):
    """A vLLM engine with `tensor_parallel_size` > 1 (see the module docstring)."""

    kind = "vllm"
    module_names = "vllm"
    remote = True  # the session plants faults and swaps through `prepare` / `undo`

    def __init__(self, path: str, dtype: str = "bfloat16", tensor_parallel_size: int = 2, **engine_opts):
        check_vllm_opts({**engine_opts, "tensor_parallel_size": tensor_parallel_size}, "--engine-opt")
        super().__init__(path, dtype)
        self.tp = tensor_parallel_size
        check_shardable(self.config, self.tp, path)
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
        if (bind or "").count("|") != self.tp - 1:  # not one CPU list per rank: one core each
            bind = "|".join(str(i % (os.cpu_count() or 1)) for i in range(self.tp))
        # The workers take their binding when they start; an engine started later in this process
        # must not inherit it. They are spawned (`python -c ...`) with PYTHONSAFEPATH=1, set by
        # import_vllm (no_code_from_cwd): no module from the working directory.
        with environ({"VLLM_CPU_OMP_THREADS_BIND": bind}):
            vllm = import_vllm()
            # An engine started earlier in this process froze vLLM's environment cache
            # (the binding above would go unread): read the variables afresh.
            getattr(vllm.envs, "disable_envs_cache", lambda: None)()
            opts = {
                "max_model_len": int(engine_opts.pop("max_model_len", min(1024, getattr(self.config, "max_position_embeddings", 1024)))),
                "seed": int(engine_opts.pop("seed", 0)),
                **engine_opts,
            }
            self.options = {**opts, "tensor_parallel_size": self.tp}
            try:
                with quiet_stderr(), startup.own_engine(opts):
                    self.llm = vllm.LLM(
                        model=path, skip_tokenizer_init=True, enforce_eager=True, enable_prefix_caching=False,
                        dtype=dtype, logprobs_mode="raw_logprobs", tensor_parallel_size=self.tp,
                        distributed_executor_backend="mp", trust_remote_code=False, **opts,
                    )
            except Exception as e:
                bad_input(e)
                raise fail(e, f"vLLM could not start on {path} with tensor_parallel_size={self.tp}") from None
        ranks = self.llm.apply_model(worker_rank)
        if sorted(r for r, _ in ranks) != list(range(self.tp)):
            raise BackendError(f"expected {self.tp} tensor-parallel workers, got ranks {ranks}")
        self.ranks = [r for r, _ in ranks]  # the order apply_model answers in
        hookpoints.check_version()
        try:
            hookpoints.report_absent(self.llm.apply_model(hookpoints.worker_absent))
        except BackendError:
            shutdown(self)
            raise
        self._sp = vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False, temperature=0.0)
        self._prompt = vllm.inputs.TokensPrompt
        self.swapped: list[str] = []
        self.whatif: str | None = None  # the precision what-if in the workers
        self.state_probe = None  # a numbisect.patching.probes.state.StateProbe while one is installed

    @classmethod
    def of(cls, llm, label: str = "live:vllm") -> VLLMTPBackend:
        """A backend on a `vllm.LLM` the user started whose model lives in worker processes
        (V1 multiprocessing, tensor parallel; numbisect.live): reached through `apply_model`
        only, its settings the user's (numbisect.live.engine checked them), `close()` leaves
        it running and takes back what numbisect kept in its workers (`worker_forget`).
        Prefill mode only."""
        vllm = import_vllm()
        self, mc = adopted(cls, llm, label)
        self.tp = int(llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size)
        self.options = {"attached": True, "max_model_len": int(mc.max_model_len), "tensor_parallel_size": self.tp}
        self.max_model_len = int(mc.max_model_len)
        ranks = llm.apply_model(worker_rank)
        self.ranks = [r for r, _ in ranks]
        hookpoints.check_version()
        hookpoints.report_absent(llm.apply_model(hookpoints.worker_absent))
        self._sp = vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False, temperature=0.0)
        self._prompt = vllm.inputs.TokensPrompt
        self.swapped = []
        self.whatif = None
        self.state_probe = None
        return self

    def forget(self, donor_path: str | None = None) -> None:
        """Take back what numbisect kept in the workers (its view of the model, prefix
        recordings, the donor loaded from `donor_path`): the user's engine as found."""
        if self.llm is not None:
            self.llm.apply_model(functools.partial(worker_forget, donor_path=donor_path))

    def describe(self) -> dict:
        return {**super().describe(), "options": self.options}

    @property
    def root(self):
        raise BackendError("a tensor-parallel vLLM engine has no model in this process; its units are reached through apply_model")

    def close(self) -> None:
        if getattr(self, "attached", False):  # the user's engine: left running, as found
            self.forget()
            self.llm = None
            return
        shutdown(self)

    def swap(self, units, donor_path: str, donor_dtype: str) -> list[str]:
        """Swap `units` for the donor's modules in every worker (earlier swaps undone)."""
        spec = SwapSpec(tuple(units), donor_path, donor_dtype)
        done = self.llm.apply_model(functools.partial(worker_swap, spec=spec, engine_dtype=self.dtype_name))
        self.swapped = list(done[0])
        return self.swapped

    def unswap(self) -> None:
        self.llm.apply_model(worker_unswap)
        self.swapped = []

    def prepare(self, faults, swapped: list[str], donor) -> None:
        """Plant `faults` (then) swap `swapped` for `donor`'s modules in every worker."""
        if faults:
            specs = [f.spec or f"{f.kind}@{f.unit}" for f in faults]
            self.llm.apply_model(functools.partial(worker_faults, specs=specs, engine_dtype=self.dtype_name))
        if swapped:
            self.swap(swapped, donor.path, donor.dtype_name)

    def prefix_begin(self, swapped, source, upto: int, clear: bool) -> None:
        self.llm.apply_model(functools.partial(
            worker_prefix_begin, swapped=list(swapped), source=sorted(source.swapped) if source else None,
            upto=upto, clear=clear, engine_dtype=self.dtype_name))

    def prefix_end(self, failed: bool) -> None:
        self.llm.apply_model(functools.partial(worker_prefix_end, failed=failed))

    def install_whatif(self, whatif: str, unit, donor, faults, ledger) -> list:
        """The what-if in every worker (`worker_whatif`, which plants again there the faults it
        replaces); undone by `undo`. Nothing is left for the caller to plant."""
        specs = [f.spec or f"{f.kind}@{f.unit}" for f in faults]
        self.llm.apply_model(functools.partial(worker_whatif, whatif=whatif, unit=unit.name, donor_path=donor.path,
                                               donor_dtype=donor.dtype_name, faults=specs, engine_dtype=self.dtype_name))
        self.whatif = whatif
        return []

    def whatif_not_carried(self, whatif: str, unit, faults) -> list[str]:
        return VLLMModel.whatif_not_carried(self, whatif, unit, faults)

    def undo(self) -> None:
        if self.whatif:
            self.llm.apply_model(worker_unwhatif)
            self.whatif = None
        if self.swapped:
            self.unswap()
        self.llm.apply_model(worker_unfault)

    def install_state_probe(self, probe, ledger) -> None:
        """The recurrent-state probe in every worker: each rank reads its own value heads'
        states (vLLM splits them in contiguous blocks, rank by rank), put side by side after
        each sample into the [heads, k_dim, v_dim] state of the whole layer."""
        sources = self.llm.apply_model(functools.partial(worker_state_probe, engine_dtype=self.dtype_name))
        ledger.defer(lambda: self.llm.apply_model(worker_state_unprobe))
        self.state_probe = probe
        ledger.defer(lambda: setattr(self, "state_probe", None))
        probe.source = f"{sources[0]}, each of the {self.tp} ranks' heads"

    def _take_states(self) -> None:
        answers = self.llm.apply_model(worker_state_take)
        per_rank = [answers[self.ranks.index(r)] for r in range(self.tp)]
        for unit in self.state_probe.units:
            parts = [r.get(unit) for r in per_rank]
            if any(t is None for t in parts):
                continue  # not read on some rank: the point stays unread, as in-process
            self.state_probe.record(unit, torch.cat(parts, dim=0))

    def forward(self, samples, *, full_logits=False, capture=(), capture_inputs=(), feed=None, mode=None) -> ForwardResult:
        if mode not in (None, "prefill"):
            raise BackendError(f"{mode} mode is not available with tensor parallelism")
        if capture_inputs:
            raise BackendError("input captures are not available with tensor parallelism yet")
        feed = feed or {}
        want = list(dict.fromkeys(list(capture) + (["lm_head"] if full_logits else [])))
        res = ForwardResult(token_logprobs=[], full_logprobs=[] if full_logits else None)
        for u in want:
            res.captures[u] = []
        if want:
            self.llm.apply_model(functools.partial(worker_hooks, units=want, engine_dtype=self.dtype_name))
        try:
            for i, s in enumerate(samples):
                if feed:  # teacher forcing: this sample's reference inputs, into every worker
                    self.llm.apply_model(functools.partial(worker_feed, feed={u: xs[i] for u, xs in feed.items()},
                                                           engine_dtype=self.dtype_name))
                outs = self.llm.generate([self._prompt(prompt_token_ids=list(s.ids))], self._sp, use_tqdm=False)
                plp = outs[0].prompt_logprobs
                T = len(s.ids)
                if plp is None or len(plp) != T:
                    raise BackendError(f"vLLM returned no prompt log-probs for sample {i}")
                res.token_logprobs.append(torch.tensor([plp[t][s.ids[t]].logprob for t in range(1, T)], dtype=torch.float32))
                if self.state_probe is not None:
                    self._take_states()
                if want:
                    answers = self.llm.apply_model(worker_take)
                    per_rank = [answers[self.ranks.index(r)] for r in range(self.tp)]
                    for u in want:
                        res.captures[u].append(self._gather(u, [r[u] for r in per_rank], T, i))
        finally:
            if want:
                self.llm.apply_model(worker_unhook)
            if feed:
                self.llm.apply_model(worker_unfeed)
        if full_logits:
            res.full_logprobs = [torch.log_softmax(x.float(), dim=-1) for x in res.captures["lm_head"]]
            if "lm_head" not in capture:
                del res.captures["lm_head"]
        return res

    def _gather(self, unit: str, per_rank: list[list[torch.Tensor]], T: int, index: int) -> torch.Tensor:
        rows = T - 1 if unit == "lm_head" else T
        how = GATHER.get(self.unit(unit).kind, "replicated")
        if how == "rank0":
            per_rank = per_rank[:1]
        picked = []
        for calls in per_rank:
            calls = [c for c in calls if c is not None and c.shape[0] == rows]
            if not calls:
                raise BackendError(f"capture of {unit} did not fire for sample {index}")
            picked.append(calls[-1])
        if how == "cat":
            return torch.cat(picked, dim=-1)
        if how == "parts":
            return regroup(picked, part_sizes(self.unit(unit).kind, self.config))
        if how == "mla":
            R = self.config.get_text_config().qk_rope_head_dim
            for r, t in enumerate(picked[1:], start=1):
                if not torch.equal(t[..., -R:], picked[0][..., -R:]):
                    raise BackendError(f"capture of {unit}: rank {r}'s rotary key differs from rank 0's")
            return torch.cat([t[..., :-R] for t in picked] + [picked[0][..., -R:]], dim=-1)
        if how == "sum":
            out = picked[0].clone()
            for t in picked[1:]:
                out += t
            return out
        for r, t in enumerate(picked[1:], start=1):
            if t.shape != picked[0].shape or not torch.equal(t, picked[0]):
                raise BackendError(f"capture of {unit}: rank {r} differs from rank 0 (expected a replicated output)")
        return picked[0]

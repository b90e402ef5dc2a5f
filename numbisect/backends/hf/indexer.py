"""The DSA indexer on a transformers engine (GLM-5's `GlmMoeDsaIndexer`): its scores, and
the selection probe (numbisect.patching.probes.selection.SelectionProbe) as a forward hook on each indexer.

The module returns only the top-k key ids; `index_scores` recomputes the scores it ranked
them by, from the same inputs with the same operations as transformers 5.19's
`GlmMoeDsaIndexer.forward` (interleaved RoPE on the first qk_rope_head_dim dims, relu'd
per-head dot products weighted by `weights_proj` and summed, the attention mask added),
so on the same machine its top-k is the module's own (tests/model/arch/test_family_glm_moe_dsa.py
checks that).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from numbisect.patching.ledger import Ledger


def _rope_interleave(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos = cos[..., : cos.shape[-1] // 2].unsqueeze(2)
    sin = sin[..., : sin.shape[-1] // 2].unsqueeze(2)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


@torch.no_grad()
def index_scores(m, hidden_states, q_resid, position_embeddings, attention_mask, *rest, **kwargs) -> torch.Tensor:
    """[B, S, T] float32: the scores indexer `m` ranks keys by (masked keys very negative or -inf)."""
    b, s, _ = hidden_states.shape
    cos, sin = position_embeddings
    rope = m.qk_rope_head_dim
    q = m.wq_b(q_resid).view(b, s, m.n_heads, m.head_dim)
    q = torch.cat([_rope_interleave(q[..., :rope], cos, sin), q[..., rope:]], dim=-1)
    k = m.k_norm(m.wk(hidden_states)).unsqueeze(2)
    k = torch.cat([_rope_interleave(k[..., :rope], cos, sin), k[..., rope:]], dim=-1).squeeze(2)
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * m.softmax_scale)
    weights = m.weights_proj(hidden_states.to(m.weights_proj.weight.dtype)).float() * (m.n_heads**-0.5)
    out = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)
    if attention_mask.dtype == torch.bool:
        return out.masked_fill(~attention_mask, float("-inf"))
    return out + attention_mask


def install_probe(engine, probe, ledger: Ledger) -> None:
    """A forward hook on each indexer: the ids it returned and its recomputed scores to `probe`;
    the attention gets the ids the probe hands back (its replay, or the indexer's own)."""
    for unit in probe.units:
        def hook(m, args, kwargs, out, unit=unit):
            a = list(args) + [kwargs[n] for n in ("hidden_states", "q_resid", "position_embeddings", "attention_mask")
                              if n in kwargs]
            return probe.record(unit, index_scores(m, *a[:4]), out)

        ledger.hooks(engine.module(unit), post=hook, with_kwargs=True)

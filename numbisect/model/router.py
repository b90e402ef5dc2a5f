"""An MoE router's selection as its architecture makes it: the spec from the config (top-k,
softmax or sigmoid, renormalisation, GLM's grouped selection with its correction bias) and
the expert ids and combine weights it gives for router logits. Pure functions of tensors:
the backends' routing faults and probes and the pipeline's routing analysis share them."""

from __future__ import annotations

import torch

from numbisect.model.arch import arch_for
from numbisect.model.arch.base import (
    RouterSpec,  # defined with the architecture maps (pure data)
)


def router_spec(config) -> RouterSpec | None:
    """The routing of this config's architecture; None for a dense model."""
    fn = arch_for(config).router_spec
    return None if fn is None else fn(config.get_text_config())


def router_units(backend) -> list[str]:
    return [u.name for u in backend.units if u.kind == "router"]


def router_bias(backend, unit: str) -> torch.Tensor | None:
    """GLM's e_score_correction_bias of this side's router (None when it has none)."""
    b = getattr(backend.module(unit), "e_score_correction_bias", None)
    return None if b is None else b.detach().to("cpu", torch.float64).flatten()


def scores(logits: torch.Tensor, spec: RouterSpec) -> torch.Tensor:
    x = logits.detach().to("cpu", torch.float64)
    return torch.softmax(x, dim=-1) if spec.scoring == "softmax" else torch.sigmoid(x)


def choice_scores(logits: torch.Tensor, spec: RouterSpec, bias: torch.Tensor | None) -> torch.Tensor:
    """The scores experts are ranked by (groups outside the best topk_group at -inf)."""
    s = scores(logits, spec)
    if spec.biased and bias is not None:
        s = s + bias
    if spec.n_group > 1:
        g = s.view(s.shape[0], spec.n_group, -1)
        gs = g.topk(min(2, g.shape[-1]), dim=-1).values.sum(-1)
        keep = torch.zeros_like(gs).scatter_(1, gs.topk(spec.topk_group, dim=-1).indices, 1.0).bool()
        s = s.masked_fill(~keep.repeat_interleave(g.shape[-1], dim=1), float("-inf"))
    return s


def select(logits: torch.Tensor, spec: RouterSpec, bias: torch.Tensor | None = None) -> torch.Tensor:
    """[T, k] chosen expert ids from [T, E] router logits."""
    return choice_scores(logits, spec, bias).topk(spec.top_k, dim=-1).indices


def margins(logits: torch.Tensor, spec: RouterSpec, bias: torch.Tensor | None = None) -> torch.Tensor:
    """[T] k-th minus (k+1)-th ranking score (inf when fewer than k+1 experts are eligible)."""
    s = choice_scores(logits, spec, bias)
    if s.shape[1] <= spec.top_k:
        return torch.full((s.shape[0],), float("inf"), dtype=torch.float64)
    top = s.topk(spec.top_k + 1, dim=-1).values
    return top[:, spec.top_k - 1] - top[:, spec.top_k]


def weights_for(logits: torch.Tensor, ids: torch.Tensor, spec: RouterSpec) -> torch.Tensor:
    """[T, k] combine weights of the experts `ids` from this side's own logits (float32)."""
    x = logits.float()
    s = torch.softmax(x, dim=-1) if spec.scoring == "softmax" else torch.sigmoid(x)
    w = s.gather(1, ids.long())
    if spec.norm_topk:
        w = w / (w.sum(dim=-1, keepdim=True) + (1e-20 if spec.scoring == "sigmoid" else 0.0))
    return w * spec.scaling

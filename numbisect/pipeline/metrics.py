"""Divergence metrics shared by the whole project (see docs/design.md, "Metrics").

Tokens were sampled by the engine, so expectations are under the engine policy q;
the reference (trainer) policy is p. Per token, log_r = logp_ref - logp_engine.

1. Per-token estimators of KL(q||p): k1, k2, k3 (`token_metrics`), and the exact
   per-position KL over the full vocabulary (`full_kl`).
2. Aggregates over tokens (`aggregate`) and the worst tokens (`worst_tokens`).
3. What the mismatch costs an RL run: tokens and sequences that TIS, IcePop,
   geometric-mean and k3 filters would reject (`rl_cost`).
4. Per-unit activation error (`activation_error`, `activation_error_multi`),
   bitwise equality and ulps (`ulp_stats`), MoE routing agreement
   (`routing_agreement`).

All math runs in float64 on CPU. Results are plain Python numbers, lists and
dicts, except `token_metrics` and `full_kl`, which return tensors. A few values
can be `math.inf` (documented per function); the report writer maps them.

NaN rule: a NaN anywhere a metric reads is a divergence, never a value that drops out
or compares as small. It becomes the worst value the metric has: inf for a KL, an
aggregate, an error norm; a rejected token and sequence in the RL cost; top-1
disagreement; cosine -1 and SQNR -inf (`worst_if_nan`). Exponentials saturate (to inf)
instead of overflowing: a log-ratio of 1000 is a rejected token, not an error.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import Tensor


def _f64(x: Tensor) -> Tensor:
    return x.detach().to(device="cpu", dtype=torch.float64)


def token_metrics(logp_ref: Tensor, logp_eng: Tensor) -> dict[str, Tensor]:
    """Per-token log_r, k1, k2, k3 and ratio, as float64 tensors.

    log_r = logp_ref - logp_eng; k1 = -log_r; k2 = log_r**2 / 2;
    k3 = exp(log_r) - 1 - log_r (>= 0); ratio = exp(log_r).
    """
    if logp_ref.shape != logp_eng.shape:
        raise ValueError(f"shape mismatch: {tuple(logp_ref.shape)} vs {tuple(logp_eng.shape)}")
    log_r = _f64(logp_ref) - _f64(logp_eng)
    k3 = k3_of(log_r)
    return {
        "log_r": log_r,
        "k1": -log_r,
        "k2": log_r.square() / 2,
        "k3": k3,
        "ratio": torch.exp(log_r),
    }


def k3_of(log_r: Tensor) -> Tensor:
    """k3 = exp(log_r) - 1 - log_r (>= 0) of float64 log-ratios; inf where log_r is +-inf
    (exp(inf) - inf would be NaN), NaN where log_r is NaN."""
    k3 = (torch.expm1(log_r) - log_r).clamp_min(0.0)
    return torch.where(torch.isinf(log_r), torch.full_like(k3, math.inf), k3)


def nan_to_inf(x: Tensor) -> Tensor:
    """x with every NaN replaced by inf (+-inf and finite values kept)."""
    return torch.where(torch.isnan(x), torch.full_like(x, math.inf), x)


def full_kl(logprobs_eng: Tensor, logprobs_ref: Tensor) -> Tensor:
    """Exact KL(q||p) per position from full-vocabulary log-probs [N, V] (float64).

    q is the engine, p the reference: sum_v q_v (log q_v - log p_v). Entries with
    q_v == 0 contribute 0; q_v > 0 where p_v == 0 gives inf. A position with a NaN
    log-prob on either side (anywhere in its row) is inf: a broken distribution is
    the worst divergence, not a term that drops out.
    """
    if logprobs_eng.shape != logprobs_ref.shape:
        raise ValueError(
            f"shape mismatch: {tuple(logprobs_eng.shape)} vs {tuple(logprobs_ref.shape)}"
        )
    log_q = _f64(logprobs_eng)
    log_p = _f64(logprobs_ref)
    q = torch.exp(log_q)
    terms = torch.where(q > 0, q * (log_q - log_p), torch.zeros_like(q))
    kl = terms.sum(dim=-1).clamp_min(0.0)
    broken = torch.isnan(log_q).any(dim=-1) | torch.isnan(log_p).any(dim=-1)
    return nan_to_inf(torch.where(broken, torch.full_like(kl, math.inf), kl))


def _quantile(sorted_values: Tensor, q: float) -> float:
    """Linear-interpolation quantile of an ascending 1-D tensor (as torch.quantile)."""
    n = sorted_values.numel()
    pos = q * (n - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, n - 1)
    a = sorted_values[lo].item()
    b = sorted_values[hi].item()
    frac = pos - lo
    return a if frac == 0 or a == b else a + (b - a) * frac


def aggregate(values: Tensor) -> dict:
    """{"count", "mean", "p50", "p99", "max"} of all elements; stats are None when empty.

    Percentiles interpolate linearly between order statistics (as torch.quantile,
    but with no size limit). A NaN element counts as inf (the worst value), so the mean
    and max of values holding one are inf.
    """
    v = nan_to_inf(_f64(values).flatten())
    n = v.numel()
    if n == 0:
        return {"count": 0, "mean": None, "p50": None, "p99": None, "max": None}
    s = torch.sort(v).values
    return {
        "count": n,
        "mean": v.mean().item(),
        "p50": _quantile(s, 0.50),
        "p99": _quantile(s, 0.99),
        "max": s[-1].item(),
    }


def worst_tokens(
    values: Tensor, index: list[tuple[int, int, int]], k: int = 10
) -> list[dict]:
    """The k largest values with their (sample, position, token_id), largest first.

    Ties are ordered by (sample, position). NaN ranks above everything: it is the
    worst a token can be.
    """
    v = _f64(values).flatten()
    if v.numel() != len(index):
        raise ValueError(f"{v.numel()} values but {len(index)} index entries")
    if k <= 0 or v.numel() == 0:
        return []
    ranked = torch.nan_to_num(v, nan=math.inf)
    kth = torch.topk(ranked, min(k, v.numel())).values[-1]
    candidates = torch.nonzero(ranked >= kth).flatten().tolist()

    def key(i: int) -> tuple:
        sample, position, _ = index[i]
        return (-ranked[i].item(), sample, position)

    out = []
    for i in sorted(candidates, key=key)[:k]:
        sample, position, token_id = index[i]
        out.append(
            {
                "sample": int(sample),
                "position": int(position),
                "token_id": int(token_id),
                "value": v[i].item(),
            }
        )
    return out


@dataclass
class RLThresholds:
    """The filters an RL trainer applies to off-policy tokens and sequences."""

    tis_cap: float = 2.0  # truncated importance sampling: token ratio above this is capped
    icepop_low: float = 0.5  # IcePop band, lower edge: token ratio below this is masked
    icepop_high: float = 5.0  # IcePop band, upper edge: token ratio above this is masked
    geo_low: float = 0.999  # sequence geometric-mean ratio below this rejects the sequence
    geo_high: float = 1.001  # sequence geometric-mean ratio above this rejects the sequence
    seq_k3_max: float = 0.01  # sequence mean k3 above this rejects the sequence


def _log(x: float) -> float:
    return math.log(x) if x > 0 else -math.inf


def _frac(num: int, den: int) -> float | None:
    return num / den if den else None


def rl_cost(log_r_per_seq: list[Tensor], th: RLThresholds) -> dict:
    """Fractions of tokens and sequences that each RL filter would reject.

    `log_r_per_seq` holds, per sequence, log_r over its judged (completion) tokens.
    Sequences with no judged tokens are skipped. A fraction is None when there is
    nothing to count (no tokens or no sequences). A NaN log_r is a token every filter
    rejects (as log_r = inf); the geometric mean is compared in log space, so a
    log_r of +-1000 (a rollout log-prob of -1000) is rejected, not an overflow.
    """
    tokens = 0
    tok_tis = tok_ice = 0
    seqs = 0
    seq_tis = seq_ice = seq_geo = seq_k3 = seq_any = 0
    for log_r in log_r_per_seq:
        lr = nan_to_inf(_f64(log_r).flatten())
        if lr.numel() == 0:
            continue
        r = torch.exp(lr)  # saturates to inf / 0
        tis = r > th.tis_cap
        ice = (r < th.icepop_low) | (r > th.icepop_high)
        log_geo = lr.mean().item()  # NaN when +inf and -inf meet: rejected too
        geo = not (_log(th.geo_low) <= log_geo <= _log(th.geo_high))
        k3 = not (k3_of(lr).mean().item() <= th.seq_k3_max)
        any_tis = bool(tis.any())
        any_ice = bool(ice.any())

        tokens += lr.numel()
        tok_tis += int(tis.sum())
        tok_ice += int(ice.sum())
        seqs += 1
        seq_tis += any_tis
        seq_ice += any_ice
        seq_geo += geo
        seq_k3 += k3
        seq_any += any_tis or any_ice or geo or k3
    return {
        "tokens": tokens,
        "sequences": seqs,
        "token_frac_tis": _frac(tok_tis, tokens),
        "token_frac_icepop": _frac(tok_ice, tokens),
        "seq_frac_tis": _frac(seq_tis, seqs),
        "seq_frac_icepop": _frac(seq_ice, seqs),
        "seq_frac_geo": _frac(seq_geo, seqs),
        "seq_frac_k3": _frac(seq_k3, seqs),
        "seq_frac_rejected": _frac(seq_any, seqs),
        "thresholds": dataclasses.asdict(th),
    }


def _rows(x: Tensor) -> Tensor:
    """[tokens, ...] -> [tokens, features] float64."""
    x = _f64(x)
    if x.dim() == 0:
        return x.reshape(1, 1)
    return x.reshape(x.shape[0], -1)


def clamp_cosine(c: float) -> float:
    """A cosine clamped to [-1, 1]; NaN (a NaN or inf/inf on a side) stays NaN."""
    return c if math.isnan(c) else max(-1.0, min(1.0, c))


def sqnr(r_norm: float, d_norm: float) -> float:
    """20 log10(||r|| / ||e - r||): inf when equal, -inf when the reference is zero or
    the error infinite (an engine that overflowed), NaN when either norm is NaN."""
    if math.isnan(r_norm) or math.isnan(d_norm):
        return math.nan
    if d_norm == 0:
        return math.inf
    ratio = r_norm / d_norm
    if math.isnan(ratio):  # inf / inf
        return math.nan
    return -math.inf if ratio == 0 else 20.0 * math.log10(ratio)


WORST = {"max_abs": math.inf, "mean_abs": math.inf, "rel_l2": math.inf, "token_rel_max": math.inf,
         "cosine": -1.0, "sqnr_db": -math.inf}


def worst_if_nan(err: dict) -> dict:
    """An activation error with each NaN value (a NaN on a side, inf - inf) replaced by
    that measure's worst value (`WORST`): a broken activation counts as diverged, in
    every measure and every comparison with a tolerance."""
    for key, worst in WORST.items():
        v = err.get(key)
        if isinstance(v, float) and math.isnan(v):
            err[key] = worst
    return err


def activation_error(ref: Tensor, eng: Tensor) -> dict:
    """How far an engine activation is from the reference one; both [tokens, ...].

    Keys: max_abs, mean_abs; rel_l2 = ||e - r|| / ||r|| (0 when both are zero, inf
    when only the reference is); cosine (1.0 when both are all zero, 0.0 when one
    is); sqnr_db = 10 log10(||r||^2 / ||e - r||^2) (inf when equal, -inf when the
    reference is zero and the engine is not); token_rel_max, the largest per-token
    relative L2 error (absolute for tokens whose reference row is zero), so a few
    bad tokens are not averaged away, and worst_token, that token's row index.
    A NaN measure (a NaN on either side, or inf - inf) becomes its worst value
    (`worst_if_nan`): inf errors, cosine -1, SQNR -inf.
    """
    if ref.shape != eng.shape:
        raise ValueError(f"shape mismatch: ref {tuple(ref.shape)} vs eng {tuple(eng.shape)}")
    if ref.numel() == 0:
        raise ValueError("activation_error: empty tensors")
    r = _rows(ref)
    e = _rows(eng)
    d = e - r
    abs_d = d.abs()
    r_norm = torch.linalg.vector_norm(r).item()
    e_norm = torch.linalg.vector_norm(e).item()
    d_norm = torch.linalg.vector_norm(d).item()

    if r_norm > 0:
        rel_l2 = d_norm / r_norm
    else:
        rel_l2 = 0.0 if d_norm == 0 else math.inf

    if r_norm == 0 and e_norm == 0:
        cosine = 1.0
    elif r_norm == 0 or e_norm == 0:
        cosine = 0.0
    else:
        cosine = clamp_cosine((r * e).sum().item() / (r_norm * e_norm))
    sqnr_db = sqnr(r_norm, d_norm)

    row_r = torch.linalg.vector_norm(r, dim=1)
    row_d = torch.linalg.vector_norm(d, dim=1)
    row_rel = torch.where(row_r > 0, row_d / torch.where(row_r > 0, row_r, 1.0), row_d)
    worst = int(torch.argmax(torch.nan_to_num(row_rel, nan=math.inf)))

    return worst_if_nan({
        "max_abs": abs_d.max().item(),
        "mean_abs": abs_d.mean().item(),
        "rel_l2": rel_l2,
        "cosine": cosine,
        "sqnr_db": sqnr_db,
        "token_rel_max": row_rel[worst].item(),
        "worst_token": worst,
    })


def activation_error_multi(refs: list[Tensor], engs: list[Tensor]) -> dict:
    """`activation_error` over per-sample tensors joined along dim 0.

    worst_token becomes {"sample": s, "token": t}.
    """
    if len(refs) != len(engs):
        raise ValueError(f"{len(refs)} reference tensors but {len(engs)} engine tensors")
    if not refs:
        raise ValueError("activation_error_multi: no samples")
    for s, (r, e) in enumerate(zip(refs, engs)):
        if r.shape != e.shape:
            raise ValueError(
                f"sample {s}: shape mismatch: ref {tuple(r.shape)} vs eng {tuple(e.shape)}"
            )
    lengths = [_rows(r).shape[0] for r in refs]
    out = activation_error(
        torch.cat([_rows(r) for r in refs]), torch.cat([_rows(e) for e in engs])
    )
    t = out["worst_token"]
    for s, n in enumerate(lengths):
        if t < n:
            out["worst_token"] = {"sample": s, "token": t}
            break
        t -= n
    return out


_INT_VIEW = {
    torch.bfloat16: (torch.int16, 0x7FFF),
    torch.float16: (torch.int16, 0x7FFF),
    torch.float32: (torch.int32, 0x7FFFFFFF),
}


def _ordered(x: Tensor, dtype: torch.dtype) -> Tensor:
    """Bits of x as integers that increase with the float value (+0 and -0 both 0)."""
    int_dtype, mag_mask = _INT_VIEW[dtype]
    bits = x.view(int_dtype).to(torch.int64)
    mag = bits & mag_mask
    return torch.where(bits < 0, -mag, mag)


def ulp_stats(
    ref: Tensor, eng: Tensor, dtype: torch.dtype, floor: float | None = None
) -> dict:
    """Bitwise equality and distance in units of last place of `dtype`.

    Both sides are cast to `dtype` (bfloat16, float16 or float32) first.
    Keys: bitwise_equal; frac_differ, the fraction of elements whose bits differ
    (NaN always counts as differing); max_ulps over elements with |ref| >= floor
    (default floor: 1e-3 * max finite |ref|, 0 when the reference is all zero),
    since ordered-integer distance explodes across zero; max_ulps_all over every
    element. Both ulp maxima are None when either side holds a NaN.
    """
    if dtype not in _INT_VIEW:
        raise ValueError(f"ulp_stats: unsupported dtype {dtype} (use bfloat16, float16 or float32)")
    if ref.shape != eng.shape:
        raise ValueError(f"shape mismatch: ref {tuple(ref.shape)} vs eng {tuple(eng.shape)}")
    r = ref.detach().to(device="cpu", dtype=dtype).contiguous().flatten()
    e = eng.detach().to(device="cpu", dtype=dtype).contiguous().flatten()
    n = r.numel()
    if n == 0:
        return {"bitwise_equal": True, "frac_differ": 0.0, "max_ulps": 0, "max_ulps_all": 0}

    int_dtype = _INT_VIEW[dtype][0]
    nan = torch.isnan(r) | torch.isnan(e)
    differ = (r.view(int_dtype) != e.view(int_dtype)) | nan
    n_differ = int(differ.sum())
    result = {"bitwise_equal": n_differ == 0, "frac_differ": n_differ / n}
    if bool(nan.any()):
        return {**result, "max_ulps": None, "max_ulps_all": None}

    ulps = (_ordered(r, dtype) - _ordered(e, dtype)).abs()
    r_abs = r.to(torch.float64).abs()
    if floor is None:
        finite = r_abs[torch.isfinite(r_abs)]
        floor = 1e-3 * finite.max().item() if finite.numel() else 0.0
    kept = ulps[r_abs >= floor]
    return {
        **result,
        "max_ulps": int(kept.max()) if kept.numel() else 0,
        "max_ulps_all": int(ulps.max()),
    }


def routing_agreement(ref_idx: Tensor, eng_idx: Tensor) -> dict:
    """Top-k expert-set agreement: [N, k] chosen expert ids per token on each side.

    Keys: tokens; agree_frac, the fraction of tokens whose expert sets are equal
    (order ignored; None when there are no tokens); flipped, the row indices of
    tokens whose sets differ.
    """
    if ref_idx.shape != eng_idx.shape or ref_idx.dim() != 2:
        raise ValueError(
            f"expected two [N, k] tensors of the same shape, got "
            f"{tuple(ref_idx.shape)} and {tuple(eng_idx.shape)}"
        )
    n = ref_idx.shape[0]
    a = torch.sort(ref_idx.detach().cpu().to(torch.int64), dim=1).values
    b = torch.sort(eng_idx.detach().cpu().to(torch.int64), dim=1).values
    same = (a == b).all(dim=1)
    flipped = torch.nonzero(~same).flatten().tolist()
    return {
        "tokens": n,
        "agree_frac": (n - len(flipped)) / n if n else None,
        "flipped": flipped,
    }

"""The log-prob contract of a rollout: are its log-probs the model's raw ones, or were
they processed by the sampler (temperature, top-k, top-p)?

An RL trainer's importance ratio needs the log-probs of the distribution the trainer
computes: raw ones. vLLM returns raw log-probs by default (`logprobs_mode="raw_logprobs"`),
but `processed_logprobs` gives those of the sampling distribution (logits divided by the
temperature, then top-k and top-p applied and the rest renormalised), and the `*_logits`
modes give logits. Mixing them costs far more than any kernel does (measured here: about
1.4e-2 of k3 per token at temperature 0.7, top-p 0.9), so this is the first finding of a
rollout comparison, before any numeric one.

`ContractFit` reads, per completion position, the reference's full-vocabulary log-probs
and the rollout's log-prob of the sampled token, and fits the sampler's parameters on a
grid: temperature T in `TEMPERATURES`, top-p in `TOP_PS`, top-k in `TOP_KS` (0: off). For
each (T, p, k) the processed log-prob of the token is `z/T - log sum_{kept} exp(z_j/T)`,
the kept set the k most likely tokens (after the temperature) within the smallest
prefix whose mass reaches p (vLLM's order: temperature, then top-k and top-p); a token
outside the kept set could not have been sampled, so it rules the candidate out (counted
as `inconsistent`). The fit is the candidate of least mean absolute error; the verdict
is `processed` when that error is at most a fifth of the raw one and the raw one is above
`RAW_TOL`. Values above 0 are not log-probs: the trace reader refuses them, naming
logits (numbisect.model.trace).

The verdict is `unknown` (with `unknown_reason` and why in `advice`) when the recorded
values cannot be log-probs of the model: all 0 or denormal (what an engine that records
nothing writes), all one value (a placeholder such as -1000), or mostly below the least
log-prob any candidate processing could give the token (outside the model's support).
A model that really is that sure of every token (raw error under `RAW_TOL`) stays `raw`.

Only the first `MAX_POSITIONS` completion positions are read. Per position the
`TOP_N` most likely tokens are kept exactly and the rest as a `TAIL_BINS`-bin histogram
of their log-probs (what the sums over the vocabulary at another temperature need).

Its place in the layers: beside `measure` (the metrics), called by `comparison`; no backend.
"""

from __future__ import annotations

import math

import torch

TEMPERATURES = [round(0.05 + 0.01 * i, 2) for i in range(196)]  # 0.05 .. 2.00
TOP_PS = [1.0, 0.99, 0.98, 0.97, 0.96, 0.95, 0.94, 0.93, 0.92, 0.91, 0.9, 0.88, 0.85, 0.8, 0.75, 0.7, 0.6, 0.5]
TOP_KS = [0, 1, 2, 3, 5, 10, 20, 40, 50, 64, 100, 200]
MAX_POSITIONS = 1024
TOP_N = 2048
TAIL_BINS = 64
RAW_TOL = 1e-3  # mean |rollout - reference| log-prob below this: raw, whatever fits better
PENALTY = 10.0  # error counted for a position a candidate could not have sampled (and cap of any error)
TINY = 1.1754943508222875e-38  # float32's least normal number: a recorded |value| under it is 0 or denormal
SUPPORT_SLACK = 1.0  # nats under the least processed log-prob a candidate can give a token before it is "outside"


class ContractFit:
    """Accumulates, per candidate (T, p, k), the error of the processed log-prob model."""

    def __init__(self):
        self.T = torch.tensor(TEMPERATURES, dtype=torch.float64)
        self.ps = torch.tensor(TOP_PS, dtype=torch.float64)
        self.err = torch.zeros(len(TEMPERATURES), len(TOP_PS), len(TOP_KS), dtype=torch.float64)
        self.bad = torch.zeros_like(self.err)
        self.kept_mass = torch.zeros_like(self.err)  # the mass (at T) the kept set holds, summed
        self.n = 0
        self.finite = 0
        self.samples = 0
        self.values: set[float] = set()  # distinct recorded values (up to a few: "constant" needs only two)
        self.small = 0  # positions whose recorded |value| is 0 or denormal
        self.outside = 0  # positions recorded below what any candidate processing could give

    def add(self, sample, full_logprobs: torch.Tensor) -> None:
        """One sample: `full_logprobs` [T-1, V] is the reference's (row t-1 predicts token t)."""
        roll = sample.rollout_logprobs
        if roll is None:
            return
        self.samples += 1
        P = len(sample.prompt_ids)
        ids = sample.ids
        for j, lp in enumerate(roll):
            if self.n >= MAX_POSITIONS:
                return
            if lp is None or not math.isfinite(lp):
                continue
            self.finite += 1
            row = full_logprobs[P + j - 1].double()
            if not torch.isfinite(row).all():
                continue
            lp = float(lp)
            self._position(row, int(ids[P + j]), lp)
            self._plausible(row, int(ids[P + j]), lp)
            self.n += 1

    def _plausible(self, row: torch.Tensor, tok: int, lp: float) -> None:
        """What says the recorded value may not be a log-prob at all (see `result`)."""
        if len(self.values) < 2:
            self.values.add(lp)
        if abs(lp) < TINY:
            self.small += 1
        # the least processed log-prob of the token: at the lowest temperature, nothing cut
        # (z_tok/T - logsumexp(z/T) >= (z_tok - z_max)/T - log V)
        least = (float(row[tok]) - float(row.max())) / TEMPERATURES[0] - math.log(row.numel())
        if lp < least - SUPPORT_SLACK:
            self.outside += 1

    def _position(self, row: torch.Tensor, tok: int, lp: float) -> None:
        V = row.numel()
        vals, order = torch.sort(row, descending=True)
        rank = int((order == tok).nonzero()[0, 0])
        z_tok = float(row[tok])
        if V > TOP_N:  # the tail as a histogram: (bin centre, log count) pseudo-entries
            tail = vals[TOP_N:]
            lo, hi = float(tail.min()), float(tail.max())
            width = (hi - lo) / TAIL_BINS or 1.0
            b = ((tail - lo) / width).long().clamp_(0, TAIL_BINS - 1)
            counts = torch.bincount(b, minlength=TAIL_BINS).double()
            centres = lo + (torch.arange(TAIL_BINS, dtype=torch.float64) + 0.5) * width
            keep = counts > 0
            centres, logn = centres[keep].flip(0), counts[keep].log().flip(0)
            head = vals[:TOP_N]
            x = torch.cat([head, centres])
            logw = torch.cat([torch.zeros(TOP_N, dtype=torch.float64), logn])
            pos = min(rank, TOP_N)  # a tail token: kept when any of the tail is
        else:
            x, logw, pos = vals, torch.zeros(V, dtype=torch.float64), rank
        S = x[None, :] / self.T[:, None] + logw[None, :]  # [nT, N]
        lcse = torch.logcumsumexp(S, dim=1)
        total = lcse[:, -1:]
        cum = torch.exp(lcse - total)  # mass of each prefix at T
        # smallest prefix whose mass reaches p (a hair of slack for rounding)
        n_p = torch.searchsorted(cum.contiguous(), (self.ps[None, :] - 1e-9).expand(len(self.T), -1).contiguous()) + 1
        n_p = n_p.clamp_(max=x.numel())  # [nT, nP]
        ks = torch.tensor([k if k > 0 else x.numel() for k in TOP_KS])
        n = torch.minimum(n_p[:, :, None], ks[None, None, :].clamp(max=x.numel()))  # [nT, nP, nK]
        lse_kept = lcse.gather(1, (n - 1).reshape(len(self.T), -1)).reshape(n.shape)
        pred = z_tok / self.T[:, None, None] - lse_kept
        kept = pos < n
        e = (pred - lp).abs().clamp_(max=PENALTY)
        self.err += torch.where(kept, e, torch.full_like(e, PENALTY))
        self.bad += (~kept).double()
        self.kept_mass += torch.exp(lse_kept - total[:, :, None])

    def result(self) -> dict | None:
        """The report's `logprob_contract`; None when the trace has no rollout log-probs."""
        if self.samples == 0 or self.finite == 0:
            return None
        out = {"positions": self.n}
        if self.n == 0:
            out.update(verdict="unknown", unknown_reason="no_positions", advice="no completion position with a finite reference row")
            return out
        mean = self.err / self.n
        i1 = TEMPERATURES.index(1.0)
        raw = float(mean[i1, 0, 0])
        best = int(torch.argmin(mean))
        ti, pi, ki = (best // (len(TOP_PS) * len(TOP_KS)), (best // len(TOP_KS)) % len(TOP_PS), best % len(TOP_KS))
        fit = float(mean[ti, pi, ki])
        T, p, k = TEMPERATURES[ti], TOP_PS[pi], TOP_KS[ki]
        out.update(raw_error=raw, fit_error=fit, inconsistent_raw=int(self.bad[i1, 0, 0]),
                   fitted={"temperature": T, "top_p": p, "top_k": k,
                           "kept_mass": float(self.kept_mass[ti, pi, ki] / self.n),
                           "inconsistent": int(self.bad[ti, pi, ki])})
        why = self._not_logprobs(raw)
        if why is not None:
            out.update(verdict="unknown", unknown_reason=why[0], advice=why[1])
            return out
        processed = raw > RAW_TOL and fit <= raw / 5 and (T, p, k) != (1.0, 1.0, 0)
        if processed:
            parts = [f"temperature {T:g}"] + ([f"top-p {p:g}"] if p < 1 else []) + ([f"top-k {k}"] if k else [])
            out.update(verdict="processed", advice=(
                f"the rollout's log-probs are processed ({', '.join(parts)}), not the model's raw ones: "
                "ask the engine for raw log-probs (vLLM: logprobs_mode='raw_logprobs'), or compute the "
                "trainer's with the same processing"))
        else:
            out.update(verdict="raw", advice=None)
        return out

    def _not_logprobs(self, raw: float) -> tuple[str, str] | None:
        """(reason, why) when the recorded values cannot be the model's log-probs; None otherwise.

        Only when they are also far from the reference's (raw error above RAW_TOL): a model
        that gives every sampled token probability 1 records zeros and is raw."""
        if raw <= RAW_TOL:
            return None
        tail = ("; they cannot be the model's log-probs, so whether they are raw or processed "
                "is unknown: check what the engine records (vLLM: logprobs=0 with logprobs_mode='raw_logprobs')")
        if self.small == self.n:
            return "all_zero", f"every recorded log-prob of the {self.n} completion tokens is 0 or denormal " \
                               f"(what an engine that records nothing writes){tail}"
        if self.n >= 2 and len(self.values) == 1:
            v = next(iter(self.values))
            return "constant", f"every recorded log-prob of the {self.n} completion tokens is the same value ({v:.6g}){tail}"
        if 2 * self.outside > self.n:
            return "outside_support", f"{self.outside} of {self.n} recorded log-probs are below the least log-prob any " \
                                      f"temperature, top-p or top-k could give their token{tail}"
        return None

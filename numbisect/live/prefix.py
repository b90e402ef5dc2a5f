"""The prefix-cache check after a weight sync: does the engine reuse KV computed before it?

With prefix caching on, vLLM keeps the KV of every full block of tokens it computed, keyed
by the tokens alone, and a later request with the same prefix reads it instead of
recomputing it. A weight sync does not touch that cache: unless the framework calls
`llm.reset_prefix_cache()` after each sync, the next rollout of a prompt the engine saw
before the sync attends to keys and values the old weights computed (NVIDIA-NeMo/RL#4018:
the mismatch grew step after step). Nothing fails; the log-probs are silently off-policy.

`check(llm, prompts)` runs each prompt three ways (the engine's side of each run:
numbisect.backends.vllm.prefix_cache, reached through the registry), one generate call each, greedy, one new
token, its top log-probs (the next-token distribution at the prompt's last position, which
attends to every cached position):

1. as is: what the engine's next request for the prompt computes; vLLM says how many of
   its tokens it read from the cache (`RequestOutput.num_cached_tokens`);
2. fresh cached: the same prompt under a cache salt no other request uses
   (`TokensPrompt(cache_salt=...)`), after a warm-up run of its first `cached` tokens
   under that salt, so the same number of tokens is read from a cache the current weights
   just filled: the same computation as (1) but with fresh KV;
3. cold: under another new salt, nothing cached: how much the cached path itself moves the
   log-probs on this engine (`noise`; 0 on the CPU of tests/live).

A prompt read from the cache is `stale` when (1) and (2) differ by more than
`max(tol, 2 * noise)` (largest absolute log-prob difference over the top tokens both
returned), `fresh` when they agree; a prompt not read from the cache is `not cached`
(nothing reused, nothing to judge). The check is `stale` when one prompt is.

What it changes: run (1) is the request the engine would run next anyway (it reads the
cache, and caches its own tail blocks as any request does); runs (2) and (3) store blocks
under salts no other request carries, which only ever take free cache space. The cache is
never reset by the check: the fix is the framework's, `llm.reset_prefix_cache()` after
each sync, which is harmless to correctness (it only drops KV to be recomputed).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from numbisect.live.engine import ENGINE

STALE, FRESH, NOT_CACHED, OFF = "stale", "fresh", "not cached", "prefix caching off"
FIX = "call llm.reset_prefix_cache() after each weight sync"
# Largest log-prob difference between the as-is run and the fresh cached one that still
# counts as the same KV (absolute, nats). Stale KV after one optimizer step at a learning
# rate of 1e-3 moved the next-token log-probs by 2.5e-2 to 4.7e-2 on the fixtures (tests/live).
TOL = 1e-3


@dataclass
class PromptCache:
    """One prompt's verdict."""

    index: int
    tokens: int
    cached_tokens: int  # read from the cache as is
    fresh_cached_tokens: int  # read from the fresh cache (run 2); equal to cached_tokens normally
    max_abs_diff: float | None  # as is vs fresh cached (None: not cached)
    noise: float | None  # fresh cached vs cold
    status: str

    def to_dict(self) -> dict:
        return {"prompt": self.index, "tokens": self.tokens, "cached_tokens": self.cached_tokens,
                "fresh_cached_tokens": self.fresh_cached_tokens, "max_abs_diff": self.max_abs_diff,
                "noise": self.noise, "status": self.status}


@dataclass
class PrefixCacheCheck:
    """Whether the engine's prefix cache holds KV the current weights did not compute
    (module doc). Truthy unless it does."""

    status: str
    prompts: list[PromptCache] = field(default_factory=list)
    block_size: int = 0
    tol: float = TOL
    top: int = 0
    seconds: float = 0.0

    def __bool__(self) -> bool:
        return self.status != STALE

    @property
    def ok(self) -> bool:
        return bool(self)

    def stale(self) -> list[PromptCache]:
        return [p for p in self.prompts if p.status == STALE]

    @property
    def finding(self) -> str:
        """The verdict in one line."""
        if self.status == OFF:
            return "prefix caching is off: no KV outlives a sync"
        hit = [p for p in self.prompts if p.cached_tokens]
        if self.status == NOT_CACHED:
            return (f"no prompt was read from the prefix cache ({len(self.prompts)} checked; only full blocks of "
                    f"{self.block_size} tokens are cached): nothing reused, nothing judged; check with prompts the "
                    "engine ran before the sync")
        if self.status == FRESH:
            return (f"prefix cache fresh: {len(hit)} of {len(self.prompts)} prompts read KV from the cache (up to "
                    f"{max(p.cached_tokens for p in hit)} tokens), the same as the current weights compute")
        bad = self.stale()
        worst = max(p.max_abs_diff for p in bad)
        return (f"stale prefix cache: KV from before the sync reused ({len(bad)} of {len(self.prompts)} prompts, up to "
                f"{max(p.cached_tokens for p in bad)} cached tokens; next-token log-probs off by up to {worst:.3g} "
                f"against the same prompts with fresh KV); {FIX}")

    def to_dict(self) -> dict:
        return {"ok": self.ok, "status": self.status, "finding": self.finding, "block_size": self.block_size,
                "tol": self.tol, "top": self.top, "seconds": round(self.seconds, 4),
                "prompts": [p.to_dict() for p in self.prompts]}

    def lines(self) -> list[str]:
        head = f"prefix cache: {self.status} ({self.seconds:.2f} s): {self.finding}"
        return [head] + [f"  prompt {p.index}: {p.cached_tokens} of {p.tokens} tokens cached, log-probs off by "
                         f"{p.max_abs_diff:.3g} (noise {p.noise:.3g})" for p in self.stale()]


def _diff(a: dict[int, float], b: dict[int, float]) -> float:
    """Largest absolute log-prob difference over the tokens both returned (inf: none shared)."""
    shared = a.keys() & b.keys()
    return max((abs(a[k] - b[k]) for k in shared), default=float("inf"))


def check(llm, prompts: list[list[int]], *, top: int = 20, tol: float = TOL) -> PrefixCacheCheck:
    """Whether `llm` (a `vllm.LLM`, in this process or not) reads KV for `prompts` (token-id
    lists, e.g. the last batch's prompts) that its current weights did not compute (module
    doc). Call it right after a sync, before anything else ran those prompts."""
    t0 = time.perf_counter()
    cfg = ENGINE.cache_settings(llm)
    block = cfg["block_size"]
    if not cfg["enabled"]:
        return PrefixCacheCheck(OFF, block_size=block, tol=tol, seconds=time.perf_counter() - t0)
    vocab, most = cfg["vocab"], cfg["max_logprobs"]
    top = max(1, min(top, vocab, most if most is not None and most >= 0 else vocab))
    prompts = [list(map(int, p)) for p in prompts]
    run = ENGINE.next_token_logprobs
    as_is = run(llm, prompts, top)
    hit = [i for i, (n, _) in enumerate(as_is) if n > 0]
    fresh: dict[int, tuple[int, dict]] = {}
    cold: dict[int, tuple[int, dict]] = {}
    if hit:
        salt = f"numbisect-{uuid.uuid4().hex}"
        run(llm, [prompts[i][: as_is[i][0]] for i in hit], 1, salt)  # fill a cache of its own, current weights
        fresh = dict(zip(hit, run(llm, [prompts[i] for i in hit], top, salt)))
        cold = dict(zip(hit, run(llm, [prompts[i] for i in hit], top, f"numbisect-{uuid.uuid4().hex}")))
    out = []
    for i, (n, lp) in enumerate(as_is):
        if not n:
            out.append(PromptCache(i, len(prompts[i]), 0, 0, None, None, NOT_CACHED))
            continue
        d, noise = _diff(lp, fresh[i][1]), _diff(fresh[i][1], cold[i][1])
        status = STALE if d > max(tol, 2 * noise) else FRESH
        out.append(PromptCache(i, len(prompts[i]), n, fresh[i][0], d, noise, status))
    status = STALE if any(p.status == STALE for p in out) else FRESH if hit else NOT_CACHED
    return PrefixCacheCheck(status, out, block, tol, top, time.perf_counter() - t0)


__all__ = ["check", "PrefixCacheCheck", "PromptCache", "STALE", "FRESH", "NOT_CACHED", "OFF", "TOL", "FIX"]

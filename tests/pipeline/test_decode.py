"""Decode mode (`--engine-mode decode`): the prompt prefilled, the completion decoded one
forced token per step, as a rollout runs; checked against independent computations."""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import FIXTURES, ROOT, child_env, hf, model_dir, pythonpath, session, trace_path, vllm

from numbisect.cli import main
from numbisect.commands.run import run
from numbisect.common.errors import ExitCode, InputError
from numbisect.model.trace import Sample, load_trace
from numbisect.pipeline.provenance import new_report
from numbisect.report.document import validate
from numbisect.report.summary import render


def samples(name, n=6):
    return load_trace(trace_path(name)).samples[:n]


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    pass


@pytest.mark.vllm
def test_decode_logprobs_equal_the_engines_own_prefill_and_a_plain_transformers_forward():
    """Two independent computations of the same numbers: vLLM's own prompt log-probs of the
    whole sequence (one prefill, asked of the engine directly), and a float32 transformers
    forward. Decode and prefill kernels differ, so within tolerance, not bitwise."""
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    eng = vllm("qwen3_moe")
    ss = samples("qwen3_moe")
    dec = eng.forward(ss, full_logits=True, mode="decode")
    sp = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False, temperature=0.0)
    outs = eng.llm.generate([TokensPrompt(prompt_token_ids=s.ids) for s in ss], sp, use_tqdm=False)
    plain = AutoModelForCausalLM.from_pretrained(model_dir("qwen3_moe"), dtype=torch.float32)
    diffs_pre, diffs_hf = [], []
    for s, lp, full, out in zip(ss, dec.token_logprobs, dec.full_logprobs, outs):
        T = len(s.ids)
        assert lp.shape == (T - 1,) and full.shape == (T - 1, eng.vocab_size)
        pre = torch.tensor([out.prompt_logprobs[t][s.ids[t]].logprob for t in range(1, T)])
        diffs_pre.append((lp - pre).abs())
        ids = torch.tensor([s.ids])
        with torch.no_grad():
            ref = torch.log_softmax(plain(ids).logits[0].float(), -1)[:-1].gather(1, ids[0, 1:, None]).squeeze(1)
        diffs_hf.append((lp - ref).abs())
        # The captured logits are the ones the decode steps produced, row for row.
        torch.testing.assert_close(full.gather(1, ids[0, 1:, None]).squeeze(1), lp, rtol=0, atol=1e-4)
    d_pre, d_hf = torch.cat(diffs_pre), torch.cat(diffs_hf)
    assert float(d_pre.max()) < 1e-3  # same engine, other kernels (measured here: max 1.3e-5)
    assert float(d_hf.mean()) < 0.02 and float(d_hf.max()) < 0.25  # bf16 engine vs fp32 reference
    # A shifted or misaligned position would be off by whole nats, not by bf16 noise.
    assert float(d_hf.mean()) > 0  # the engine really ran in bf16, not the reference


@pytest.mark.vllm
def test_forced_tokens_are_the_traces_even_where_greedy_decoding_would_pick_others():
    """Random completions (far from what the model would pick): decode mode still runs the
    trace's tokens, so its log-probs equal the prefill run's of the same ids; unforced
    greedy decoding of the same prompt produces other tokens."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    eng = vllm("qwen3_moe")
    rng = random.Random(0)
    ss = [Sample(s.prompt_ids, [rng.randrange(eng.vocab_size) for _ in range(12)], line=i + 1) for i, s in enumerate(samples("qwen3_moe", 3))]
    pre = eng.forward(ss, mode="prefill")
    dec = eng.forward(ss, mode="decode")
    for s, a, b in zip(ss, pre.token_logprobs, dec.token_logprobs):
        P = len(s.prompt_ids)
        torch.testing.assert_close(b[P - 1 :], a[P - 1 :], rtol=0, atol=1e-3)
        assert float(b[P - 1 :].mean()) < -2  # unlikely tokens: they were forced, not chosen
    greedy = eng.llm.generate([TokensPrompt(prompt_token_ids=s.prompt_ids) for s in ss],
                              SamplingParams(max_tokens=12, temperature=0.0, detokenize=False, ignore_eos=True), use_tqdm=False)
    assert any(list(g.outputs[0].token_ids) != s.completion_ids for g, s in zip(greedy, ss))


@pytest.mark.vllm
def test_decode_captures_line_up_with_prefill_positions_including_the_last_token():
    """Per-step captures are stitched back to [T, ...] (lm_head [T-1, V]); the last completion
    token, never fed in a rollout, is fed by one extra step so its row exists too."""
    eng, ref = vllm("qwen3_moe"), hf("qwen3_moe")
    ss = samples("qwen3_moe", 3)
    names = [u.name for u in eng.units]
    pre = eng.forward(ss, capture=names, mode="prefill")
    dec = eng.forward(ss, capture=names, mode="decode")
    r = ref.forward(ss, capture=names)
    for n in names:
        for s, a, b, c in zip(ss, pre.captures[n], dec.captures[n], r.captures[n]):
            assert b.shape == a.shape == c.shape, (n, a.shape, b.shape)
            # Decode vs prefill on the same engine: close; the last row included.
            rel = (a.float() - b.float()).norm() / a.float().norm().clamp_min(1e-12)
            assert rel < 1e-2, (n, float(rel))
            last = (a[-1].float() - b[-1].float()).norm() / a[-1].float().norm().clamp_min(1e-12)
            assert last < 5e-2, (n, float(last))
    for a, b in zip(pre.captures["embed"], dec.captures["embed"]):
        assert torch.equal(a, b)


@pytest.mark.vllm
def test_decode_teacher_forcing_feeds_each_step_its_own_rows():
    """Local error in decode mode: each step's unit is fed the reference's input rows for its
    positions; a unit whose output depends only on its input (a norm) then matches the
    reference bit for bit, as in prefill."""
    from numbisect.pipeline.measure import local_feed_names

    eng, ref = vllm("qwen3_moe"), hf("qwen3_moe")
    ss = samples("qwen3_moe", 3)
    names = [u.name for u in eng.units]
    r = ref.forward(ss, capture=names, capture_inputs=local_feed_names(ref))
    feed = {n: r.inputs[n] for n in local_feed_names(eng) if r.inputs.get(n)}
    dec = eng.forward(ss, capture=names, feed=feed, mode="decode")
    for n in ("layers.1.input_norm", "layers.3.post_attn_norm", "final_norm"):
        for a, b in zip(r.captures[n], dec.captures[n]):
            assert torch.equal(a, b), n


@pytest.mark.vllm
def test_compare_in_decode_mode_reports_decode_and_prefill_against_the_reference():
    s = session("qwen3_moe", samples=8, engine_mode="decode")
    body = s.compare(local=False)
    em = body["engine_modes"]
    assert em["mode"] == "decode"
    # decode_vs_reference is the judged baseline; prefill_vs_reference is what prefill mode reports.
    assert em["decode_vs_reference"]["value"] == body["baseline"]["value"]
    p = session("qwen3_moe", samples=8)
    pre_body = p.compare(local=False)
    assert "engine_modes" not in pre_body
    assert em["prefill_vs_reference"]["value"] == pre_body["baseline"]["value"]
    dvp = em["decode_vs_prefill"]
    assert 0 <= dvp["value"] < 1e-6  # same engine, same weights: only kernel differences
    assert dvp["logprob_diff"]["tokens"] == sum(len(x.completion_ids) for x in s.samples)
    # Attention and whole layers need the KV cache: listed as not swappable.
    attn = [u.name for u in s.engine.units if u.kind in ("attn", "layer")]
    assert em["not_swappable"]["units"] == attn and len(attn) == 8
    report = new_report("compare", ["bisect"], s.inputs(), s.settings.to_dict(), body)
    validate(report)
    assert report["inputs"]["engine"]["mode"] == "decode"
    text = render(report)
    assert "engine mode: decode" in text and "decode vs prefill" in text and "not swappable in decode mode: 8 units" in text
    from numbisect.report.tools import diff, markdown

    assert "Engine in decode mode" in markdown(report)
    pre_report = new_report("compare", ["bisect"], p.inputs(), p.settings.to_dict(), pre_body)
    assert pre_report["inputs"]["engine"]["mode"] == "prefill"
    assert "not comparable: engine mode differs (prefill vs decode)" in diff(pre_report, report)["not_comparable"]


@pytest.mark.vllm
def test_decode_mode_search_finds_a_planted_experts_fault_and_never_swaps_attention():
    s = session("qwen3_moe", faults=["output_noise=1.0@layers.2.moe.experts"], engine_mode="decode")
    body, code = run(s, swap=None, strategy="hierarchical", max_trials=None, log=None, resume=None)
    assert code == ExitCode.DIVERGED
    assert [c["unit"] for c in body["culprits"]] == ["layers.2.moe.experts"]
    c = body["culprits"][0]
    assert c["alone"] <= 1e-3 < c["complement"]
    attn = {u.name for u in s.engine.units if u.kind in ("attn", "layer")}
    for t in body["trials"]:
        assert not attn & set(t["swapped"]), t["swapped"]
    sc = body["self_check"]
    assert sc["passed"] and [ch["swapped"] for ch in sc["checks"] if ch.get("judged", True)] == ["sub-units", "blocks"]
    assert body["engine_modes"]["not_swappable"]["units"] == sorted(attn, key=[u.name for u in s.engine.units].index)


@pytest.mark.vllm
def test_swapping_attention_in_decode_mode_is_refused_before_any_work():
    s = session("qwen3_moe", samples=2, engine_mode="decode")
    for kinds in (["attn"], ["moe,layer"]):
        with pytest.raises(InputError, match="cannot be swapped in decode mode"):
            run(s, swap=kinds, strategy="hierarchical", max_trials=None, log=None, resume=None)
    with pytest.raises(InputError, match="cannot be swapped in decode mode"):
        s.trial(["layers.0.attn"])


@pytest.mark.vllm
@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_a_sample_longer_than_max_model_len_is_an_input_error_and_the_engine_still_runs(mode):
    """vLLM generates one token after the trace (decode: the extra step), so T + 1 must fit."""
    eng = vllm("qwen3")
    n = eng.max_model_len
    long = Sample([1] * (n - 4), [2] * 4, line=7)
    with pytest.raises(InputError, match="trace line 7.*max_model_len"):
        eng.forward([long], mode=mode)
    fits = Sample([1] * (n - 5), [2] * 4, line=1)
    assert eng.forward([fits], mode=mode).token_logprobs[0].shape == (n - 2,)


def _cli_error(args, capsys, tmp_path):
    out = tmp_path / "r.json"
    code = main([*args, "--out", str(out), "-q"])
    _, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("bisect: error: ") and "Traceback" not in err, err
    assert not out.exists()
    return code, lines[0]


def test_decode_mode_on_an_engine_that_cannot_decode_is_one_line(capsys, tmp_path):
    d = model_dir("qwen3")
    for cmd in ("compare", "run"):
        code, line = _cli_error([cmd, "--ref", f"hf:{d}", "--engine", "rollout", "--trace", trace_path("qwen3"), "--engine-mode", "decode"],
                                capsys, tmp_path)
        assert code == ExitCode.USAGE
        assert "--engine-mode decode needs an engine that runs" in line


def test_decode_mode_on_a_trace_with_images_is_one_line(capsys, tmp_path):
    d = model_dir("qwen3_vl_moe")
    code, line = _cli_error(["compare", "--ref", f"hf:{d}", "--engine", f"hf:{d}", "--trace", trace_path("qwen3_vl_moe"),
                             "--engine-mode", "decode"], capsys, tmp_path)
    assert code == ExitCode.USAGE and "text-only traces" in line


def test_decode_mode_under_tensor_parallelism_is_one_line_before_any_worker_starts(capsys, tmp_path):
    # The workers run prefill forwards only: before this refusal the decode run was a
    # prefill (measured on qwen3_moe.first5 at TP=2: "decode vs prefill max |diff| 0,
    # identical on 100.0%" where the in-process engine gives 1.79e-07 and 99.2%).
    d = model_dir("qwen3_moe")
    for cmd in ("compare", "run"):
        code, line = _cli_error([cmd, "--ref", f"hf:{d}", "--engine", f"vllm:{d}", "--trace", trace_path("qwen3_moe"),
                                 "--engine-opt", "tensor_parallel_size=2", "--engine-mode", "decode"], capsys, tmp_path)
        assert code == ExitCode.USAGE and "--engine-mode decode does not run under tensor parallelism" in line, line


def test_a_backend_without_decode_refuses_it_in_one_line():
    from numbisect.backends.base import check_engine_mode

    with pytest.raises(InputError, match="--engine-mode decode is not available on the dump engine"):
        check_engine_mode("dump", "decode", ("prefill",))


# -- the hf engine: decode with transformers' KV cache -----------------------------------------
def test_hf_decode_logprobs_and_captures_match_a_plain_forward():
    """fp32: decoding with the KV cache gives the plain (one forward) log-probs within fp32
    rounding, with captures in the same canonical rows as a prefill."""
    from transformers import AutoModelForCausalLM

    b = hf("qwen3_moe", "float32")
    ss = samples("qwen3_moe", 4)
    names = [u.name for u in b.units]
    dec = b.forward(ss, full_logits=True, capture=names, mode="decode")
    pre = b.forward(ss, capture=names)
    plain = AutoModelForCausalLM.from_pretrained(model_dir("qwen3_moe"), dtype=torch.float32)
    for i, s in enumerate(ss):
        ids = torch.tensor([s.ids])
        with torch.no_grad():
            logp = torch.log_softmax(plain(ids).logits[0].float(), -1)[:-1]
        torch.testing.assert_close(dec.token_logprobs[i], logp.gather(1, ids[0, 1:, None]).squeeze(1), rtol=0, atol=1e-4)
        torch.testing.assert_close(dec.full_logprobs[i], logp, rtol=0, atol=1e-4)
        for n in names:
            torch.testing.assert_close(dec.captures[n][i], pre.captures[n][i], rtol=1e-4, atol=1e-4)


def test_hf_decode_mode_search_finds_a_planted_combine_fault():
    s = session("qwen3_moe", "hf", ref_dtype="float32", engine_dtype="float32", faults=["moe_combine_bf16@layers.2.moe"],
                engine_mode="decode", threshold=1e-10)
    body, code = run(s, swap=None, strategy="hierarchical", max_trials=None, log=None, resume=None)
    assert code == ExitCode.DIVERGED
    assert [c["unit"] for c in body["culprits"]] == ["layers.2.moe.experts"]
    dvp = body["engine_modes"]["decode_vs_prefill"]
    assert 0 < dvp["logprob_diff"]["max_abs"] < 1e-4  # fp32: the cache path differs only by rounding


def test_unknown_engine_mode_is_a_usage_error(capsys, tmp_path):
    d = model_dir("qwen3")
    code, line = _cli_error(["compare", "--ref", f"hf:{d}", "--engine", f"hf:{d}", "--trace", trace_path("qwen3"),
                             "--engine-mode", "beam"], capsys, tmp_path)
    assert code == ExitCode.USAGE and "beam" in line


def test_a_v1_report_without_a_mode_still_renders():
    """Reports written before decode mode have no `mode` and no `engine_modes`."""
    from pathlib import Path


    r = json.loads(Path(FIXTURES / "reports" / "qwen3_moe_planted_fault.json").read_text())
    assert "engine_modes" not in r
    assert "engine mode" not in render(r)


def test_a_trial_log_from_prefill_mode_does_not_resume_a_decode_run(tmp_path):
    from numbisect.commands.run import log_header, read_log

    pre = session("qwen3_moe", "hf", ref_dtype="float32", engine_dtype="float32", samples=2)
    dec = session("qwen3_moe", "hf", ref_dtype="float32", engine_dtype="float32", samples=2, engine_mode="decode")
    log = tmp_path / "trials.jsonl"
    log.write_text(json.dumps(log_header(pre)) + "\n")
    assert read_log(str(log), pre) == []
    with pytest.raises(InputError, match="engine_mode differ"):
        read_log(str(log), dec)
    # A log written before decode mode existed has no engine_mode: it was prefill.
    old = log_header(pre)
    del old["engine_mode"]
    log.write_text(json.dumps(old) + "\n")
    assert read_log(str(log), pre) == []


@pytest.mark.vllm
@pytest.mark.parametrize("backend", ["vllm", "hf"])
def test_short_prompts_and_empty_completions_decode_like_prefill(backend):
    """Edge cases of the stitching: a one-token prompt (no prompt log-prob rows) and an
    empty completion (only the extra step)."""
    b = vllm("qwen3_moe") if backend == "vllm" else hf("qwen3_moe")
    names = [u.name for u in b.units]
    for s in (Sample([5], [7, 9, 11], line=1), Sample([5, 6, 7], [], line=2), Sample([5], [8], line=3)):
        pre = b.forward([s], full_logits=True, capture=names)
        dec = b.forward([s], full_logits=True, capture=names, mode="decode")
        torch.testing.assert_close(dec.token_logprobs[0], pre.token_logprobs[0], rtol=0, atol=1e-3)
        for n in names:
            assert dec.captures[n][0].shape == pre.captures[n][0].shape, (n, s)


@pytest.mark.vllm
def test_a_fresh_engine_survives_a_short_first_prefill():
    """vLLM-CPU bf16 died of SIGILL here when its first forward was a prefill of under 5
    tokens (a short prompt in decode mode); the backend's warm-up forward prevents it.
    A fresh engine in a child process, whose first real forward is such a prompt."""
    import subprocess
    import sys


    code = (
        "from numbisect.backends.vllm import VLLMBackend\n"
        "from numbisect.model.trace import Sample\n"
        f"e = VLLMBackend({model_dir('qwen3')!r}, 'bfloat16')\n"
        "r = e.forward([Sample([5, 6], [7, 8])], mode='decode')\n"
        "print('logprobs', len(r.token_logprobs[0]))\n"
        "e.close()\n"
    )
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**child_env(), "PYTHONPATH": pythonpath()},
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "logprobs 3" in p.stdout


def test_decode_mode_refuses_an_output_noise_on_a_prefill_only_unit_in_one_line(capsys, tmp_path):
    # A Gated DeltaNet's conv and gates are called in the prompt's prefill only: such a noise
    # skipped every decode step and the report blamed "the decode kernels" (measured on
    # qwen3_next, hf engine, output_noise=0.3@layers.1.attn.conv: decode vs reference 8.5e-6,
    # prefill vs reference 5.9e-5). A weight noise there reaches every step: accepted.
    d = model_dir("qwen3_next")
    base = ["compare", "--ref", f"hf:{d}", "--engine", f"hf:{d}", "--trace", trace_path("qwen3_next"), "--engine-mode", "decode"]
    for unit in ("layers.1.attn.conv", "layers.0.attn.gates"):
        code, line = _cli_error([*base, "--engine-fault", f"output_noise=0.3@{unit}"], capsys, tmp_path)
        assert code == ExitCode.USAGE and f"output_noise=0.3@{unit}" in line and "prefill only" in line, line
    out = tmp_path / "w.json"
    assert main([*base, "--engine-fault", "weight_noise=1e-2@layers.1.attn.conv", "--out", str(out), "-q"]) == ExitCode.ALIGNED
    capsys.readouterr()
    assert out.exists()

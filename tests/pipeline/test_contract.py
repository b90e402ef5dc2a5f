"""The log-prob contract of a rollout (numbisect.pipeline.contract): raw log-probs, log-probs the
sampler processed (temperature, top-p, top-k), logits.

Ground truth: fixtures/traces/qwen3_moe.processed.jsonl was sampled by a real vLLM-CPU
engine on the qwen3_moe fixture at temperature 0.7, top-p 0.9 with
`logprobs_mode="processed_logprobs"`, qwen3_moe.logits.jsonl at temperature 1 with
`raw_logits` (fixtures/make_processed_rollout.py); qwen3_moe.jsonl holds the sampler's
raw log-probs.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import FIXTURES, model_dir, trace_path

from numbisect.cli import main
from numbisect.common.errors import ExitCode
from numbisect.model.trace import Sample
from numbisect.pipeline.contract import ContractFit
from numbisect.report.document import validate

pytestmark = pytest.mark.usefixtures("one_thread")
PROCESSED = str(FIXTURES / "traces" / "qwen3_moe.processed.jsonl")
LOGITS = str(FIXTURES / "traces" / "qwen3_moe.logits.jsonl")


def _compare(tmp_path, trace, *extra):
    out = tmp_path / "r.json"
    code = main(["compare", "--ref", f"hf:{model_dir('qwen3_moe')}", "--engine", "rollout", "--trace", trace,
                 "--out", str(out), "-q", *extra])
    return code, json.loads(out.read_text())


def test_processed_rollout_logprobs_are_the_first_finding_with_the_fitted_sampler(tmp_path, capsys):
    code, r = _compare(tmp_path, PROCESSED)
    validate(r)
    c = r["logprob_contract"]
    assert c["verdict"] == "processed"
    assert c["fitted"]["temperature"] == pytest.approx(0.7, abs=0.02)
    assert c["fitted"]["top_p"] == pytest.approx(0.9, abs=0.02) and c["fitted"]["top_k"] == 0
    assert c["fitted"]["inconsistent"] == 0 and c["positions"] == 480
    assert c["fit_error"] < c["raw_error"] / 10
    assert "logprobs_mode='raw_logprobs'" in c["advice"]
    assert code == ExitCode.DIVERGED  # processed log-probs are far from the raw ones
    capsys.readouterr()
    assert main(["report", "show", str(tmp_path / "r.json")]) == ExitCode.DIVERGED  # the exit code of its verdict
    text = capsys.readouterr().out
    finding = text.index("!! log-prob contract: the rollout's log-probs are processed (temperature 0.7, top-p 0.9)")
    assert finding < text.index("\ntokens ") < text.index("RL cost")  # before the token table and the RL cost
    assert main(["report", "md", str(tmp_path / "r.json")]) == 0
    md = capsys.readouterr().out
    assert "**First finding: the log-prob contract.**" in md
    assert md.index("First finding") < md.index("Environment and inputs")


def test_raw_rollout_logprobs_are_said_to_be_raw(tmp_path, capsys):
    code, r = _compare(tmp_path, trace_path("qwen3_moe"))
    validate(r)
    c = r["logprob_contract"]
    assert c["verdict"] == "raw" and c["advice"] is None
    assert c["fitted"]["temperature"] == 1.0 and c["fitted"]["top_p"] == 1.0
    assert c["raw_error"] < 5e-3
    assert code == ExitCode.ALIGNED


def test_the_whole_run_comparison_judges_the_contract_the_same(tmp_path):
    _, streamed = _compare(tmp_path, PROCESSED)
    _, whole = _compare(tmp_path, PROCESSED, "--capture", "memory")
    assert whole["logprob_contract"] == streamed["logprob_contract"]


def test_logits_recorded_as_logprobs_are_refused_naming_logits(tmp_path, capsys):
    code = main(["compare", "--ref", f"hf:{model_dir('qwen3_moe')}", "--engine", "rollout", "--trace", LOGITS,
                 "--out", str(tmp_path / "r.json"), "-q"])
    err = capsys.readouterr().err
    assert code == ExitCode.USAGE
    assert err.count("\n") == 1 and "values above 0 are logits" in err and "raw_logprobs" in err
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("T,p,k", [(0.5, 1.0, 5), (1.3, 0.95, 0), (1.0, 0.8, 0)])
def test_fit_recovers_a_known_sampler_exactly(T, p, k):
    """Log-probs computed by the processing itself (vLLM's order: temperature, then top-k
    and top-p on the scaled distribution) from random logits: the fit finds the parameters."""
    g = torch.Generator().manual_seed(0)
    fit = ContractFit()
    for _ in range(6):
        z = torch.randn(10, 64, generator=g, dtype=torch.float64) * 2.5
        full = torch.log_softmax(z, dim=-1)
        scaled = torch.log_softmax(z / T, dim=-1)
        order = torch.argsort(scaled, dim=-1, descending=True)
        cum = torch.cumsum(scaled.gather(1, order).exp(), dim=-1)
        n_keep = (cum < p - 1e-9).sum(dim=-1) + 1
        if k:
            n_keep = n_keep.clamp(max=k)
        ids, lps = [0], []
        for t in range(10):
            kept = order[t, : int(n_keep[t])]
            tok = int(kept[torch.randint(len(kept), (1,), generator=g)])
            masked = torch.full_like(scaled[t], -torch.inf)
            masked[kept] = scaled[t, kept]
            lps.append(float(torch.log_softmax(masked, dim=-1)[tok]))
            ids.append(tok)
        fit.add(Sample(prompt_ids=ids[:1], completion_ids=ids[1:], rollout_logprobs=lps, line=1), full.float())
    r = fit.result()
    assert r["verdict"] == "processed"
    assert (r["fitted"]["temperature"], r["fitted"]["top_p"], r["fitted"]["top_k"]) == (T, p, k) or r["fit_error"] < 1e-4
    assert r["fit_error"] < 1e-4 and r["fitted"]["inconsistent"] == 0

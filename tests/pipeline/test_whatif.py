"""Precision what-ifs for culprits, on real backends with planted faults."""

from __future__ import annotations

import json
import math

import pytest
from conftest import model_dir, session, trace_path

from numbisect.cli import main
from numbisect.commands.run import run
from numbisect.common.errors import ExitCode
from numbisect.report.document import load_report


def search(s):
    return run(s, swap=None, strategy="hierarchical", max_trials=None, log=None, resume=None)


def by_name(culprit):
    return {t["whatif"]: t for t in culprit["precision"]["whatifs"]}


def test_fp32_weighted_sum_fixes_a_planted_moe_combine_fault():
    s = session("qwen3_moe", "hf", ref_dtype="float32", engine_dtype="float32",
                faults=["moe_combine_bf16@layers.2.moe"], threshold=1e-10)
    body, code = search(s)
    assert code == ExitCode.DIVERGED
    [c] = body["culprits"]
    assert c["unit"] == "layers.2.moe.experts"
    w = by_name(c)["fp32 weighted sum"]
    assert w["before"] == body["search"]["baseline"] > 1e-10
    assert w["value"] <= 1e-10 and w["verdict"] == "fixes"  # back under the threshold
    assert w["replaced_faults"] == ["moe_combine_bf16@layers.2.moe"]
    assert c["precision"]["suggested"].startswith("accumulate the expert weighted sum in fp32")
    assert "fixes it" in c["precision"]["suggested"]
    # stats capture (the default): the what-ifs reuse the streamed reference log-probs; no
    # whole-run reference capture (every unit of every sample) is ever made
    assert s.spec.capture == "stats" and s._ref_result is None


def test_an_upcast_that_does_not_help_is_reported_as_not_helping():
    # Weight noise is not a precision fault: running the fp32 unit in fp32 again changes nothing.
    s = session("qwen3_moe", "hf", ref_dtype="float32", engine_dtype="float32",
                faults=["weight_noise=1e-2@layers.0.attn"], threshold=1e-10)
    body, code = search(s)
    assert code == ExitCode.DIVERGED
    [c] = body["culprits"]
    assert c["unit"] == "layers.0.attn"
    [t] = c["precision"]["whatifs"]
    assert t["whatif"] == "fp32 unit" and t["verdict"] == "no_help"
    assert t["value"] > 1e-10 and t["replaced_faults"] == []
    assert "changes nothing" in t["line"] or "does not help" in t["line"]
    assert c["precision"]["suggested"].startswith("no precision fix")


def test_with_two_culprits_each_whatif_runs_with_the_other_swapped():
    faults = ["moe_combine_bf16@layers.0.moe", "weight_noise=1e-2@layers.3.attn"]
    s = session("qwen3_moe", "hf", ref_dtype="float32", engine_dtype="float32", faults=faults, threshold=1e-10)
    body, code = search(s)
    assert code == ExitCode.DIVERGED
    c = {c["unit"]: c for c in body["culprits"]}
    assert sorted(c) == ["layers.0.moe.experts", "layers.3.attn"]
    ws = by_name(c["layers.0.moe.experts"])["fp32 weighted sum"]
    # "before" is this culprit's error alone (the attention swapped), below the search baseline.
    assert ws["before"] == pytest.approx(c["layers.0.moe.experts"]["complement"], rel=1e-6)
    assert ws["before"] < body["search"]["baseline"]
    assert ws["verdict"] == "fixes" and ws["value"] <= 1e-10
    [att] = c["layers.3.attn"]["precision"]["whatifs"]
    assert att["verdict"] == "no_help" and att["before"] == pytest.approx(c["layers.3.attn"]["complement"], rel=1e-6)


def test_upcasting_a_bf16_router_with_a_low_precision_fault_is_measured():
    # A bf16 hf engine with its router logits rounded to fp8: the fp32 router is a real change.
    s = session("qwen3_moe", "hf", ref_dtype="bfloat16", engine_dtype="bfloat16",
                faults=["router_logits_fp8@layers.1.moe.router"], threshold=1e-10)
    body, code = search(s)
    assert code == ExitCode.DIVERGED
    c = next(c for c in body["culprits"] if c["unit"] == "layers.1.moe.router")
    [t] = c["precision"]["whatifs"]
    assert t["whatif"] == "fp32 unit" and t["replaced_faults"] == ["router_logits_fp8@layers.1.moe.router"]
    assert t["value"] < t["before"]


def test_run_summary_report_show_and_md_carry_the_suggested_fix(tmp_path, capsys):
    d = model_dir("qwen3_moe")
    out = tmp_path / "r.json"
    code = main(["run", "--ref", f"hf:{d}", "--engine", f"hf:{d}", "--trace", trace_path("qwen3_moe"), "-q",
                 "--ref-dtype", "float32", "--engine-dtype", "float32", "--threshold", "1e-10",
                 "--engine-fault", "moe_combine_bf16@layers.2.moe", "--out", str(out)])
    stdout = capsys.readouterr().out
    assert code == ExitCode.DIVERGED
    assert "suggested fix: accumulate the expert weighted sum in fp32" in stdout
    r = load_report(str(out))  # validates against the schema
    assert r["culprits"][0]["precision"]["whatifs"]
    assert main(["report", "show", str(out)]) == ExitCode.DIVERGED
    assert "fp32 weighted sum" in capsys.readouterr().out
    assert main(["report", "md", str(out)]) == ExitCode.ALIGNED
    md = capsys.readouterr().out
    assert "**Suggested fix**" in md and "accumulate the expert weighted sum in fp32" in md
    assert json.loads(out.read_text())["schema_version"] == 1
    code = main(["run", "--ref", f"hf:{d}", "--engine", f"hf:{d}", "--trace", trace_path("qwen3_moe"), "-q",
                 "--ref-dtype", "float32", "--engine-dtype", "float32", "--threshold", "1e-10", "--no-whatif",
                 "--engine-fault", "moe_combine_bf16@layers.2.moe", "--out", str(out)])
    assert code == ExitCode.DIVERGED and "suggested fix" not in capsys.readouterr().out
    assert "precision" not in load_report(str(out))["culprits"][0]


@pytest.mark.vllm
def test_precision_whatifs_run_on_real_vllm():
    s = session("qwen3_moe", "vllm", faults=["output_noise=1.0@layers.2.moe.experts"])
    body, code = search(s)
    assert code == ExitCode.DIVERGED
    [c] = body["culprits"]
    w = by_name(c)
    # Noise is not precision: neither the fp32 sum of the engine's own expert outputs nor
    # the reference's experts in fp32 (with the noise planted again on them) removes it.
    assert w["fp32 weighted sum"]["value"] > 1e-3 and w["fp32 unit"]["value"] > 1e-3
    assert all(t["verdict"] != "fixes" for t in w.values())


@pytest.mark.vllm
def test_fp32_weighted_sum_on_real_vllm_removes_a_planted_low_precision_sum():
    # fp8 contributions summed in fp8 in layer 0 (k3 ~1e-4 against the ~5e-5 bf16 floor):
    # the fp32 sum of vLLM's own per-slot expert outputs replaces exactly that arithmetic.
    from numbisect.pipeline.whatif import run_whatifs

    s = session("qwen3_moe", "vllm", faults=["moe_combine_fp8@layers.0.moe"], samples=None)
    natural = session("qwen3_moe", "vllm", samples=None)
    clean = natural.trial([])[0]
    culprits = [{"unit": "layers.0.moe.experts", "kind": "experts"}]
    run_whatifs(s.sides(), s.reference_tokens(), culprits, None)
    w = by_name(culprits[0])
    ws = w["fp32 weighted sum"]
    assert ws["replaced_faults"] == ["moe_combine_fp8@layers.0.moe"]
    assert ws["before"] > 1.5 * clean  # the fault stands above the natural pair
    assert ws["value"] < 0.6 * ws["before"] and ws["value"] < 1.5 * clean
    assert w["fp32 unit"]["value"] < 0.6 * ws["before"]  # the reference's experts in fp32


@pytest.mark.vllm
def test_on_vllm_a_noise_fault_the_fp32_unit_cannot_keep_is_named():
    # vLLM's fp32 unit is the reference's module: weight noise planted on vLLM's own expert
    # weights cannot follow it, and the what-if says so instead of claiming a fix silently.
    from numbisect.pipeline.whatif import run_whatifs

    spec = "weight_noise=0.3@layers.2.moe.experts"
    s = session("qwen3_moe", "vllm", faults=[spec])
    culprits = [{"unit": "layers.2.moe.experts", "kind": "experts"}]
    run_whatifs(s.sides(), s.reference_tokens(), culprits, None)
    w = by_name(culprits[0])
    assert w["fp32 unit"]["faults_not_carried"] == [spec] and "not carried over" in w["fp32 unit"]["line"]
    assert w["fp32 weighted sum"]["faults_not_carried"] == []  # the engine's own (noisy) experts
    assert w["fp32 weighted sum"]["value"] > 0.5 * w["fp32 weighted sum"]["before"]


def test_a_whatif_that_leaves_an_infinite_metric_infinite_does_not_help():
    """A NaN fault makes the metric inf; inf -> inf must not read as "helps" (inf <= inf/2)."""
    from numbisect.pipeline.whatif import verdict

    assert verdict(math.inf, math.inf, 1e-3) == "no_help"
    assert verdict(math.inf, math.nan, 1e-3) == "no_help"
    assert verdict(math.inf, 1.0, 1e-3) == "helps"
    assert verdict(math.inf, 1e-4, 1e-3) == "fixes"

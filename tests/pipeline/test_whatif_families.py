"""Precision what-ifs on every fixture family, and a failing what-if never losing a search.

Issue 17: the what-if of a Qwen3-VL-MoE attention reached for `model.model.rotary_emb`
(another family's path) and its AttributeError threw away a finished search.
"""

from __future__ import annotations

import json
import math

import pytest
from conftest import hf, model_dir, session, short_trace, trace_path

from numbisect.cli import main
from numbisect.common.errors import ExitCode
from numbisect.pipeline.whatif import UNIT, WSUM, run_whatifs
from numbisect.report.document import load_report

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = ("qwen3", "qwen3_moe", "glm4_moe", "mixtral", "qwen3_vl_moe")
NOISE = "output_noise=1e-3@layers.0.attn"  # noise: an fp32 copy of any unit keeps it
NORM = "rmsnorm_no_upcast@layers.1.post_attn_norm"  # precision: an fp32 unit around it removes it


def culprits_of(engine) -> list[dict]:
    """One unit of each kind the family has (layer 1's where the kind is per layer)."""
    seen: dict[str, str] = {}
    for u in engine.units:
        if u.kind not in seen or (u.layer == 1 and engine.unit(seen[u.kind]).layer != 1):
            seen[u.kind] = u.name
    return [{"unit": name, "kind": kind} for kind, name in seen.items()]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_whatif_runs_on_every_unit_kind_of_every_family(family):
    # fp32 engine and reference (cheap); 3 samples, or Qwen3-VL-MoE's whole trace (its image
    # files sit beside it, so a cut copy elsewhere would not find them)
    samples = None if family == "qwen3_vl_moe" else 3
    s = session(family, "hf", ref_dtype="float32", engine_dtype="float32", faults=[NOISE, NORM], samples=samples)
    culprits = culprits_of(s.engine)
    kinds = {c["kind"] for c in culprits}
    assert {"attn", "layer", "norm"} <= kinds and ({"moe", "experts"} <= kinds or family == "qwen3")
    for c in culprits:  # each as the search's only culprit
        run_whatifs(s.sides(), s.reference_tokens(), [c], None)
    for c in culprits:
        ws = {t["whatif"]: t for t in c["precision"]["whatifs"]}
        assert sorted(ws) == sorted([UNIT, WSUM] if c["kind"] in ("moe", "experts") else [UNIT]), c["unit"]
        for t in ws.values():
            assert isinstance(t["value"], float) and math.isfinite(t["value"]), (c["unit"], t)
            assert t["before"] > 0 and t["verdict"] in ("fixes", "helps", "no_help") and t["line"]
        unit = ws[UNIT]
        if c["unit"] in ("layers.1.post_attn_norm", "layers.1"):
            # the bf16 norm inside is recomputed in fp32: only the noise is left
            assert unit["replaced_faults"] == [NORM] and unit["value"] < 0.5 * unit["before"], unit
        else:
            # an fp32 engine's unit copied to fp32 is the same arithmetic (the noise kept):
            # the what-if changes nothing, bit for bit (a wrong rotary or dtype would show)
            assert unit["replaced_faults"] == [] and unit["value"] == unit["before"], unit
        if WSUM in ws:  # the engine's own expert outputs summed in fp32: a reordered fp32 sum
            assert ws[WSUM]["value"] == pytest.approx(ws[WSUM]["before"], rel=0.05)


def run_cli(*extra: str) -> list[str]:
    d = model_dir("qwen3")
    return ["run", "--ref", f"hf:{d}", "--engine", f"hf:{d}", "--trace", short_trace("qwen3", 4), "-q",
            "--ref-dtype", "float32", "--engine-dtype", "float32", "--threshold", "1e-4",
            "--engine-fault", "output_noise=1.0@layers.1.attn", *extra]


def test_a_failing_whatif_keeps_the_search_its_report_and_its_exit_code(tmp_path, monkeypatch, capsys):
    import numbisect.pipeline.whatif as W

    def broken(*args, **kwargs):
        raise AttributeError("'Planted' object has no attribute 'rotary_emb'\nsecond line")

    monkeypatch.setattr(W, "run_whatifs", broken)
    monkeypatch.setenv("NUMBISECT_DEBUG", "1")
    out = tmp_path / "r.json"
    code = main(run_cli("--out", str(out)))
    cap = capsys.readouterr()
    assert code == ExitCode.DIVERGED  # the search's exit code, not 3
    r = load_report(str(out))  # written, and valid against the schema
    assert [c["unit"] for c in r["culprits"]] == ["layers.1.attn"] and "precision" not in r["culprits"][0]
    assert r["search"]["verdict"] == "culprits" and r["trials"]
    error = "AttributeError: 'Planted' object has no attribute 'rotary_emb'"
    assert r["post_search_errors"] == [{"step": "whatif", "unit": "layers.1.attn", "error": error}]
    line = f"!! whatif for layers.1.attn failed after the search: {error} (the search's result stands)"
    assert line in cap.out.splitlines()
    assert "culprit layers.1.attn (attn)" in cap.out
    assert "Traceback" in cap.err and "second line" in cap.err  # NUMBISECT_DEBUG=1: the whole traceback
    assert main(["report", "show", str(out)]) == ExitCode.DIVERGED
    assert line in capsys.readouterr().out.splitlines()
    assert main(["report", "md", str(out)]) == ExitCode.ALIGNED
    md = capsys.readouterr().out
    assert "**Failed after the search**" in md and f"- whatif for `layers.1.attn`: `{error}`" in md


def test_a_summary_that_cannot_be_rendered_keeps_the_report_and_the_exit_code(tmp_path, monkeypatch, capsys):
    import numbisect.cli

    def broken(report):
        raise KeyError("culprits")

    monkeypatch.setattr(numbisect.cli, "render", broken)  # the summary the command prints
    out = tmp_path / "r.json"
    code = main(run_cli("--out", str(out)))
    cap = capsys.readouterr()
    assert code == ExitCode.DIVERGED  # the search's, not an internal error
    assert [c["unit"] for c in load_report(str(out))["culprits"]] == ["layers.1.attn"]
    err = [ln for ln in cap.err.splitlines() if ln.strip()]
    assert len(err) == 1 and "summary could not be rendered" in err[0] and str(out) in err[0]
    assert cap.out == f"report: {out}\n"


def test_a_run_whose_whatifs_work_records_no_post_search_errors(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(run_cli("--out", str(out))) == ExitCode.DIVERGED
    r = json.loads(out.read_text())
    assert "post_search_errors" not in r and r["culprits"][0]["precision"]["whatifs"]
    assert "failed after the search" not in capsys.readouterr().out


def test_issue_17_qwen3_vl_moe_attention_culprit_gets_its_fp32_whatif(tmp_path, capsys):
    m = model_dir("qwen3_vl_moe")
    out = tmp_path / "R.json"
    code = main(["run", "--ref", f"hf:{m}", "--engine", f"hf:{m}", "--trace", trace_path("qwen3_vl_moe"), "-q",
                 "--engine-fault", "output_noise=1.0@layers.1.attn", "--threshold", "1e-4", "--out", str(out)])
    stdout = capsys.readouterr().out
    assert code == ExitCode.DIVERGED
    r = load_report(str(out))
    assert [c["unit"] for c in r["culprits"]] == ["layers.1.attn"]
    assert "post_search_errors" not in r
    [t] = r["culprits"][0]["precision"]["whatifs"]
    assert t["whatif"] == UNIT and math.isfinite(t["value"]) and t["before"] == r["search"]["baseline"]
    assert t["verdict"] != "fixes"  # noise is not precision: the fp32 attention keeps it
    assert "precision what-if for layers.1.attn" in stdout


def test_layer_stream_takes_qwen3_vl_moe_paths_from_its_arch_map():
    # model.language_model.* modules, its own rotary embedding and auto class: the same
    # log-probs as the whole model on the trace's text samples; image samples refused.
    import torch

    from numbisect.common.errors import InputError
    from numbisect.model.trace import load_trace
    from numbisect.pipeline.layerstream import LayerStreamRef

    samples = load_trace(trace_path("qwen3_vl_moe")).samples
    text = [s for s in samples if s.images is None][:3]
    ls = LayerStreamRef(model_dir("qwen3_vl_moe"), "float32")
    tok, _, _ = ls.stream(text)
    whole = hf("qwen3_vl_moe", "float32").forward(text)
    assert len(text) == 3 and all(torch.equal(a, b) for a, b in zip(tok, whole.token_logprobs))
    with pytest.raises(InputError, match=r"runs the language model only; the trace has images \(line 1\)"):
        ls.stream(samples[:2])


@pytest.mark.vllm
@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe", "mixtral", "qwen3"])  # with a vLLM map (dense last: a MoE engine started after a dense one in this process fails)
def test_every_whatif_runs_on_every_unit_kind_on_real_vllm(family):
    # vLLM's module tree: its fp32 unit is the reference's module swapped in (attention and
    # layers recompute cos/sin with the family's rotary embedding), MoE sub-units are patched
    # inside the block's FusedMoE runner (found through the arch map), the weighted sum per slot.
    s = session(family, "vllm", faults=["output_noise=0.5@layers.0.attn"], samples=3)
    culprits = culprits_of(s.engine)
    for c in culprits:  # each as the search's only culprit
        run_whatifs(s.sides(), s.reference_tokens(), [c], None)
    for c in culprits:
        ws = {t["whatif"]: t for t in c["precision"]["whatifs"]}
        assert sorted(ws) == sorted([UNIT, WSUM] if c["kind"] in ("moe", "experts") else [UNIT]), c["unit"]
        for t in ws.values():
            assert isinstance(t["value"], float) and math.isfinite(t["value"]) and t["before"] > 0, (c["unit"], t)
        if c["unit"] != "layers.0":  # the noise is upstream of the unit: still there after the what-if
            assert ws[UNIT]["value"] > 0.5 * ws[UNIT]["before"], (c["unit"], ws[UNIT])

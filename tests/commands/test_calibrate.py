"""`bisect calibrate` and `--threshold floor[xN]`, on the real fixtures (hf backends only)."""

from __future__ import annotations

import json

import pytest
from conftest import model_dir, short_trace, trace_path

from numbisect.cli import main
from numbisect.commands.calibrate import METRICS
from numbisect.common.errors import ExitCode
from numbisect.report.document import load_report

D = model_dir("qwen3_moe")
T = trace_path("qwen3_moe")


def cli(args, capsys):
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def floor_files(tmp_path_factory):
    """Floors of the qwen3_moe fixture in bf16 (with an fp32 dtype variant) and in fp32."""
    d = tmp_path_factory.mktemp("floors")
    out = {}
    for dtype, extra in (("bfloat16", ["--dtype-variant", "float32"]), ("float32", [])):
        p = d / f"floor_{dtype}.json"
        assert main(["calibrate", "--ref", f"hf:{D}", "--trace", T, "--ref-dtype", dtype, *extra, "--out", str(p), "-q"]) == 0
        out[dtype] = p
    return out


def test_calibrate_prints_a_floor_per_metric_and_variant(tmp_path, capsys):
    p = tmp_path / "floor.json"
    code, out, err = cli(["calibrate", "--ref", f"hf:{D}", "--trace", T, "--dtype-variant", "float32", "--out", str(p), "-q"], capsys)
    assert code == ExitCode.ALIGNED and err == ""
    doc = json.loads(p.read_text())
    names = [v["name"] for v in doc["variants"]]
    assert names == ["batch_size=4", "attn_implementation=eager", "experts_implementation=eager",
                     "experts_implementation=batched_mm", "dtype=float32"]
    for g in ("completion", "prompt", "image", "all"):
        for m in METRICS:  # the floor is the largest over the variants
            assert doc["floor"][g][m] == max(v["groups"][g][m] for v in doc["variants"])
    fl = doc["floor"]["completion"]
    assert fl["k3-mean"] > 0 and fl["max-abs-logprob-diff"] > 0  # bf16: eager vs sdpa attention differ
    assert "floor (the largest over the variants)" in out
    row = [line for line in out.splitlines() if line.startswith("completion ")][-1]
    assert f"{fl['k3-mean']:.2e}" in row
    assert all(n in out for n in names)


def test_fp32_floor_is_far_below_the_bf16_floor(floor_files):
    bf16 = json.loads(floor_files["bfloat16"].read_text())["floor"]["completion"]
    fp32 = json.loads(floor_files["float32"].read_text())["floor"]["completion"]
    assert 0 < fp32["k3-mean"] < 1e-3 * bf16["k3-mean"]
    assert fp32["max-abs-logprob-diff"] < 1e-3 * bf16["max-abs-logprob-diff"]


def _run(floor_args, capsys, tmp_path, engine_opts=(), faults=(), dtype="bfloat16", threshold="floor"):
    out = tmp_path / "r.json"
    args = ["run", "--ref", f"hf:{D}", "--engine", f"hf:{D}", "--trace", T, "--ref-dtype", dtype, "--engine-dtype", dtype,
            "--threshold", threshold, *floor_args, "--out", str(out), "-q"]
    for o in engine_opts:
        args += ["--engine-opt", o]
    for f in faults:
        args += ["--engine-fault", f]
    code, stdout, err = cli(args, capsys)
    return code, (load_report(str(out)) if out.exists() else None), err


def test_search_with_threshold_floor_on_the_reference_itself_names_no_culprit(floor_files, capsys, tmp_path):
    code, r, _ = _run(["--floor", str(floor_files["bfloat16"])], capsys, tmp_path)
    assert code == ExitCode.ALIGNED and r["culprits"] == [] and r["search"]["verdict"] == "aligned"
    floor = json.loads(floor_files["bfloat16"].read_text())["floor"]["completion"]["k3-mean"]
    origin = r["threshold"]["threshold_origin"]
    assert origin == {"source": "file", "file": str(floor_files["bfloat16"]), "factor": 1.0, "floor": floor,
                      "variants": [v["name"] for v in json.loads(floor_files["bfloat16"].read_text())["variants"]]}
    assert r["threshold"]["threshold"] == floor


def test_a_harmless_variant_as_the_engine_is_aligned_under_the_floor_but_not_under_a_tiny_threshold(floor_files, capsys, tmp_path):
    # The engine is the reference with eager attention: a variant the floor measured.
    code, r, _ = _run(["--floor", str(floor_files["bfloat16"])], capsys, tmp_path, engine_opts=["attn_implementation=eager"])
    assert code == ExitCode.ALIGNED and r["culprits"] == []
    assert 0 < r["baseline"]["value"] <= r["threshold"]["threshold"]
    code, r, _ = _run([], capsys, tmp_path, engine_opts=["attn_implementation=eager"], threshold="1e-9")
    assert code != ExitCode.ALIGNED and r["verdict"] == "diverged"


def test_floor_calibrated_on_the_fly_when_no_file_is_given_and_floorxN_scales_it(floor_files, capsys, tmp_path):
    code, r, err = _run([], capsys, tmp_path, dtype="float32", threshold="floorx10",
                        faults=["moe_combine_bf16@layers.2.moe"])
    # fp32 floor ~1e-13; the planted bf16 weighted sum (k3 ~1e-8) stands far above 10x it.
    origin = r["threshold"]["threshold_origin"]
    assert origin["source"] == "calibrated" and origin["file"] is None and origin["factor"] == 10.0
    assert r["threshold"]["threshold"] == pytest.approx(10 * origin["floor"])
    fp32 = json.loads(floor_files["float32"].read_text())["floor"]["completion"]["k3-mean"]
    assert origin["floor"] == fp32  # the same measurement as `calibrate`
    assert code == ExitCode.DIVERGED
    assert [c["unit"] for c in r["culprits"]] == ["layers.2.moe.experts"]


@pytest.mark.parametrize("args,msg", [
    (["calibrate", "--variant", "attn,paddding"], "unknown variant 'paddding'"),
    (["calibrate", "--variant", "dtype"], "variant dtype needs --dtype-variant"),
    (["calibrate", "--dtype-variant", "bfloat16"], "is the reference's own dtype"),
    (["calibrate", "--dtype-variant", "float8"], "unknown dtype 'float8'"),
    (["calibrate", "--batch-size", "1"], "--batch-size must be at least 2"),
    (["run", "--engine", f"hf:{D}", "--threshold", "floorxten"], "floorxN needs a positive number"),
    (["run", "--engine", f"hf:{D}", "--threshold", "floorx-2"], "floorxN needs a positive number"),
    (["run", "--engine", f"hf:{D}", "--threshold", "flor"], "give a number, floor, or floorxN"),
    (["compare", "--engine", f"hf:{D}", "--threshold", "1e-3", "--floor", "x.json"], "--floor needs --threshold floor"),
])
def test_bad_calibration_input_is_one_line(args, msg, capsys, tmp_path):
    out = tmp_path / "o.json"
    code, _, err = cli([*args, "--ref", f"hf:{D}", "--trace", T, "--out", str(out), "-q"], capsys)
    assert code == ExitCode.USAGE
    assert msg in err and len(err.strip().splitlines()) == 1 and err.startswith("bisect: error:")
    assert not out.exists()


def test_experts_variant_on_a_dense_model_is_refused(capsys):
    code, _, err = cli(["calibrate", "--ref", f"hf:{model_dir('qwen3')}", "--trace", trace_path("qwen3"), "--variant", "experts", "-q"], capsys)
    assert code == ExitCode.USAGE and "no experts implementation to vary" in err and len(err.strip().splitlines()) == 1


def test_floor_file_for_another_model_trace_or_dtype_is_refused(floor_files, capsys, tmp_path):
    q = model_dir("qwen3")
    other_model = ["--ref", f"hf:{q}", "--engine", f"hf:{q}", "--trace", trace_path("qwen3")]
    same_model = ["--ref", f"hf:{D}", "--engine", f"hf:{D}"]
    bad = tmp_path / "bad.json"
    bad.write_text('{"hello": 1}')
    cases = [
        (other_model + ["--floor", str(floor_files["bfloat16"])], "calibrated on another model"),
        (same_model + ["--trace", short_trace("qwen3_moe", 3), "--floor", str(floor_files["bfloat16"])], "calibrated on another trace"),
        (same_model + ["--trace", T, "--ref-dtype", "float32", "--floor", str(floor_files["bfloat16"])], "calibrated in bfloat16"),
        (same_model + ["--trace", T, "--floor", str(bad)], "not a numbisect floor file"),
        (same_model + ["--trace", T, "--floor", str(tmp_path / "missing.json")], "floor file not found"),
    ]
    for args, msg in cases:
        out = tmp_path / "r.json"
        code, _, err = cli(["run", *args, "--threshold", "floor", "--out", str(out), "-q"], capsys)
        assert code == ExitCode.USAGE, err
        assert msg in err and len(err.strip().splitlines()) == 1
        assert not out.exists()


def test_floor_calibrates_on_a_rollout_dump_read_as_run_reads_it(capsys, tmp_path):
    """A rollout dump (OpenRLHF JSONL) is calibrated on its own token ids: on the fly and as a file."""
    dump = str(trace_path("qwen3_moe").replace("qwen3_moe.jsonl", "qwen3_moe.openrlhf.jsonl"))
    floor = tmp_path / "floor.json"
    code, out, err = cli(["calibrate", "--ref", f"hf:{D}", "--trace", dump, "--variant", "batch", "--out", str(floor), "-q"],
                         capsys)
    assert code == 0, err
    doc = json.loads(floor.read_text())
    assert doc["floor"]["completion"]["k3-mean"] >= 0
    report = tmp_path / "r.json"
    code, out, err = cli(["compare", "--ref", f"hf:{D}", "--engine", "rollout", "--trace", dump, "--threshold", "floorx2",
                          "--floor", str(floor), "--out", str(report), "-q"], capsys)
    assert code in (ExitCode.ALIGNED, ExitCode.DIVERGED), err
    r = load_report(str(report))
    assert r["threshold"]["threshold"] == 2 * doc["floor"]["completion"]["k3-mean"]

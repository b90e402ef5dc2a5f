"""Never lose or contradict a finding (issue 28).

A checkpoint difference is a finding at any threshold: a tiny weight change whose effect on
the tokens stays under the threshold is still reported, with its own exit code (5), never as
a bare "OK ALIGNED". Copies of the fixtures are damaged at test time (tmp_path); engines are
hf float32 (fast, no vLLM).
"""

from __future__ import annotations

import json

import pytest

from conftest import damaged_copy, model_dir, short_trace
from numbisect import findings as F
from numbisect.cli import main
from numbisect.errors import ExitCode
from numbisect.report import load_report


def scale_one_norm(layer: int, factor: float):
    def edit(w):
        key = f"model.layers.{layer}.post_attention_layernorm.weight"
        w[key] = w[key] * factor
    return edit


def cli(cmd: str, ref: str, eng: str, out, *extra) -> int:
    return main([cmd, "--ref", f"hf:{ref}", "--engine", f"hf:{eng}", "--trace", short_trace("qwen3", 2),
                 "--ref-dtype", "float32", "--engine-dtype", "float32", "--out", str(out), *extra])


# -- item 4: a checkpoint difference is a finding at any threshold --------------------------
def test_the_verdict_rule_and_its_exit_codes():
    diff = {"same_path": False, "units": {"layers.1.post_attn_norm": {"summary": "x"}}, "unmapped": [], "config": []}
    assert F.tokens_verdict(1e-3, 1e-3) == "aligned" and F.tokens_verdict(2e-3, 1e-3) == "diverged"
    assert F.exit_code("aligned", None) == ExitCode.ALIGNED == 0
    assert F.exit_code("aligned", diff) == ExitCode.CHECKPOINT_DIFFERS == 5
    assert F.exit_code("diverged", diff) == ExitCode.DIVERGED
    assert F.exit_code("aligned", {**diff, "units": {}}) == ExitCode.ALIGNED  # nothing differs
    assert F.with_checkpoint(ExitCode.NO_CULPRIT, diff) == ExitCode.NO_CULPRIT
    assert F.mark(True, True) != "OK ALIGNED" and F.mark(True, False) == "OK ALIGNED"


def test_compare_says_a_tiny_weight_change_under_the_threshold_is_still_a_difference(tmp_path, capsys):
    copy = damaged_copy("qwen3", tmp_path, scale_one_norm(1, 1.02))
    out = tmp_path / "r.json"
    code = cli("compare", model_dir("qwen3"), copy, out)
    text = capsys.readouterr().out
    r = load_report(str(out))  # validates against the schema
    assert r["verdict"] == "aligned" and r["baseline"]["value"] <= 1e-3  # the tokens are within the threshold
    assert code == ExitCode.CHECKPOINT_DIFFERS
    assert r["checkpoint_differs"]["units"] == ["layers.1.post_attn_norm"]
    assert "OK ALIGNED" not in text
    assert "verdict: ~~ TOKENS ALIGNED, CHECKPOINTS DIFFER" in text
    assert "layers.1.post_attn_norm: post_attention_layernorm.weight scaled by 1.02" in text
    assert main(["report", "show", str(out)]) == 0
    assert "TOKENS ALIGNED, CHECKPOINTS DIFFER" in capsys.readouterr().out
    main(["report", "md", str(out)])
    assert "**Verdict: tokens aligned, checkpoints DIFFER.**" in capsys.readouterr().out


def test_compare_says_a_config_difference_under_the_threshold_is_a_difference(tmp_path, capsys):
    def cfg(c):
        c["rms_norm_eps"] = 1.1e-6
    copy = damaged_copy("qwen3", tmp_path, lambda w: None, cfg)
    out = tmp_path / "r.json"
    code = cli("compare", model_dir("qwen3"), copy, out)
    text = capsys.readouterr().out
    r = json.loads(out.read_text())
    assert r["verdict"] == "aligned" and code == ExitCode.CHECKPOINT_DIFFERS
    assert r["checkpoint_differs"]["config"] == ["rms_norm_eps"]
    assert "OK ALIGNED" not in text and "config: rms_norm_eps is 1.1e-06 in the engine" in text


def test_an_identical_copy_is_plainly_aligned(tmp_path, capsys):
    copy = damaged_copy("qwen3", tmp_path, lambda w: None)
    out = tmp_path / "r.json"
    assert cli("compare", model_dir("qwen3"), copy, out) == ExitCode.ALIGNED
    assert "verdict: OK ALIGNED" in capsys.readouterr().out
    assert "checkpoint_differs" not in json.loads(out.read_text())


def test_run_on_a_tiny_weight_change_exits_5_with_the_difference(tmp_path, capsys):
    copy = damaged_copy("qwen3", tmp_path, scale_one_norm(2, 1.02))
    out = tmp_path / "r.json"
    code = cli("run", model_dir("qwen3"), copy, out, "--no-whatif")
    text = capsys.readouterr().out
    r = load_report(str(out))
    assert r["verdict"] == "aligned" and code == ExitCode.CHECKPOINT_DIFFERS, r["search"]
    assert "OK ALIGNED" not in text and "layers.2.post_attn_norm" in text


def test_help_documents_exit_code_5(capsys):
    assert main(["run", "--help"]) == 0
    assert "5    tokens within the threshold, but the engine's checkpoint differs" in capsys.readouterr().out

"""Checkpoint differences as findings: before any forward, numbisect says which units'
weights and which numeric config fields differ between the reference and the engine
checkpoints, and how (swapped, permuted, scaled, changed)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import damaged_copy, model_dir, permute_heads, scale_norm, swap_experts, swap_gate_up, trace_path
from numbisect.backends.base import check_checkpoint, load_config
from numbisect.ckptdiff import diff_checkpoints
from numbisect.cli import main
from numbisect.report import load_report


def diff(name: str, copy: str) -> dict:
    ref = model_dir(name)
    return diff_checkpoints(ref, copy, check_checkpoint(ref), check_checkpoint(copy), load_config(ref))


def add_noise(key: str):
    def edit(w):
        g = torch.Generator().manual_seed(0)
        w[key] = (w[key].float() + 1e-2 * torch.randn(w[key].shape, generator=g)).to(w[key].dtype)
    return edit


CASES = [  # (family, damage, unit, words the unit's summary must hold)
    ("qwen3", scale_norm(1), "layers.1.post_attn_norm", "post_attention_layernorm.weight scaled by 1.5"),
    ("qwen3", swap_gate_up(2), "layers.2.mlp", "gate_proj <-> up_proj swapped"),
    ("qwen3_moe", swap_experts(2, 3, 5), "layers.2.moe.experts", "experts.3 <-> experts.5 swapped (3 tensor pairs)"),
    ("qwen3_moe", permute_heads(1, 64, [1, 0]), "layers.1.attn", "self_attn.q_proj.weight heads permuted (order 1,0)"),
    ("mixtral", swap_gate_up(2), "layers.2.moe.experts", "w1 <-> w3 swapped"),  # checkpoint names block_sparse_moe
    ("mixtral", add_noise("model.layers.0.self_attn.o_proj.weight"), "layers.0.attn", "changed: self_attn.o_proj.weight"),
]


@pytest.mark.parametrize("name,edit,unit,words", CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_each_damage_is_named_at_its_unit_with_how(name, edit, unit, words, tmp_path):
    d = diff(name, damaged_copy(name, tmp_path, edit))
    assert not d["identical"] and not d["config"] and not d["unmapped"]
    assert list(d["units"]) == [unit], d["units"]
    assert words in d["units"][unit]["summary"]


def test_glm_experts_and_shared_expert_are_named_apart(tmp_path):
    d = diff("glm4_moe", damaged_copy("glm4_moe", tmp_path, swap_gate_up(1)))
    assert list(d["units"]) == ["layers.1.moe.experts", "layers.1.moe.shared_expert"]
    assert d["units"]["layers.1.moe.experts"]["summary"] == "gate_proj <-> up_proj swapped (8 tensor pairs)"
    assert d["units"]["layers.1.moe.shared_expert"]["summary"] == "gate_proj <-> up_proj swapped"


def test_changed_tensor_reports_its_size(tmp_path):
    d = diff("mixtral", damaged_copy("mixtral", tmp_path, add_noise("model.layers.0.self_attn.o_proj.weight")))
    t = d["units"]["layers.0.attn"]["tensors"][0]
    assert t["how"] == "changed" and 0 < t["max_abs"] < 0.1 and 0 < t["rel_norm"] < 1


def test_numeric_config_fields_that_differ_are_listed_with_their_readers(tmp_path):
    def cfg(c):
        c["rms_norm_eps"] = 1e-5
        c["norm_topk_prob"] = not c["norm_topk_prob"]
        c["transformers_version"] = "0.0"  # not numeric: not a finding
    d = diff("qwen3_moe", damaged_copy("qwen3_moe", tmp_path, lambda w: None, cfg))
    assert d["units"] == {} and not d["identical"]
    by = {c["field"]: c for c in d["config"]}
    assert set(by) == {"rms_norm_eps", "norm_topk_prob"}
    assert by["rms_norm_eps"]["ref"] == 1e-6 and by["rms_norm_eps"]["engine"] == 1e-5
    assert "norm" in by["rms_norm_eps"]["read_by"] and by["norm_topk_prob"]["read_by"] == ["router"]


def test_an_undamaged_copy_is_identical(tmp_path):
    d = diff("qwen3", damaged_copy("qwen3", tmp_path, lambda w: None))
    assert d["identical"] and d["units"] == {} and d["tensors"] > 0


def test_a_missing_tensor_is_named(tmp_path):
    def drop(w):
        del w["model.layers.3.self_attn.k_proj.weight"]
    d = diff("qwen3", damaged_copy("qwen3", tmp_path, drop))
    assert d["units"]["layers.3.attn"]["tensors"] == [{"tensor": "model.layers.3.self_attn.k_proj.weight", "how": "missing in the engine"}]


def test_compare_reports_the_diff_and_show_prints_it(tmp_path, capsys):
    copy = damaged_copy("qwen3_moe", tmp_path, swap_experts(2, 3, 5), lambda c: c.update(rms_norm_eps=1e-5))
    out = tmp_path / "r.json"
    code = main(["compare", "--ref", f"hf:{model_dir('qwen3_moe')}", "--engine", f"hf:{copy}",
                 "--trace", trace_path("qwen3_moe"), "--out", str(out), "-q"])
    assert code in (0, 1, 5)
    r = load_report(str(out))  # validates against the schema
    assert "layers.2.moe.experts" in r["inputs"]["checkpoint_diff"]["units"]
    capsys.readouterr()
    assert main(["report", "show", str(out)]) in (0, 1)
    text = capsys.readouterr().out
    assert "layers.2.moe.experts: experts.3 <-> experts.5 swapped (3 tensor pairs)" in text
    assert "config: rms_norm_eps is 1e-05 in the engine, 1e-06 in the reference (read by norm, attn)" in text
    from numbisect.tui.widgets.overview import overview_text  # the TUI's overview shows it too

    assert "layers.2.moe.experts: experts.3 <-> experts.5 swapped (3 tensor pairs)" in overview_text(r).plain


def test_one_checkpoint_for_both_sides_adds_nothing(tmp_path):
    out = tmp_path / "r.json"
    main(["compare", "--ref", f"hf:{model_dir('qwen3')}", "--engine", f"hf:{model_dir('qwen3')}",
          "--trace", trace_path("qwen3"), "--out", str(out), "-q"])
    assert "checkpoint_diff" not in json.loads(out.read_text())["inputs"]


def test_run_names_the_damaged_unit_and_its_weight_evidence(tmp_path, capsys):
    """A search on a damaged copy names the unit whose weights differ, with the checkpoint
    evidence under the culprit, within the issue's bound (the diff orders the search)."""
    copy = damaged_copy("qwen3_moe", tmp_path, swap_experts(2, 3, 5))
    out = tmp_path / "r.json"
    code = main(["run", "--ref", f"hf:{model_dir('qwen3_moe')}", "--engine", f"hf:{copy}", "--trace", trace_path("qwen3_moe"),
                 "--ref-dtype", "float32", "--engine-dtype", "float32", "--threshold", "1e-9", "--out", str(out), "-q"])
    r = load_report(str(out))
    assert code == 1, r["search"]["stop_reason"]
    assert [c["unit"] for c in r["culprits"]] == ["layers.2.moe.experts"]
    capsys.readouterr()
    main(["report", "show", str(out)])
    assert "  its weights differ from the reference's: layers.2.moe.experts: experts.3 <-> experts.5 swapped (3 tensor pairs)" in capsys.readouterr().out


@pytest.mark.parametrize("name, edit, field, readers", [
    ("qwen3", lambda c: c["rope_parameters"].update(rope_theta=100.0), "rope_parameters.rope_theta", ["attn"]),
    ("glm4_moe", lambda c: c.update(routed_scaling_factor=2.5), "routed_scaling_factor", ["router"]),
    ("glm4_moe", lambda c: c.update(norm_topk_prob=False), "norm_topk_prob", ["router"]),
    ("qwen3_vl_moe", lambda c: c["text_config"]["rope_parameters"].update(rope_theta=100.0),
     "text_config.rope_parameters.rope_theta", ["attn"]),
])
def test_config_field_is_named_where_the_family_keeps_it(name, edit, field, readers, tmp_path):
    """transformers 5 keeps rope_theta in rope_parameters (a multimodal family's under
    text_config): the finding names the key that changed, not the whole dict."""
    d = diff(name, damaged_copy(name, tmp_path, lambda w: None, edit))
    assert d["units"] == {} and not d["identical"]
    [c] = d["config"]
    assert c["field"] == field and c["read_by"] == readers and c["missing"] is None
    assert c["engine"] != c["ref"]


def test_fused_expert_tensors_with_two_experts_swapped_say_so(tmp_path):
    """Qwen3-VL-MoE keeps each layer's experts in one [experts, ...] tensor: two experts'
    slices swapped are named as experts permuted, with the order."""
    def swap(w):
        for key in ("model.language_model.layers.3.mlp.experts.gate_up_proj", "model.language_model.layers.3.mlp.experts.down_proj"):
            t = w[key].clone()
            t[[6, 7]] = w[key][[7, 6]]
            w[key] = t
    d = diff("qwen3_vl_moe", damaged_copy("qwen3_vl_moe", tmp_path, swap))
    assert list(d["units"]) == ["layers.3.moe.experts"]
    assert d["units"]["layers.3.moe.experts"]["summary"] == (
        "mlp.experts.down_proj experts permuted (order 0,1,2,3,4,5,7,6); mlp.experts.gate_up_proj experts permuted (order 0,1,2,3,4,5,7,6)")

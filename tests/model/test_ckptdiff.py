"""Checkpoint differences as findings: before any forward, numbisect says which units'
weights and which numeric config fields differ between the reference and the engine
checkpoints, and how (swapped, permuted, scaled, changed)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import (
    damaged_copy,
    model_dir,
    permute_heads,
    scale_norm,
    swap_experts,
    swap_gate_up,
    trace_path,
)

from numbisect.backends.base import check_checkpoint, load_config
from numbisect.cli import main
from numbisect.model.ckptdiff import diff_checkpoints
from numbisect.report.document import load_report


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
    assert "config: rms_norm_eps is 1e-05 in the engine, 1e-06 in the reference (read by attn, norm)" in text
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


# -- signatures on tensors (#28 item 3): fast, no checkpoint --------------------------------
def _t(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16).float()


def _interleaved_to_half(w, h):
    """Each head's rows reordered: even rows first, then odd (interleaved -> half-split rotary)."""
    idx = torch.cat([torch.cat([torch.arange(j * h, (j + 1) * h, 2), torch.arange(j * h + 1, (j + 1) * h, 2)]) for j in range(w.shape[0] // h)])
    return w[idx]


HEADS = {"q": 2, "kv": 1}  # two query heads, one key/value head
SIGNATURES = [  # (name, reference, engine made from it, how, words of its phrase)
    ("mlp.router.bias", _t(8), lambda r: torch.zeros_like(r), "zeroed", "zeroed"),
    ("self_attn.o_proj.weight", _t(16, 16), lambda r: -r, "negated", "negated"),
    ("self_attn.o_proj.weight", _t(16, 16), lambda r: r.T.contiguous(), "transposed", "transposed"),
    ("linear_attn.conv1d.weight", _t(12, 1, 4), lambda r: r.flip(2), "flipped", "flipped along axis 2"),
    ("input_layernorm.weight", _t(16) * 0.05, lambda r: (r + 1).to(torch.bfloat16).float(), "offset",
     "offset by +1 (zero-centred <-> plain RMSNorm weights)"),
    ("mlp.gate_proj.weight", _t(16, 8), lambda r: torch.cat([r[:4] * 0, r[4:]]), "rows zeroed", "rows 0-3 zeroed (4 of 16)"),
    ("self_attn.q_proj.weight", _t(128, 8), lambda r: torch.cat([r[64:], r[:64]]), "rows permuted", "heads permuted (order 1,0)"),
    ("self_attn.q_proj.weight", _t(128, 8), lambda r: _interleaved_to_half(r, 64), "permuted inside heads",
     "rows interleaved -> half-split inside each head (64 rows each)"),
    # one head of 64 rows: its [32 | 32] parts exchanged is inside the head, never "heads permuted"
    ("self_attn.k_proj.weight", _t(64, 8), lambda r: torch.cat([r[32:], r[:32]]), "permuted inside heads",
     "rows [first 32 | last 32] exchanged inside its one head"),
    # a low-rank projection has no heads: its blocks are blocks
    ("self_attn.kv_a_proj_with_mqa.weight", _t(128, 8), lambda r: torch.cat([r[64:], r[:64]]), "rows permuted",
     "blocks of 64 rows permuted"),
    # gate/up columns de-interleaved inside one expert of a fused [experts, hidden, 2 x inter] tensor
    ("mlp.experts.gate_up_proj", _t(4, 8, 16), lambda r: torch.stack([r[0], r[1], r[2][:, list(range(0, 16, 2)) + list(range(1, 16, 2))], r[3]]),
     "experts changed", "expert 2: columns permuted (interleaved -> half-split)"),
    # the same de-interleave on that expert's 1-D bias in a fused [experts, 2 x inter] tensor (#36: "changed" before)
    ("mlp.experts.gate_up_proj_bias", _t(4, 16), lambda r: torch.stack([r[0], r[1], r[2][list(range(0, 16, 2)) + list(range(1, 16, 2))], r[3]]),
     "experts changed", "expert 2: elements permuted (interleaved -> half-split)"),
    # and on one expert's own 1-D bias
    ("mlp.experts.2.up_proj.bias", _t(16), lambda r: r[list(range(0, 16, 2)) + list(range(1, 16, 2))], "elements permuted",
     "elements permuted (interleaved -> half-split)"),
    # inf and NaN named, with counts (#36: "changed" before)
    ("mlp.down_proj.weight", _t(8, 8), lambda r: torch.where(torch.arange(64).reshape(8, 8) < 3, torch.tensor(float("inf")), r),
     "non-finite", "holds 3 inf (of 64 values)"),
    ("self_attn.o_proj.weight", _t(4, 4), lambda r: torch.full_like(r, float("nan")), "non-finite", "holds 16 NaN"),
]


@pytest.mark.parametrize("name,r,make,how,words", SIGNATURES, ids=[f"{s[0]}-{s[3]}" for s in SIGNATURES])
def test_each_conversion_signature_is_explained(name, r, make, how, words):
    from numbisect.model.ckptdiff import explain_tensors

    out = explain_tensors(r, make(r), name, HEADS)
    assert out["how"] == how, out
    assert words in out.get("phrase", ""), out


def test_small_noise_is_changed_not_scaled_or_offset():
    from numbisect.model.ckptdiff import explain_tensors

    r = _t(16, 16)
    e = r + 1e-4 * _t(16, 16, seed=1)
    assert explain_tensors(r, e, "self_attn.o_proj.weight", HEADS)["how"] == "changed"


def test_an_end_to_end_diff_names_the_new_signatures_at_their_units(tmp_path):
    """A gpt-oss copy with layer 1's attention sinks zeroed, layer 2's input norm offset by
    +1, and layer 3's query heads' rows de-interleaved (rotary layout): each named at its unit."""
    def edit(w):
        w["model.layers.1.self_attn.sinks"] = torch.zeros_like(w["model.layers.1.self_attn.sinks"])
        k = "model.layers.2.input_layernorm.weight"
        w[k] = (w[k].float() + 1).to(w[k].dtype)
        k = "model.layers.3.self_attn.q_proj.weight"
        w[k] = _interleaved_to_half(w[k], 64).contiguous()
    d = diff("gpt_oss", damaged_copy("gpt_oss", tmp_path, edit))
    s = {u: v["summary"] for u, v in d["units"].items()}
    assert s == {
        "layers.1.attn": "self_attn.sinks zeroed",
        "layers.2.input_norm": "input_layernorm.weight offset by +1 (zero-centred <-> plain RMSNorm weights)",
        "layers.3.attn": "self_attn.q_proj.weight rows interleaved -> half-split inside each head (64 rows each)",
    }, s


def test_rows_moved_across_layers_name_the_layer(tmp_path):
    def edit(w):
        w["model.layers.1.mlp.down_proj.weight"] = w["model.layers.2.mlp.down_proj.weight"].clone()
        w["model.layers.2.mlp.down_proj.weight"] = w["model.layers.3.mlp.down_proj.weight"].clone()
        a = w["model.layers.0.mlp.up_proj.weight"].clone()
        a[:8] = w["model.layers.1.mlp.up_proj.weight"][:8]
        w["model.layers.0.mlp.up_proj.weight"] = a
    d = diff("qwen3", damaged_copy("qwen3", tmp_path, edit))
    s = {u: v["summary"] for u, v in d["units"].items()}
    assert s["layers.1.mlp"] == "layers.1 <-> layers.2 moved"  # a whole tensor: its digest says so
    assert s["layers.0.mlp"].startswith("mlp.up_proj.weight 8 of ") and "rows hold layer 1's (a layer index shifted)" in s["layers.0.mlp"]

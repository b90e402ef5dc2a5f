"""Conversion bugs: the engine loads a damaged copy of the reference checkpoint.

A checkpoint converted wrongly (a norm weight scaled, gate and up projections swapped)
is the bug people ship between a trainer and an engine. The swaps must still carry the
whole reference unit (the self-check passes on the damaged copy) and the search must
name the damaged unit, on every fixture family, with a bf16 transformers engine.
"""

from __future__ import annotations

import pytest
from conftest import (
    damaged_copy,
    hf,
    model_dir,
    scale_norm,
    session,
    short_trace,
    swap_gate_up,
)

from numbisect.cli import main
from numbisect.commands.run import run
from numbisect.common.errors import ExitCode
from numbisect.pipeline.measure import Settings
from numbisect.report.document import load_report
from numbisect.session.session import Session, Spec

CASES = [
    ("qwen3", scale_norm(1), ["layers.1.post_attn_norm"]),
    ("qwen3", swap_gate_up(2), ["layers.2.mlp"]),
    ("qwen3_moe", swap_gate_up(0), ["layers.0.moe.experts"]),
    ("glm4_moe", swap_gate_up(1), ["layers.1.moe.experts", "layers.1.moe.shared_expert"]),
    ("mixtral", scale_norm(0), ["layers.0.post_attn_norm"]),
    ("mixtral", swap_gate_up(2), ["layers.2.moe.experts"]),
]


@pytest.mark.parametrize("name,edit,culprits", CASES, ids=[f"{c[0]}-{c[1].__qualname__.split('.')[0]}" for c in CASES])
def test_a_damaged_checkpoint_copy_passes_the_self_check_and_is_named(name, edit, culprits, tmp_path):
    copy = damaged_copy(name, tmp_path, edit)
    spec = Spec(ref=f"hf:{model_dir(name)}", engine=f"hf:{copy}", trace=short_trace(name, 8))
    s = Session.open(spec, Settings(threshold=1e-6), backends={"ref": hf(name)})
    try:
        body, code = run(s, swap=None, strategy="hierarchical", max_trials=None, log=None, resume=None)
    finally:
        s.close()
    sc = body["self_check"]
    assert sc["passed"] and sc["k3_mean"] <= 1e-7, sc  # every unit swapped reproduces the reference
    assert body["baseline"]["value"] > 1e-6
    assert code == ExitCode.DIVERGED, body["search"]["stop_reason"]
    assert sorted(c["unit"] for c in body["culprits"]) == culprits


def test_a_config_value_every_norm_reads_is_a_systematic_culprit(tmp_path, capsys):
    """rms_norm_eps changed in the engine's config.json: every RMSNorm reads it (Qwen3's
    attention too, for its q/k norms). The checkpoint diff names the field, and the search
    names the kinds, in every layer, instead of calling it diffuse; the summary, report md
    and the TUI overview say so."""
    copy = damaged_copy("qwen3", tmp_path, lambda w: None, lambda c: c.update(rms_norm_eps=1e-2))
    out = tmp_path / "r.json"
    code = main(["run", "--ref", f"hf:{model_dir('qwen3')}", "--engine", f"hf:{copy}", "--trace", short_trace("qwen3", 8),
                 "--ref-dtype", "float32", "--engine-dtype", "float32", "--threshold", "1e-9", "--out", str(out), "-q"])
    r = load_report(str(out))
    diff = r["inputs"]["checkpoint_diff"]
    assert [c["field"] for c in diff["config"]] == ["rms_norm_eps"] and diff["units"] == {}
    assert code == ExitCode.DIVERGED
    sy = r["search"]["systematic"]
    # the kinds in the order the config diff names the field's readers (from the modeling code)
    assert sorted(sy["kinds"]) == ["attn", "norm"] and sy["value"] <= 1e-9 and sy["layers"] == 4
    words = ", ".join(sy["kinds"])
    assert f"systematic culprit: {words}, in every layer" in capsys.readouterr().out
    main(["report", "md", str(out)])
    assert f"systematic culprit {', '.join(f'`{k}`' for k in sy['kinds'])} in every layer" in capsys.readouterr().out
    from numbisect.tui.widgets.overview import overview_text

    assert f"systematic culprit: {words}, in every layer" in overview_text(r).plain


def test_a_fault_planted_in_every_layer_of_one_kind_is_named_as_that_kind():
    s = session("qwen3_moe", "hf", ref_dtype="float32", engine_dtype="float32", samples=8, threshold=1e-9,
                faults=[f"weight_noise=1e-2@layers.{i}.attn" for i in range(4)])
    body, code = run(s, swap=None, strategy="hierarchical", max_trials=None, log=None, resume=None)
    assert code == ExitCode.DIVERGED
    sy = body["search"]["systematic"]
    assert sy["kinds"] == ["attn"] and sy["layers"] == 4 and sy["units"] == 4
    assert len(sy["per_layer"]["attn"]) == 4 and all(v > 1e-9 for v in sy["per_layer"]["attn"].values())  # each layer's attention is needed

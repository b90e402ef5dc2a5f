"""Recurrent states in offline dumps (numbisect.dump `state.{i}`, `bisect compare --engine dump:DIR`),
on Qwen3.5-MoE (fixtures/models/qwen3_5_moe: Gated DeltaNet in layers 0-2).

What a user relies on: the states a dump holds get the `recurrent_state` section, with the
same figures as comparing the engine live (exactly 0 for the reference itself in the same
dtype; bf16 engine: the hf engine's own figure); linear layers whose states the dump lacks
are named as missing (no zero); a dump without states (an older one) still loads; a state
listed for a unit without recurrence, or missing for a sample, is refused.
"""

from __future__ import annotations

import json
import random
import shutil

import pytest
from conftest import hf, model_dir, trace_path, vllm

from numbisect.backends.dump import write_dump
from numbisect.cli import main
from numbisect.common.errors import InputError
from numbisect.model.trace import load_trace
from numbisect.pipeline.measure import Settings
from numbisect.report.document import validate
from numbisect.session.session import Session, Spec

pytestmark = pytest.mark.usefixtures("one_thread")

NAME = "qwen3_5_moe"
LINEAR = ["layers.0.attn", "layers.1.attn", "layers.2.attn"]
LONG = 150  # tokens of the long sample: chunk boundaries at 64 and 128


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> str:
    first = open(trace_path(NAME)).readline().strip()
    rng = random.Random(1)
    long = {"prompt_ids": [rng.randrange(256) for _ in range(50)], "completion_ids": [rng.randrange(256) for _ in range(LONG - 50)]}
    p = tmp_path_factory.mktemp("dumpstate") / "t.jsonl"
    p.write_text(first + "\n" + json.dumps(long) + "\n")
    return str(p)


@pytest.fixture(scope="module")
def dumps(trace, tmp_path_factory) -> dict:
    """Dumps written by hf engines: fp32 (the reference itself) and bf16, with states."""
    out = {}
    for dtype in ("float32", "bfloat16"):
        d = tmp_path_factory.mktemp(f"dump-{dtype}")
        write_dump(hf(NAME, dtype), load_trace(trace), str(d))
        out[dtype] = str(d)
    return out


def _dump_compare(trace: str, d: str) -> dict:
    spec = Spec(ref=f"hf:{model_dir(NAME)}", engine=f"dump:{d}", trace=trace, ref_dtype="float32")
    return Session.open(spec, Settings(), backends={"ref": hf(NAME, "float32")}).compare()


def _live_compare(trace: str, dtype: str) -> dict:
    spec = Spec(ref=f"hf:{model_dir(NAME)}", engine=f"hf:{model_dir(NAME)}", trace=trace, ref_dtype="float32",
                engine_dtype=dtype)
    return Session.open(spec, Settings(), backends={"ref": hf(NAME, "float32"), "engine": hf(NAME, dtype)}).compare()


def _rows(body: dict) -> dict:
    return {r["unit"]: r for r in body["recurrent_state"]["layers"]}


def _keep_states(src: str, dst, units: list[str] | None):
    """A copy of dump `src` whose manifest lists the states of `units` only (None: no "states" key)."""
    shutil.copytree(src, dst)
    m = json.loads((dst / "manifest.json").read_text())
    if units is None:
        m.pop("states")
    else:
        m["states"] = {u: v for u, v in m["states"].items() if u in units}
    (dst / "manifest.json").write_text(json.dumps(m))
    return str(dst)


def test_dump_holds_each_linear_layers_state_at_the_end_and_at_chunk_boundaries(dumps, trace):
    from safetensors import safe_open

    d = dumps["float32"]
    m = json.loads(open(f"{d}/manifest.json").read())
    assert sorted(m["states"]) == LINEAR and all(v["shard"] == "replicated" for v in m["states"].values())
    names = set()
    with safe_open(f"{d}/rank0/layers.1.attn.0000.safetensors", framework="pt") as h:
        names = set(h.keys())
        assert tuple(h.get_slice("state.1").get_shape()) == (2, 128, 128)
    assert {"state.0", "state.1", "state.1.64", "state.1.128"} <= names
    assert not any(k.startswith("state.") for k in safe_open(f"{d}/rank0/layers.3.attn.0000.safetensors", framework="pt").keys())


def test_same_dtype_dump_has_zero_state_error_and_bf16_dump_matches_the_live_engine(dumps, trace, tmp_path, capsys):
    same = _dump_compare(trace, dumps["float32"])
    rs = same["recurrent_state"]
    assert [r["unit"] for r in rs["layers"]] == LINEAR and rs["missing"] == []
    for row in rs["layers"]:
        assert row["state_shape"] == [2, 128, 128]
        for key in ("propagated", "local"):
            p = row[key]
            assert p["final"]["rel_l2"] == 0 and p["final"]["ulps"]["bitwise_equal"], (row["unit"], key)
            assert [(b["tokens"], b["rel_l2"]) for b in p["boundaries"]] == [(64, 0), (128, 0)]
    low = _dump_compare(trace, dumps["bfloat16"])
    live = _live_compare(trace, "bfloat16")
    got, want = _rows(low), _rows(live)
    for u in LINEAR:
        g, w = got[u]["propagated"], want[u]["propagated"]
        assert 1e-4 < g["final"]["rel_l2"] < 0.05, u
        assert g["final"]["rel_l2"] == pytest.approx(w["final"]["rel_l2"], rel=1e-6), u
        assert [b["rel_l2"] for b in g["boundaries"]] == pytest.approx([b["rel_l2"] for b in w["boundaries"]], rel=1e-6)
        assert got[u]["local"]["final"]["rel_l2"] > 0
    out = tmp_path / "r.json"
    code = main(["compare", "--ref", f"hf:{model_dir(NAME)}", "--engine", f"dump:{dumps['float32']}", "--trace", trace,
                 "--ref-dtype", "float32", "-q", "--out", str(out)])
    text = capsys.readouterr().out
    assert code == 0 and "Recurrent state (linear attention)" in text and "first state above rel-L2 0.01: none" in text
    r = json.loads(out.read_text())
    assert validate(r) == [] and r["recurrent_state"]["layers"][0]["unit"] == "layers.0.attn"


def test_layers_without_states_are_named_missing_and_an_old_dump_still_loads(dumps, trace, tmp_path, capsys):
    part = _dump_compare(trace, _keep_states(dumps["bfloat16"], tmp_path / "part", ["layers.1.attn"]))
    rs = part["recurrent_state"]
    assert [r["unit"] for r in rs["layers"]] == ["layers.1.attn"]
    assert rs["missing"] == ["layers.0.attn", "layers.2.attn"]
    old = _keep_states(dumps["float32"], tmp_path / "old", None)
    out = tmp_path / "old.json"
    code = main(["compare", "--ref", f"hf:{model_dir(NAME)}", "--engine", f"dump:{old}", "--trace", trace,
                 "--ref-dtype", "float32", "-q", "--out", str(out)])
    text = capsys.readouterr().out
    assert code == 0
    r = json.loads(out.read_text())
    assert r["recurrent_state"]["layers"] == [] and r["recurrent_state"]["missing"] == LINEAR
    assert r["units"] and validate(r) == []
    assert "no state in the dump (not measured): layers.0.attn, layers.1.attn, layers.2.attn" in text


def test_head_sharded_states_of_two_ranks_merge_to_the_single_rank_figures(dumps, trace, tmp_path):
    d = tmp_path / "tp2"
    write_dump(hf(NAME, "bfloat16"), load_trace(trace), str(d), world_size=2, state_shards={"layers.1.attn": "heads"})
    m = json.loads((d / "manifest.json").read_text())
    assert m["states"] == {"layers.0.attn": {"shard": "replicated"}, "layers.1.attn": {"shard": "heads"},
                           "layers.2.attn": {"shard": "replicated"}}
    from safetensors import safe_open

    with safe_open(str(d / "rank1" / "layers.1.attn.0000.safetensors"), framework="pt") as h:
        assert tuple(h.get_slice("state.0").get_shape()) == (1, 128, 128)  # one of the 2 heads
    two, one = _rows(_dump_compare(trace, str(d))), _rows(_dump_compare(trace, dumps["bfloat16"]))
    for u in LINEAR:
        assert two[u]["state_shape"] == [2, 128, 128]
        assert two[u]["propagated"] == one[u]["propagated"] and two[u]["local"] == one[u]["local"], u


def test_states_of_a_unit_without_recurrence_or_missing_a_sample_are_refused(dumps, trace, tmp_path):
    d = tmp_path / "bad"
    shutil.copytree(dumps["bfloat16"], d)
    m = json.loads((d / "manifest.json").read_text())
    m["states"]["layers.3.attn"] = {"shard": "replicated"}
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(InputError) as e:
        _dump_compare(trace, str(d))
    assert "not a linear-attention unit" in e.value.message and "layers.3.attn" in e.value.message
    m["states"].pop("layers.3.attn")
    (d / "manifest.json").write_text(json.dumps(m))
    # sample 1's final state of layers.2.attn dropped (its boundaries kept), the marker's size updated
    from safetensors.torch import load_file, save_file

    f = d / "rank0" / "layers.2.attn.0000.safetensors"
    tensors = load_file(str(f))
    del tensors["state.1"]
    save_file(tensors, str(f))
    done = json.loads((d / "rank0" / "COMPLETE").read_text())
    done["files"][f.name]["bytes"] = f.stat().st_size
    (d / "rank0" / "COMPLETE").write_text(json.dumps(done))
    with pytest.raises(InputError) as e:
        _dump_compare(trace, str(d))
    assert "unit layers.2.attn is listed with recurrent states but has none for sample(s) 1" in e.value.message


@pytest.mark.vllm
def test_dump_of_vllm_holds_its_mamba_cache_states_as_compared_live(trace, tmp_path):
    d = tmp_path / "vllm"
    write_dump(vllm(NAME), load_trace(trace), str(d))
    got = _rows(_dump_compare(trace, str(d)))
    spec = Spec(ref=f"hf:{model_dir(NAME)}", engine=f"vllm:{model_dir(NAME)}", trace=trace, ref_dtype="float32",
                engine_dtype="bfloat16")
    live = _rows(Session.open(spec, Settings(), backends={"ref": hf(NAME, "float32"), "engine": vllm(NAME)}).compare())
    for u in LINEAR:
        g, w = got[u]["propagated"], live[u]["propagated"]
        assert 0 < g["final"]["rel_l2"] < 0.05, u
        assert g["final"]["rel_l2"] == pytest.approx(w["final"]["rel_l2"], rel=1e-6), u
        assert [b["tokens"] for b in g["boundaries"]] == [64, 128]

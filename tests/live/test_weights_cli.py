"""`bisect weights`: exit 0 when every unit is ok, 1 when one differs (named), 2 bad input."""

from __future__ import annotations

import json

import pytest
from conftest import damaged_copy, model_dir, swap_gate_up

from numbisect.cli import main


@pytest.mark.parametrize("args, message", [
    (["--engine", f"hf:{model_dir('qwen3')}"], "--engine must be vllm:DIR for `bisect weights`"),
    (["--engine", "vllm:/nonexistent/model"], "checkpoint directory not found: /nonexistent/model"),
    (["--engine", f"vllm:{model_dir('qwen3')}", "--trace", "/nonexistent.jsonl"], "/nonexistent.jsonl: no such trace file"),
])
def test_bad_input_is_one_line_and_exit_2(args, message, capsys):
    code = main(["weights", "--ref", f"hf:{model_dir('qwen3')}", *args, "-q"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("bisect: error: ") and message in err[0], err


@pytest.mark.vllm
def test_a_converted_checkpoint_with_gate_and_up_swapped_is_named(tmp_path, capsys):
    from numbisect.report.document import load_report

    bad = damaged_copy("qwen3", tmp_path, swap_gate_up(2))
    out = tmp_path / "w.json"
    code = main(["weights", "--ref", f"hf:{model_dir('qwen3')}", "--engine", f"vllm:{bad}", "--out", str(out), "-q"])
    text = capsys.readouterr().out
    print(text)
    assert code == 1
    assert "layers.2.mlp             corrupted       gate_proj <-> up_proj swapped" in text
    report = load_report(out)  # validated against the schema
    assert report["kind"] == "weights" and not report["weights"]["ok"]
    assert [(u["unit"], u["status"]) for u in report["weights"]["units"] if u["status"] != "ok"] == [("layers.2.mlp", "corrupted")]
    assert json.dumps(report)  # plain JSON

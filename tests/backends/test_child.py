"""The one vLLM child runner (`numbisect.backends.vllm.child`): every child (a conditions
trial, the user's engine configuration, the live check's cold engine) answers through
`serve`, so a failed one hands its parent the same one line, whichever job it ran."""

from __future__ import annotations

import json

import pytest

from numbisect.backends.vllm import child
from numbisect.common.errors import BackendError


def test_a_failed_answer_is_one_line_in_out_err(tmp_path):
    (tmp_path / "in.json").write_text(json.dumps({"job": "x"}))
    out = tmp_path / "out"

    def answer(job, out_path):
        raise ValueError("1 validation error\nmodel: no such directory\nFor further information visit https://x")

    assert child.serve([str(tmp_path / "in.json"), str(out)], answer) == 1
    assert not out.exists()
    assert json.loads((tmp_path / "out.err").read_text()) == {"error": "ValueError: model: no such directory"}


def test_an_answer_is_written_by_the_job(tmp_path):
    (tmp_path / "in.json").write_text(json.dumps({"job": "x", "n": 2}))
    assert child.serve([str(tmp_path / "in.json"), str(tmp_path / "out")],
                       lambda job, p: child.write_json({"twice": job["n"] * 2}, p)) == 0
    assert json.loads((tmp_path / "out").read_text()) == {"twice": 4}
    assert not (tmp_path / "out.err").exists()


@pytest.mark.vllm
@pytest.mark.parametrize("module", ["numbisect.backends.vllm.condition_worker", "numbisect.backends.vllm.cold"])
def test_each_child_module_fails_in_one_line_through_the_runner(module, tmp_path):
    """The conditions worker and the cold oracle, on a checkpoint that is not there: the
    parent's BackendError carries the child's one line (the cold oracle's used to lose
    nothing but wrote its own main)."""
    job = {"job": "capture" if module.endswith("condition_worker") else "cold", "answer": "torch",
           "model": str(tmp_path / "missing"), "dtype": "bfloat16", "max_model_len": 64, "settings": {}, "shapes": {},
           "samples": [[1, 2, 3, 4, 5, 6]], "prompt_lens": [2]}
    with pytest.raises(BackendError) as e:
        child.run_child(job, "a job on a missing checkpoint", timeout=300, module=module)
    msg = e.value.message
    assert msg.startswith("a job on a missing checkpoint: the vLLM child process failed (") and "\n" not in msg, msg
    assert "exit status" not in msg, msg  # the child's own line, not only its exit status

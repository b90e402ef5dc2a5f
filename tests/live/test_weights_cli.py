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


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    """A checkpoint of a family numbisect does not know (a tiny Llama)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama")
    LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2)).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("side, message", [
    ("ref", "unsupported architecture LlamaForCausalLM; supported: DeepseekV3ForCausalLM"),
    ("engine", "unsupported architecture LlamaForCausalLM; supported: DeepseekV3ForCausalLM"),
    ("moe", "ref and engine architectures differ: qwen3 vs qwen3_moe"),
])
def test_a_model_numbisect_does_not_know_is_one_line_and_exit_2_before_anything_loads(side, message, llama_dir, capsys):
    """Refused from the configs alone: no engine started, no weights loaded (so no `vllm` mark)."""
    import time

    ref, eng = {"ref": (llama_dir, model_dir("qwen3")), "engine": (model_dir("qwen3"), llama_dir),
                "moe": (model_dir("qwen3"), model_dir("qwen3_moe"))}[side]
    t0 = time.perf_counter()
    code = main(["weights", "--ref", f"hf:{ref}", "--engine", f"vllm:{eng}", "-q"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("bisect: error: ") and message in err[0], err
    assert time.perf_counter() - t0 < 5  # an engine start alone takes longer


@pytest.mark.vllm
def test_a_converted_checkpoint_with_gate_and_up_swapped_is_named(tmp_path, capsys):
    from numbisect.report.document import load_report

    bad = damaged_copy("qwen3", tmp_path, swap_gate_up(2))
    out = tmp_path / "w\x1b[31m.json"  # an escape in the name: printed escaped (`report: ...`), never raw
    code = main(["weights", "--ref", f"hf:{model_dir('qwen3')}", "--engine", f"vllm:{bad}", "--out", str(out), "-q"])
    text = capsys.readouterr().out
    print(text)
    assert code == 1
    assert "\x1b" not in text and "report: " in text.splitlines()[-1]
    assert "layers.2.mlp             corrupted       gate_proj <-> up_proj swapped" in text
    report = load_report(out)  # validated against the schema
    assert report["kind"] == "weights" and not report["weights"]["ok"]
    assert [(u["unit"], u["status"]) for u in report["weights"]["units"] if u["status"] != "ok"] == [("layers.2.mlp", "corrupted")]
    assert json.dumps(report)  # plain JSON


@pytest.mark.vllm
def test_mlas_kv_b_proj_is_read_on_the_backend_the_engine_chose(tmp_path, capsys):
    """deepseek_v3's kv_b_proj (MLA's up-projection of the latent KV) converted with a scale:
    named at layers.1.attn whichever MLA backend vLLM-CPU chose (AMX_MLA on a CPU with AMX
    tiles empties the weight and multiplies by packed W_UK/W_UV: read back through them,
    numbisect.backends.vllm.cpu_mla; CPU_MLA keeps it); every other weight right."""
    from numbisect.backends.vllm.cpu_paths import cpu_flags

    def edit(w):
        key = "model.layers.1.self_attn.kv_b_proj.weight"
        w[key] = (w[key].float() * 2).to(w[key].dtype)

    bad = damaged_copy("deepseek_v3", tmp_path, edit)
    code = main(["weights", "--ref", f"hf:{model_dir('deepseek_v3')}", "--engine", f"vllm:{bad}", "-q"])
    text = capsys.readouterr().out
    print(text, cpu_flags())
    assert code == 1
    status = {ln.split()[0]: ln.split()[1] for ln in text.splitlines()[1:]}
    assert status.pop("layers.1.attn") == "corrupted", text
    assert "kv_b_proj.weight scaled by 2" in text
    # the rest is vLLM-CPU's rotary kernel on MLA (docs/measurements.md, DeepSeek-V3): every
    # weight right, the rope units (and the attention around them) computing otherwise
    assert set(status.values()) <= {"buffer"} and all(".attn" in u for u in status), text  # "buffer differs"
    assert {f"layers.{i}.attn.rope" for i in range(3)} <= set(status), text

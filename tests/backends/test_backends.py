"""Backends: token log-probs checked independently on each side, captures in canonical form."""

from __future__ import annotations

import pytest
import torch
from conftest import MODELS, hf, model_dir, trace_path, vllm

from numbisect.model.trace import load_trace


def samples(name, n=6):
    return load_trace(trace_path(name)).samples[:n]


@pytest.mark.parametrize("batch_size", [1, 4])
def test_hf_token_logprobs_match_a_plain_forward(batch_size):
    """Batched, right-padded log-probs equal one unpadded transformers forward per sample."""
    from transformers import AutoModelForCausalLM

    from numbisect.backends.hf import HFBackend

    b = HFBackend(model_dir("qwen3"), "float32", batch_size=batch_size)
    ss = samples("qwen3")
    res = b.forward(ss, full_logits=True)
    plain = AutoModelForCausalLM.from_pretrained(model_dir("qwen3"), dtype=torch.float32)
    for s, lp, full in zip(ss, res.token_logprobs, res.full_logprobs):
        ids = torch.tensor([s.ids])
        with torch.no_grad():
            logp = torch.log_softmax(plain(ids).logits[0].float(), -1)
        want = logp[:-1].gather(1, ids[0, 1:, None]).squeeze(1)
        assert lp.shape == (len(s.ids) - 1,)
        torch.testing.assert_close(lp, want, rtol=0, atol=2e-5)
        torch.testing.assert_close(full, logp[:-1], rtol=0, atol=2e-5)


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3"])
def test_hf_captures_every_unit_in_canonical_form(name):
    b = hf(name)
    ss = samples(name, 3)
    names = [u.name for u in b.units]
    res = b.forward(ss, capture=names, capture_inputs=names)
    hidden = b.config.hidden_size
    for u in b.units:
        outs = res.captures[u.name]
        assert len(outs) == len(ss), u.name
        for s, t in zip(ss, outs):
            T = len(s.ids)
            if u.kind == "lm_head":
                assert t.shape == (T - 1, b.vocab_size)
            elif u.kind == "router":
                assert t.shape == (T, b.config.num_experts)
            else:
                assert t.shape == (T, hidden), (u.name, t.shape)


@pytest.mark.vllm
@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3"])
def test_vllm_logprobs_match_vllms_own_prompt_logprobs(name):
    """The backend's log-probs equal a direct vLLM generate() with prompt_logprobs, and the
    log-softmax of the logits the capture hook saw."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    eng = vllm(name)
    ss = samples(name)
    res = eng.forward(ss, full_logits=True)
    sp = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False, temperature=0.0)
    outs = eng.llm.generate([TokensPrompt(prompt_token_ids=s.ids) for s in ss], sp, use_tqdm=False)
    for s, lp, full, out in zip(ss, res.token_logprobs, res.full_logprobs, outs):
        direct = torch.tensor([out.prompt_logprobs[t][s.ids[t]].logprob for t in range(1, len(s.ids))])
        torch.testing.assert_close(lp, direct, rtol=0, atol=1e-6)
        from_logits = full.gather(1, torch.tensor(s.ids[1:])[:, None]).squeeze(1)
        torch.testing.assert_close(from_logits, lp, rtol=0, atol=1e-4)


@pytest.mark.vllm
@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3"])
def test_vllm_and_hf_capture_the_same_units_with_matching_shapes(name):
    eng, ref = vllm(name), hf(name)
    ss = samples(name, 4)
    names = [u.name for u in eng.units]
    assert names == [u.name for u in ref.units]
    a = ref.forward(ss, capture=names)
    b = eng.forward(ss, capture=names)
    for n in names:
        assert len(b.captures[n]) == len(ss), n
        for x, y in zip(a.captures[n], b.captures[n]):
            assert x.shape == y.shape, (n, x.shape, y.shape)
            # Same weights, same input ids: every unit is close (bf16 noise), none is garbage.
            rel = (x.float() - y.float()).norm() / x.float().norm().clamp_min(1e-12)
            assert rel < 0.05, (n, float(rel))
    # The embedding lookup is exact on both sides.
    for x, y in zip(a.captures["embed"], b.captures["embed"]):
        assert torch.equal(x, y)


@pytest.mark.parametrize("name", MODELS)
def test_every_fixture_architecture_has_a_map(name):
    b = hf(name)
    assert b.arch.name == name
    for u in b.units:
        assert b.module(u.name) is not None


def test_an_unknown_backend_name_is_refused_naming_the_known_ones():
    from numbisect.backends import BACKENDS, open_backend
    from numbisect.common.errors import InputError

    with pytest.raises(InputError) as e:
        open_backend("sglang", model_dir("qwen3_moe"), "bfloat16", {})
    assert e.value.message == f"unknown backend 'sglang'; known: {', '.join(BACKENDS)}"
    assert set(BACKENDS) >= {"hf", "vllm"}

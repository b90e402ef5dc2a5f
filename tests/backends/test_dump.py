"""Offline dumps (`--engine dump:DIR`): written by a real vLLM engine, read back, merged, refused when broken."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from conftest import (
    ROOT,
    child_env,
    hf,
    model_dir,
    session,
    short_trace,
    trace_path,
    vllm,
)

from numbisect.backends.dump import write_dump
from numbisect.common.errors import InputError
from numbisect.model.trace import load_trace
from numbisect.patching.faults import apply_faults, parse_fault
from numbisect.pipeline.measure import Settings
from numbisect.session.session import Session, Spec

pytestmark = pytest.mark.usefixtures("one_thread")
N = 4
FAULT = "output_noise=1.0@layers.2.moe.experts"
_DUMPS: dict = {}


def dump_dir(tmp_path_factory, key: str) -> str:
    """A dump written by the shared vLLM engine on qwen3_moe (one per key per test session)."""
    if key not in _DUMPS:
        eng = vllm("qwen3_moe")
        trace = load_trace(short_trace("qwen3_moe", N))
        d = str(tmp_path_factory.mktemp(f"dump-{key}"))
        with apply_faults(eng, [parse_fault(FAULT)] if key == "fault" else []):  # undone on the way out
            if key == "tp2":
                write_dump(eng, trace, d, world_size=2, shards={"lm_head": "column", "layers.1.attn": "row", "layers.0.moe": "row"})
            else:
                write_dump(eng, trace, d, max_buffer_mb=0.5)
        _DUMPS[key] = d
    return _DUMPS[key]


def dump_session(d: str, samples: int = N) -> Session:

    spec = Spec(ref=f"hf:{model_dir('qwen3_moe')}", engine=f"dump:{d}", trace=short_trace("qwen3_moe", samples))
    return Session.open(spec, Settings(), backends={"ref": hf("qwen3_moe", "bfloat16")})


@pytest.mark.vllm
def test_dump_of_vllm_compares_like_vllm_itself(tmp_path_factory):
    d = dump_dir(tmp_path_factory, "plain")
    got = dump_session(d).compare()
    live = session("qwen3_moe", samples=N).compare()
    assert got["baseline"]["value"] == pytest.approx(live["baseline"]["value"], rel=1e-9)
    assert got["baseline"]["groups"]["completion"]["kl"]["mean"] == pytest.approx(live["baseline"]["groups"]["completion"]["kl"]["mean"], rel=1e-6)
    for a, b in zip(got["units"], live["units"]):
        assert a["propagated"]["rel_l2"] == pytest.approx(b["propagated"]["rel_l2"], rel=1e-9), a["name"]
        assert a["propagated"]["ulps"] == b["propagated"]["ulps"], a["name"]
    # local: the reference fed the dumped inputs; embed has no input, the rest are measured
    assert got["units"][0]["local"] is None
    assert all(r["local"] is not None for r in got["units"][1:])
    assert got["units"][1]["local"]["ulps"]["bitwise_equal"]  # an RMSNorm given the same input is bitwise equal (docs/design.md)
    assert got["first_divergence"]["bitwise"] == live["first_divergence"]["bitwise"]
    assert got.get("capture", {}).get("mode") == "stats"


@pytest.mark.vllm
def test_dump_local_error_names_the_planted_unit(tmp_path_factory):
    got = dump_session(dump_dir(tmp_path_factory, "fault")).compare()
    top = min(got["local_ranking"], key=got["local_ranking"].get)
    assert top in ("layers.2.moe.experts", "layers.2.moe")
    rows = {r["name"]: r for r in got["units"]}
    assert rows["layers.2.moe.experts"]["local"]["rel_l2"] > 0.5
    assert rows["layers.1.moe.experts"]["local"]["rel_l2"] < 0.05  # upstream units keep their own small error
    assert got["verdict"] == "diverged"


@pytest.mark.vllm
def test_tensor_parallel_shards_merge(tmp_path_factory):
    one = dump_session(dump_dir(tmp_path_factory, "plain")).compare()
    d2 = dump_dir(tmp_path_factory, "tp2")
    assert sorted(p.name for p in (ROOT.__class__(d2)).iterdir()) == ["manifest.json", "rank0", "rank1"]
    two = dump_session(d2).compare()
    assert two["baseline"]["value"] == one["baseline"]["value"]
    for a, b in zip(one["units"], two["units"]):
        for k in ("propagated", "local"):
            assert a[k] == b[k], (a["name"], k)


@pytest.mark.vllm
def test_broken_dumps_are_refused_naming_the_problem(tmp_path_factory, tmp_path):
    src = dump_dir(tmp_path_factory, "plain")

    def refused(mutate, needle, name):
        d = tmp_path / name
        shutil.copytree(src, d)
        mutate(d)
        with pytest.raises(InputError) as e:
            dump_session(str(d))
        assert needle in e.value.message, e.value.message

    # a crashed engine: no COMPLETE marker
    refused(lambda d: (d / "rank0" / "COMPLETE").unlink(), "dump is incomplete: rank 0 has no COMPLETE marker", "crash")

    def truncate(d):
        f = d / "rank0" / "layers.1.attn.0000.safetensors"
        f.write_bytes(f.read_bytes()[:-100])
    refused(truncate, "rank0/layers.1.attn.0000.safetensors is truncated", "trunc")

    def version(d):
        m = json.loads((d / "manifest.json").read_text())
        m["numbisect_dump"] = 7
        (d / "manifest.json").write_text(json.dumps(m))
    refused(version, "dump layout version 7 is unknown; this numbisect reads version 1", "version")

    def missing_unit(d):
        done = json.loads((d / "rank0" / "COMPLETE").read_text())
        for name in [n for n in done["files"] if n.startswith("layers.3.attn.")]:
            (d / "rank0" / name).unlink()
            del done["files"][name]
        (d / "rank0" / "COMPLETE").write_text(json.dumps(done))
    refused(missing_unit, "unit layers.3.attn is listed in the manifest but has no data (rank 0)", "missing")

    def shape(d):
        from safetensors.torch import load_file, save_file

        f = d / "rank0" / "layers.0.attn.0000.safetensors"
        t = load_file(str(f))
        t["out.0"] = t["out.0"][:, :64].contiguous()
        save_file(t, str(f))
        done = json.loads((d / "rank0" / "COMPLETE").read_text())
        done["files"][f.name]["bytes"] = f.stat().st_size
        (d / "rank0" / "COMPLETE").write_text(json.dumps(done))
    refused(shape, "layers.0.attn output of sample 0 has shape (", "shape")

    def unknown_unit(d):
        m = json.loads((d / "manifest.json").read_text())
        m["units"]["layers.9.atn"] = {"shard": "replicated"}
        (d / "manifest.json").write_text(json.dumps(m))
    refused(unknown_unit, "unknown unit 'layers.9.atn'", "unknown")

    # found by a review with damaged dumps: each was read (a wrong result) or crashed (exit 3)
    def rewrite(d, name, change):
        from safetensors.torch import load_file, save_file

        f = d / "rank0" / name
        t = load_file(str(f))
        change(t)
        save_file(t, str(f))
        done = json.loads((d / "rank0" / "COMPLETE").read_text())
        done["files"][f.name]["bytes"] = f.stat().st_size
        (d / "rank0" / "COMPLETE").write_text(json.dumps(done))

    lp_file = sorted(p.name for p in Path(src, "rank0").glob("logprobs.*"))[0]
    refused(lambda d: rewrite(d, lp_file, lambda t: t.update({"token.0": torch.cat([t["token.0"], t["token.0"][:1]])})),
            "token log-probs of sample 0 have shape (", "lp_shape")
    refused(lambda d: rewrite(d, "layers.0.attn.0000.safetensors", lambda t: t.update({"out.0": t["out.0"][:, None, :].contiguous()})),
            "layers.0.attn output of sample 0 has shape (", "rank3")
    refused(lambda d: rewrite(d, "layers.0.attn.0000.safetensors", lambda t: t.update({"out.0": t["out.0"].to(torch.int16)})),
            "tensor out.0 is I16; dumped activations and log-probs must be floats", "int")

    def manifest(key, value):
        def change(d):
            m = json.loads((d / "manifest.json").read_text())
            m[key] = value
            (d / "manifest.json").write_text(json.dumps(m))
        return change
    def holding(d, unit, key):
        from safetensors import safe_open

        for f in sorted((d / "rank0").glob(f"{unit}.*.safetensors")):
            with safe_open(str(f), framework="pt") as h:
                if key in h.keys():
                    return f.name
        raise AssertionError(f"no {key} for {unit}")

    refused(lambda d: rewrite(d, holding(d, "layers.0.attn", "in.2"), lambda t: t.pop("in.2")),
            "unit layers.0.attn has inputs for some samples but not for sample(s) 2", "in_gap")
    refused(manifest("world_size", "two"), 'world_size must be an integer >= 1, got "two"', "ws")
    refused(manifest("tokens", None), "tokens must list 4 token counts", "tokens")
    refused(manifest("units", ["layers.0.attn"]), "units must map each unit name", "units")
    refused(manifest("numbisect_dump", "1"), 'numbisect_dump must be an integer layout version, got "1"', "verstr")

    def files_list(d):
        done = json.loads((d / "rank0" / "COMPLETE").read_text())
        done["files"] = list(done["files"])
        (d / "rank0" / "COMPLETE").write_text(json.dumps(done))
    refused(files_list, '"files" must map each file name to {"bytes": n}', "files")

    # another trace (the full fixture trace has more samples)

    with pytest.raises(InputError) as e:
        Session.open(Spec(ref=f"hf:{model_dir('qwen3_moe')}", engine=f"dump:{src}", trace=trace_path("qwen3_moe")), Settings(),
                backends={"ref": hf("qwen3_moe", "bfloat16")})
    assert f"dump has {N} samples" in e.value.message

    # on the command line: one line, exit 2, and `run` is refused
    d = tmp_path / "crash"
    for argv in (["compare"], ["run"]):
        done = subprocess.run([sys.executable, "-m", "numbisect", *argv, "--ref", f"hf:{model_dir('qwen3_moe')}", "--engine",
                               f"dump:{d}", "--trace", short_trace("qwen3_moe", N), "-q"],
                              capture_output=True, text=True, env=child_env(), cwd=ROOT)
        assert done.returncode == 2, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert "cannot run swap trials" in done.stderr


@pytest.mark.vllm
def test_dump_writer_hooks_on_the_vllm_model(tmp_path_factory, tmp_path):
    """What an engine process does: numbisect.dump hooks on its own modules, one forward per sample."""
    from safetensors.torch import load_file

    from numbisect.dump import DumpWriter

    eng = vllm("qwen3_moe")
    trace = load_trace(short_trace("qwen3_moe", N))
    toks = [len(s.ids) for s in trace.samples]
    w = DumpWriter(tmp_path / "h", f"{model_dir('qwen3_moe')}/config.json", N, toks, dtype="bfloat16")
    layers = eng.model.model.layers
    w.hook(layers[1].self_attn, "layers.1.attn")
    w.hook(layers[2], "layers.2", output="sum", input="sum")
    w.hook(eng.model.logits_processor, "lm_head", input=None)
    for i, s in enumerate(trace.samples):
        w.begin(i)
        w.logprobs(i, eng.forward([s]).token_logprobs[0])
    w.close()
    ref = dump_dir(tmp_path_factory, "plain")
    for unit in ("layers.1.attn", "layers.2", "lm_head"):
        mine = load_file(str(tmp_path / "h" / "rank0" / f"{unit}.0000.safetensors"))
        theirs = {}
        for f in sorted((ROOT.__class__(ref) / "rank0").glob(f"{unit}.0*.safetensors")):
            theirs.update(load_file(str(f)))
        for i in range(N):
            assert torch.equal(mine[f"out.{i}"], theirs[f"out.{i}"]), (unit, i)
            if unit != "lm_head":
                assert torch.equal(mine[f"in.{i}"], theirs[f"in.{i}"]), (unit, i)
    got = dump_session(str(tmp_path / "h")).compare()
    rows = {r["name"]: r for r in got["units"]}
    assert rows["layers.1.attn"]["local"] is not None and rows["layers.0.attn"]["propagated"] is None


def test_dump_helper_imports_only_torch_and_safetensors():
    code = ("import sys, numbisect.dump; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'networkx', 'vllm', 'click', 'numpy_financial') "
            "or m in ('numbisect.model.arch', 'numbisect.model.units', 'numbisect.common.errors', 'numbisect.pipeline.measure')); print(bad)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env(), cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def _hf_tp2_dump(root) -> None:
    eng = hf("qwen3_moe", "bfloat16")
    write_dump(eng, load_trace(short_trace("qwen3_moe", 2)), str(root), world_size=2,
               shards={"lm_head": "column", "layers.1.attn": "row"})


def test_a_stale_rank_from_an_earlier_run_is_refused(tmp_path):
    """Rank 1's directory left by an earlier dump, rank 0 rewritten: never merged."""
    _hf_tp2_dump(tmp_path / "d")
    spec = Spec(ref=f"hf:{model_dir('qwen3_moe')}", engine=f"dump:{tmp_path / 'd'}", trace=short_trace("qwen3_moe", 2))
    Session.open(spec, Settings(), backends={"ref": hf("qwen3_moe", "bfloat16")})  # as written: fine
    marker = tmp_path / "d" / "rank1" / "COMPLETE"
    done = json.loads(marker.read_text())
    rank0 = json.loads((tmp_path / "d" / "rank0" / "COMPLETE").read_text())
    done["started"], done["finished"] = rank0["started"] - 100, rank0["started"] - 50
    marker.write_text(json.dumps(done))
    with pytest.raises(InputError, match="rank1 finished writing before rank0 started: the ranks are from different runs"):
        Session.open(spec, Settings(), backends={"ref": hf("qwen3_moe", "bfloat16")})


def test_ranks_writing_one_dump_at_once_do_not_trip_over_the_shared_manifest(tmp_path):
    """Every rank writes manifest.json; each through a temporary file of its own."""
    from numbisect.dump import DumpWriter

    cfg = f"{model_dir('qwen3_moe')}/config.json"
    errors = []

    def rank(r):
        try:
            for _ in range(20):
                w = DumpWriter(tmp_path / "d", cfg, 1, [5], rank=r, world_size=2)
                w.declare("layers.0.attn", "row")
                w.add("layers.0.attn", 0, out=torch.zeros(5, 128))
                w.logprobs(0, torch.zeros(4))
                w.close()
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(repr(e))

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert all((tmp_path / "d" / f"rank{r}" / "COMPLETE").is_file() for r in (0, 1))
    assert not list((tmp_path / "d").glob("*.tmp"))


def test_a_multimodal_engines_dump_holds_its_vision_units_for_the_samples_with_images(tmp_path):
    """Vision units run only for samples with images: the dump writes them for those, the
    reader asks them for exactly those, and the compare measures them there."""
    trace = load_trace(trace_path("qwen3_vl_moe"))
    with_images = [i for i, s in enumerate(trace.samples) if s.images is not None]
    assert 0 < len(with_images) < len(trace.samples)
    d = str(tmp_path / "dump")
    write_dump(hf("qwen3_vl_moe", "float32"), trace, d)
    spec = Spec(ref=f"hf:{model_dir('qwen3_vl_moe')}", engine=f"dump:{d}", trace=trace_path("qwen3_vl_moe"),
                ref_dtype="float32", engine_dtype="float32")
    s = Session.open(spec, Settings(), backends={"ref": hf("qwen3_vl_moe", "float32")})
    body = s.compare()
    assert body["baseline"]["value"] == 0.0  # the reference against its own dump
    vision = {r["name"]: r for r in body["units"] if r["kind"] in ("vision", "projector")}
    assert vision and all(r["propagated"]["rel_l2"] == 0.0 and r["local"]["rel_l2"] == 0.0 for r in vision.values())
    # the same tokens without images (what a writer that records no trace digest could be
    # given) are refused, naming the unit
    text_only = tmp_path / "text.jsonl"
    text_only.write_text("".join(json.dumps({"prompt_ids": s.prompt_ids, "completion_ids": s.completion_ids}) + "\n"
                                 for s in trace.samples))
    from numbisect.backends.dump import DumpBackend

    eng = DumpBackend(d)
    with pytest.raises(InputError, match=r"unit vision(\.projector)? has data for sample\(s\) .*which have no images"):
        eng._check_vision(load_trace(str(text_only)))

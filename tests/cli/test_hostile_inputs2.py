"""Hostile input on the newer paths (issue 29, items 1-5): a child Python that would import
from the working directory, a resume log made on other samples, a --log that is not a
trial log, engine settings vLLM refuses, configuration files nested too deeply, and a
sharded checkpoint whose index and files disagree.

Every refusal is exit 2 with one line on stderr naming the file (or option) and the
key, and it comes before any model loads: the fixtures `no_model_loads` and `no_child`
fail the test when a model or a vLLM child would start.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import model_dir, short_trace, trace_path

from numbisect.cli import main

QWEN3 = model_dir("qwen3")
MOE = model_dir("qwen3_moe")
TRACE = trace_path("qwen3")


def cli(args: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(args)
    return rc, out.getvalue(), err.getvalue()


def one_line(rc: int, err: str, code: int = 2) -> str:
    """The single `bisect: error:` line of a refusal (exit `code`, no traceback)."""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == code, err
    assert len(lines) == 1 and lines[0].startswith("bisect: error: "), err
    assert "Traceback" not in err and "internal error" not in err
    return lines[0]


@pytest.fixture
def no_model_loads(monkeypatch):
    """A model load or a vLLM child fails the test: the refusals here come before both."""
    from numbisect.backends import hf
    from numbisect.backends.vllm import child
    from numbisect.tui import live

    def refuse(*a, **k):
        raise AssertionError("a model was loaded (or a vLLM child started) before the input was checked")

    monkeypatch.setattr(hf.HFBackend, "__init__", refuse)
    monkeypatch.setattr(child, "run_child", refuse)
    monkeypatch.setattr(live, "check_live", refuse)  # the TUI's live run would start its app (and wait for keys)


# -- 1. a child Python imports nothing from the working directory -----------------------------
HOSTILE = "import pathlib\npathlib.Path({marker!r}).write_text('ran')\nraise SystemExit('hostile module ran')\n"


@pytest.fixture
def hostile_cwd(tmp_path, monkeypatch):
    """The working directory holds `json.py`, `torch.py` and a `numbisect` package that each
    write a marker when imported (next to a checkpoint, say). Yields the marker's path."""
    marker = tmp_path / "MARKER"
    cwd = tmp_path / "cwd"
    (cwd / "numbisect").mkdir(parents=True)
    for f in ("json.py", "torch.py", "socket.py", "numbisect/__init__.py"):
        (cwd / f).write_text(HOSTILE.format(marker=str(marker)))
    monkeypatch.chdir(cwd)
    return marker


def test_the_vllm_child_imports_nothing_from_the_working_directory(hostile_cwd):
    """`run_child` is how every vLLM child starts (conditions, compare/run --engine-config).
    A job that fails right after the child's imports (torch's included) keeps this test
    fast; before the fix the child ran the working directory's json.py (and numbisect) first."""
    from numbisect.backends.vllm.child import run_child
    from numbisect.common.errors import BackendError

    with pytest.raises(BackendError) as e:  # a capture job imports torch first, then fails on the settings
        run_child({"job": "capture", "settings": "not an object"}, "a job with bad settings")
    assert "AttributeError" in e.value.message, e.value.message  # the child's own code ran, and failed on the job
    assert not hostile_cwd.exists(), "the child imported a module from the working directory"


def test_what_the_child_starts_imports_nothing_from_the_working_directory_either(hostile_cwd):
    """vLLM's worker processes start as `python -c ...`, which would put the working
    directory first: the child's environment (inherited by them) forbids it."""
    from numbisect.backends.vllm.child import safe_child_env

    rc = subprocess.run([sys.executable, "-c", "import json, socket"], env=safe_child_env(),
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
    assert rc == 0 and not hostile_cwd.exists()


# -- 2. --resume checks the samples; --log never truncates a file that is not a log -----------
def run_args(trace: str, *extra: str) -> list[str]:
    return ["run", "--ref", f"hf:{MOE}", "--engine", f"hf:{MOE}", "--ref-dtype", "float32", "--engine-dtype", "float32",
            "--trace", trace, "--engine-fault", "moe_combine_bf16@layers.2.moe", "--threshold", "1e-10",
            "--strategy", "linear", "--no-whatif", "-q", "--threads", "1", *extra]


def test_resume_on_other_samples_of_the_same_trace_is_refused(tmp_path):
    """A trace file holding two sets of samples (prompt_ids/completion_ids and p2/c2): a
    log made on the first is not resumed on the second (its trials are not this run's)."""
    lines = [json.loads(x) for x in Path(trace_path("qwen3_moe")).read_text().splitlines()[:4]]
    rows = [{"prompt_ids": a["prompt_ids"], "completion_ids": a["completion_ids"],
             "p2": b["prompt_ids"], "c2": b["completion_ids"]} for a, b in zip(lines[:2], lines[2:])]
    trace = tmp_path / "two.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    log = tmp_path / "L.jsonl"
    rc, _, err = cli(run_args(str(trace), "--log", str(log), "--max-trials", "2"))
    assert rc == 4, err
    before = log.read_bytes()
    rc, _, err = cli(run_args(str(trace), "--resume", str(log), "--trace-fields", "prompt=p2,completion=c2"))
    line = one_line(rc, err)
    assert str(log) in line and "other samples" in line, line
    assert log.read_bytes() == before
    # the log's own samples: resumed (the digest is the same from run to run)
    rc, _, err = cli(run_args(str(trace), "--resume", str(log), "--max-trials", "3"))
    assert rc == 4, err


@pytest.mark.parametrize("content", [b"my notes, one line\n", b"no newline at all", b"{\"a\": 1}\n"],
                         ids=["one-line", "no-newline", "json-object"])
def test_a_log_that_is_no_trial_log_is_never_truncated(tmp_path, content, no_model_loads):
    log = tmp_path / "notes.txt"
    log.write_bytes(content)
    rc, _, err = cli(run_args(short_trace("qwen3_moe", 2), "--log", str(log)))
    line = one_line(rc, err)
    assert "is not a numbisect trial log" in line and str(log) in line, line
    assert log.read_bytes() == content


def test_the_log_check_holds_under_the_lock_too(tmp_path):
    """`TrialLog` checks again once it holds the file (a file written after the first check)."""
    from numbisect.commands.run import TrialLog
    from numbisect.common.errors import InputError

    log = tmp_path / "late.txt"
    log.write_bytes(b"written after the check\n")
    with pytest.raises(InputError, match="not a numbisect trial log"):
        TrialLog(str(log), session=None)
    assert log.read_bytes() == b"written after the check\n"


# -- 3. engine settings vLLM refuses: one line naming the file and the key, before any load ---
def conditions_args(cfg: Path | None, *extra: str) -> list[str]:
    return ["conditions", "--ref", f"hf:{QWEN3}", "--engine", f"vllm:{QWEN3}", "--trace", TRACE, "-q",
            *(["--engine-config", str(cfg)] if cfg else []), *extra]


def compare_args(cfg: Path, *extra: str) -> list[str]:
    return ["compare", "--ref", f"hf:{QWEN3}", "--engine", f"vllm:{QWEN3}", "--trace", TRACE, "-q",
            "--engine-config", str(cfg), *extra]


TP = 64 if (os.cpu_count() or 1) < 64 else 4 * os.cpu_count()  # more workers than this machine has cores
REFUSED = [  # (file name, content, key the line names, words of vLLM's reason)
    ("t.json", '{"sampling": {"temperature": -1}}', "sampling.temperature", "non-negative"),
    ("nan.json", '{"sampling": {"temperature": NaN}}', "sampling.temperature", "finite"),
    ("inf.json", '{"sampling": {"temperature": Infinity}}', "sampling.temperature", "finite"),
    ("nan.toml", "[sampling]\ntemperature = nan\n", "sampling.temperature", "finite"),
    ("p.json", '{"sampling": {"top_p": 2}}', "sampling.top_p", "(0, 1]"),
    ("k.json", '{"sampling": {"top_k": 2.5}}', "sampling.top_k", "integer"),
    ("cc.json", '{"compilation_config": {"no_such_key": 1}}', "compilation_config.no_such_key", "unknown key"),
    ("tp.json", f'{{"tensor_parallel_size": {TP}}}', "tensor_parallel_size", f"{TP} cores"),
]


@pytest.mark.parametrize("name,content,key,words", REFUSED, ids=[c[0] for c in REFUSED])
@pytest.mark.parametrize("command", ["conditions", "compare"])
def test_engine_settings_vllm_refuses_are_one_line_before_any_model_loads(tmp_path, name, content, key, words, command,
                                                                          no_model_loads):
    cfg = tmp_path / name
    cfg.write_text(content)
    rc, _, err = cli((conditions_args if command == "conditions" else compare_args)(cfg))
    line = one_line(rc, err)
    assert f"--engine-config {cfg}: {key}:" in line and words in line, line


def test_tensor_parallel_64_as_conditions_engine_opt_is_refused_up_front(no_model_loads):
    rc, _, err = cli(conditions_args(None, "--engine-opt", f"tensor_parallel_size={TP}"))
    line = one_line(rc, err)
    assert f"--engine-opt: tensor_parallel_size: {TP} needs {TP} cores" in line, line


def test_a_good_config_vllm_refuses_names_the_good_config(tmp_path, no_model_loads):
    good = tmp_path / "good.json"
    good.write_text('{"enforce_eager": true, "sampling": {"top_p": 0}}')
    rc, _, err = cli(conditions_args(None, "--good-config", str(good)))
    assert f"--good-config {good}: sampling.top_p:" in one_line(rc, err)


# -- 4. configuration files nested too deeply: one line, exit 2 (never RecursionError) ---------
def nested(levels: int, toml: bool) -> str:
    if toml:
        return "a = " + "[" * levels + "]" * levels + "\n"
    return '{"hf_overrides": ' + "[" * (levels - 1) + "]" * (levels - 1) + "}"


def command_args(command: str, opt: str, path: Path) -> list[str]:
    if command == "conditions":
        return conditions_args(None, opt, str(path))
    base = [command, "--ref", f"hf:{QWEN3}", "--engine", f"vllm:{QWEN3}", "--trace", TRACE, opt, str(path)]
    return base + (["-q"] if command != "tui" else [])


DEEP = [(c, "--engine-config") for c in ("conditions", "compare", "run", "tui")] + [("conditions", "--good-config")]


@pytest.mark.parametrize("levels", [100_000, 70])
@pytest.mark.parametrize("fmt", ["json", "toml"])
@pytest.mark.parametrize("command,opt", DEEP, ids=[f"{c}{o}" for c, o in DEEP])
def test_a_deeply_nested_configuration_is_one_line(tmp_path, command, opt, fmt, levels, no_model_loads):
    path = tmp_path / f"deep.{fmt}"
    path.write_text(nested(levels, fmt == "toml"))
    rc, _, err = cli(command_args(command, opt, path))
    line = one_line(rc, err)
    assert f"{opt} {path}: nested deeper than" in line, line


def test_a_configuration_the_reader_accepts_fits_in_a_report():
    """The report keeps a copy of the settings (inputs.engine.options, 4 levels down): the
    deepest settings file the reader accepts stays within what the report tools read."""
    from numbisect.common.safeio import depth_over
    from numbisect.model import engine_config as E
    from numbisect.report.document import MAX_DEPTH as REPORT_DEPTH

    settings = {"hf_overrides": {}}
    d = settings["hf_overrides"]
    for _ in range(E.MAX_DEPTH - 2):
        d["x"] = {}
        d = d["x"]
    assert not depth_over(settings, E.MAX_DEPTH) and depth_over({"y": settings}, E.MAX_DEPTH)
    report = {"inputs": {"engine": {"options": settings}}}
    assert not depth_over({"wrapped": {"again": report}}, REPORT_DEPTH)


@pytest.mark.parametrize("content,says", [
    ("\ufeff{\"enforce_eager\": true}".encode("utf-16"), "UTF-16"),
    (b"\xff\xfe\x00{", "UTF-16"),
    (b"{\"enforce_eager\": \xe9}", "not UTF-8"),
], ids=["utf16", "utf16-bom-only", "latin1"])
def test_a_configuration_in_another_encoding_is_one_line(tmp_path, content, says, no_model_loads):
    path = tmp_path / "c.json"
    path.write_bytes(content)
    rc, _, err = cli(conditions_args(path))
    line = one_line(rc, err)
    assert f"--engine-config {path}: " in line and says in line, line


def test_a_bom_is_read_as_utf8(tmp_path):
    from numbisect.model.engine_config import load_settings

    path = tmp_path / "bom.json"
    path.write_bytes(b"\xef\xbb\xbf{\"enforce_eager\": true}")
    assert load_settings(str(path)) == {"enforce_eager": True}


# -- 5. the checkpoint diff reads a sharded checkpoint as the loader does ----------------------
KEY = "model.layers.0.self_attn.q_proj.weight"
S1, S2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"


def sharded(tmp_path: Path, copy_in: str) -> str:
    """A copy of the qwen3 fixture in two shards with an index naming S1 for layer 0's
    q_proj; a copy of it scaled by 2 in file `copy_in` too (S2, named by the index for
    other tensors, or a stray file the index does not name). Both sort after S1."""
    from safetensors.torch import load_file, save_file

    out = tmp_path / "sharded"
    out.mkdir()
    for f in ("config.json", "generation_config.json"):
        shutil.copy(Path(QWEN3) / f, out / f)
    w = load_file(Path(QWEN3) / "model.safetensors")
    names = sorted(w)
    first, second = names[: len(names) // 2], names[len(names) // 2:]
    assert KEY in first
    shards = {S1: {k: w[k] for k in first}, S2: {k: w[k] for k in second}}
    shards.setdefault(copy_in, {})[KEY] = w[KEY] * 2
    for name, tensors in shards.items():
        save_file(tensors, out / name, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {**{k: S1 for k in first}, **{k: S2 for k in second}}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return str(out)


def loaded_q_proj(path: str):
    """What transformers loads for layer 0's q_proj: the ground truth of what a loader reads."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()[KEY]


def ckpt_diff(eng: str) -> dict:
    from numbisect.backends.base import check_checkpoint, load_config
    from numbisect.model.ckptdiff import diff_checkpoints

    return diff_checkpoints(QWEN3, eng, check_checkpoint(QWEN3), check_checkpoint(eng), load_config(QWEN3))


def test_a_stray_shard_the_index_does_not_name_is_not_read(tmp_path):
    """The issue's case: the loader reads the index's shards only, so the engine has no
    difference; before the fix the diff read every *.safetensors and said "scaled by 2"."""
    import torch

    eng = sharded(tmp_path, "model-copy.safetensors")
    assert torch.equal(loaded_q_proj(eng), loaded_q_proj(QWEN3))
    d = ckpt_diff(eng)
    assert d["units"] == {} and d["identical"], d["units"]
    notes = [n["note"] for n in d.get("index", []) if n["checkpoint"] == "engine"]
    assert notes == ["model-copy.safetensors is not named by model.safetensors.index.json: the loader does not read it"]


def test_a_copy_in_another_indexed_shard_is_read_as_the_loader_reads_it_and_named(tmp_path):
    """Two shards the index names both hold the tensor: the loader writes the later one
    last (measured here with transformers); the diff reads that copy and says the index
    names another."""
    import torch

    eng = sharded(tmp_path, S2)
    assert torch.equal(loaded_q_proj(eng), 2 * loaded_q_proj(QWEN3))
    d = ckpt_diff(eng)
    assert "q_proj.weight scaled by 2" in d["units"]["layers.0.attn"]["summary"]
    notes = [n["note"] for n in d.get("index", []) if n["checkpoint"] == "engine"]
    assert notes == [f"model.safetensors.index.json names shard {S1} for {KEY}, but the loader reads the copy in {S2} "
                     "(later in name order)"]


def test_an_index_naming_a_missing_shard_says_so(tmp_path):
    eng = sharded(tmp_path, "model-copy.safetensors")
    index_path = Path(eng) / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["lm_head.extra"] = "model-00003-of-00003.safetensors"
    index_path.write_text(json.dumps(index))
    notes = " | ".join(n["note"] for n in ckpt_diff(eng)["index"])
    assert "names shard model-00003-of-00003.safetensors, and there is no such file" in notes
    assert "names shard model-00003-of-00003.safetensors for lm_head.extra, which no shard holds" in notes


def test_an_index_that_is_no_json_object_is_one_line(tmp_path):
    from numbisect.common.errors import InputError
    from numbisect.model.ckptdiff import _Checkpoint

    eng = sharded(tmp_path, S2)
    (Path(eng) / "model.safetensors.index.json").write_text("[" * 100_000)
    with pytest.raises(InputError, match="checkpoint index .*nested deeper than"):
        _Checkpoint(eng, {})


# -- 6. one way in ------------------------------------------------------------------------------
@pytest.mark.parametrize("make,says", [
    (lambda p: p.mkdir(), "is a directory"),
    (lambda p: os.mkfifo(p), "is a FIFO"),
    (lambda p: p.symlink_to("/dev/zero"), "is a character device"),
    (lambda p: p.symlink_to(p), "cannot read"),
], ids=["directory", "fifo", "dev-zero", "link-loop"])
def test_the_one_reader_refuses_what_is_no_file_in_one_shape(tmp_path, make, says):
    from numbisect.common.errors import InputError
    from numbisect.common.safeio import read_input

    p = tmp_path / "in.json"
    make(p)
    with pytest.raises(InputError) as e:
        read_input(p, "--floor")
    assert "--floor" in e.value.message and str(p) in e.value.message and says in e.value.message, e.value.message

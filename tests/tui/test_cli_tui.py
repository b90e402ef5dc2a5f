"""`bisect tui` on the command line: bad input is one line and exit 2 before the app
starts; good input builds the app (its `run` is replaced here, so nothing draws)."""

from __future__ import annotations

import json

import pytest

from numbisect.cli import main
from numbisect.common.errors import ExitCode
from tui.support import REPORT, read

LIVE = ["--ref", "hf:fixtures/models/qwen3_moe", "--engine", "hf:fixtures/models/qwen3_moe",
        "--trace", "fixtures/traces/qwen3_moe.jsonl"]


@pytest.fixture
def started(monkeypatch):
    """Record the apps the CLI would run instead of running them."""
    from numbisect.tui.app import BisectApp

    apps = []
    monkeypatch.setattr(BisectApp, "run", lambda self, *a, **k: apps.append(self))
    return apps


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("bisect: error: ")
    return lines[0]


@pytest.mark.parametrize(
    "content,needle",
    [
        ("{ corrupt", "not valid JSON"),
        ("unknown-version", "schema version 2 is not supported"),
        ('{"schema_version": 1}', "not a valid v1 report"),
    ],
)
def test_bad_report_is_a_one_line_error_before_the_app_starts(tmp_path, capsys, started, content, needle):
    bad = tmp_path / "bad.json"
    if content == "unknown-version":
        r = read(REPORT)
        r["schema_version"] = 2
        content = json.dumps(r)
    bad.write_text(content)
    assert main(["tui", str(bad)]) == ExitCode.USAGE
    assert needle in one_line_error(capsys)
    assert started == []


def test_missing_report_file(capsys, started):
    assert main(["tui", "no/such/report.json"]) == ExitCode.USAGE
    assert "report not found" in one_line_error(capsys)


@pytest.mark.parametrize(
    "args,needle",
    [
        ([], "needs REPORT.json, or --ref, --engine and --trace"),
        (["--ref", "hf:x"], "needs REPORT.json, or --ref, --engine and --trace"),
        ([REPORT, *LIVE], "not both"),
        (["--ref", "hf:fixtures/models/qwen3_moe", "--engine", "rollout", "--trace", "fixtures/traces/qwen3_moe.jsonl"], "not rollout"),
        ([*LIVE, "--engine-fault", "nonsense"], "bad fault spec"),
        ([*LIVE, "--max-trials", "0"], "--max-trials must be at least 1"),
        ([*LIVE, "--group", "nope"], "unknown group 'nope'"),
        (["--ref", "hf:fixtures/models/qwen3_moe", "--engine", "vllm:fixtures/models/qwen3_moe", "--trace", "fixtures/traces/qwen3_moe.jsonl",
          "--engine-mode", "decode", "--engine-opt", "tensor_parallel_size=2"], "does not run under tensor parallelism"),
        (["--ref", "hf:fixtures/models/qwen3_moe", "--engine", "dump:/nowhere", "--trace", "fixtures/traces/qwen3_moe.jsonl",
          "--engine-mode", "decode"], "decode"),
        (["--ref", "hf:fixtures/models/qwen3_moe", "--engine", "hf:fixtures/models/qwen3_moe", "--trace", "no/trace.jsonl"], "no/trace.jsonl"),
    ],
)
def test_bad_live_options_are_one_line_errors(capsys, started, args, needle):
    assert main(["tui", *args]) == ExitCode.USAGE
    assert needle in one_line_error(capsys)
    assert started == []


def test_a_report_opens_the_explorer(started):
    assert main(["tui", REPORT]) == ExitCode.ALIGNED
    (app,) = started
    assert app.live is None and app.report["kind"] == "run" and app.report_path == REPORT


def test_live_options_make_a_live_app_that_records_the_equivalent_run_command(started, monkeypatch):
    argv = ["bisect", "tui", *LIVE, "--engine-fault", "moe_combine_bf16@layers.2.moe", "--threshold", "1e-10",
            "--strategy", "ddmin", "--max-trials", "12"]
    monkeypatch.setattr("sys.argv", ["pytest"])  # the command comes from main's argv
    assert main(argv[1:]) == ExitCode.ALIGNED
    (app,) = started
    cfg = app.live
    assert cfg.argv == ["bisect", "run", *argv[2:]]
    assert (cfg.strategy, cfg.max_trials, cfg.settings.threshold) == ("ddmin", 12, 1e-10)
    assert cfg.spec.faults == ["moe_combine_bf16@layers.2.moe"]


def test_live_mode_takes_the_engine_mode_groups_and_rollout_dump_fields(started, monkeypatch):
    argv = ["bisect", "tui", *LIVE, "--engine-mode", "decode", "--group-def", "digits=10,11", "--group", "digits",
            "--trace-format", "numbisect"]
    monkeypatch.setattr("sys.argv", ["pytest"])
    assert main(argv[1:]) == ExitCode.ALIGNED
    (app,) = started
    cfg = app.live
    assert cfg.spec.engine_mode == "decode" and cfg.spec.group_defs == ["digits=10,11"]
    assert cfg.spec.trace_format == "numbisect" and cfg.settings.group == "digits"
    assert cfg.argv == ["bisect", "run", *argv[2:]]


def test_help_lists_tui(capsys):
    main(["--help"])
    assert "tui" in capsys.readouterr().out
    main(["tui", "--help"])
    out = capsys.readouterr().out
    assert "REPORT.json" in out and "--engine-fault" in out and "--strategy" in out


VLLM_LIVE = ["--ref", "hf:fixtures/models/qwen3_moe", "--engine", "vllm:fixtures/models/qwen3_moe",
             "--trace", "fixtures/traces/qwen3_moe.jsonl"]


@pytest.mark.parametrize("settings", ['{"enforce_eager": true, "enable_prefix_caching": false}',
                                      'enforce_eager = false\nbatch = "all"\n'], ids=["json-hookable", "toml-child"])
def test_live_mode_takes_the_engine_config_into_the_session_and_the_run_command(started, monkeypatch, tmp_path, settings):
    """The settings file reaches the session as `bisect run --engine-config` gives it (the
    session derives both configurations from it), and the recorded command is that run's."""
    from numbisect.model import engine_config as E

    mine = tmp_path / ("mine.json" if settings.startswith("{") else "mine.toml")
    mine.write_text(settings)
    argv = ["bisect", "tui", *VLLM_LIVE, "--engine-config", str(mine), "--engine-opt", "max_num_seqs=4"]
    monkeypatch.setattr("sys.argv", ["pytest"])
    assert main(argv[1:]) == ExitCode.ALIGNED
    (app,) = started
    cfg = app.live
    assert cfg.argv == ["bisect", "run", *argv[2:]]
    assert cfg.spec.engine_config == {**E.load_settings(str(mine)), "max_num_seqs": 4}  # --engine-opt on top
    assert cfg.spec.engine_config_path == str(mine)
    assert f"settings   {mine} (--engine-config" in app._live_intro()


@pytest.mark.parametrize("text,engine,extra,needle", [
    ("{not json", "vllm", [], "--engine-config {p}: not JSON"),
    ('{"batch": 3}', "vllm", [], '--engine-config {p}: batch must be 1 or "all" (got 3)'),
    ('{"trust_remote_code": true}', "vllm", [], "trust_remote_code is refused"),
    (None, "vllm", [], "--engine-config not found: {p}"),
    ('{"enforce_eager": true}', "hf", [], "--engine-config needs --engine vllm:DIR"),
    ('{"batch": "all", "logprobs_mode": "processed_logprobs"}', "vllm", ["--engine-mode", "decode"],
     "--engine-mode decode with --engine-config needs logprobs_mode \"raw_logprobs\" (yours: 'processed_logprobs')"),
    ('{"tensor_parallel_size": 2}', "vllm", ["--engine-mode", "decode"],
     "--engine-mode decode does not run under tensor parallelism yet (tensor_parallel_size=2)"),
], ids=["not-json", "bad-value", "remote-code", "missing-file", "hf-engine", "decode-processed", "decode-tp"])
def test_bad_engine_config_is_one_line_before_the_live_app_starts(capsys, started, tmp_path, text, engine, extra, needle):
    """The refusals of `bisect run --engine-config`, before the app starts (the last two
    are the session's own checks, run before the app, not in its worker)."""
    p = tmp_path / "mine.json"
    if text is not None:
        p.write_text(text)
    args = ["--ref", "hf:fixtures/models/qwen3_moe", "--engine", f"{engine}:fixtures/models/qwen3_moe",
            "--trace", "fixtures/traces/qwen3_moe.jsonl"]
    assert main(["tui", *args, "--engine-config", str(p), *extra]) == ExitCode.USAGE
    assert needle.format(p=p) in one_line_error(capsys)
    assert started == []


def test_engine_config_with_a_report_is_refused_not_ignored(capsys, started, tmp_path):
    p = tmp_path / "mine.json"
    p.write_text('{"enforce_eager": true}')
    assert main(["tui", REPORT, "--engine-config", str(p)]) == ExitCode.USAGE
    assert "--engine-config is for a live run" in one_line_error(capsys)
    assert started == []

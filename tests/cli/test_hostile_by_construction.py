"""Every option that takes a path, by construction, against the standard hostile set.

The options are not listed here: `path_params()` walks the click CLI (`numbisect.cli.cli`,
its groups and commands) and takes every parameter whose type is `click.Path`, or whose
name or metavar says it names a file or directory (file, dir, out, log, trace, config,
floor, resume, report, ...; FILE, DIR, SPEC). An option added tomorrow is in tomorrow's
hostile run; a command with no base command line here fails `test_every_command_has_a_base`,
and a path-like option that is none of these must be listed in NOT_PATHS with why.

Each option gets each kind of HOSTILE path in place of a good one, the rest of its command
line the smallest good one on the tiny fixtures. What must hold, per case:

- never exit 3 (an internal or backend error) and never a traceback;
- a refusal is exactly one line on stderr ("bisect: error: ..."), exit 2;
- no unescaped control byte (ESC, BEL, a line break inside a line, ...) in any output;
- the inputs are left as they were (bytes), nothing hangs (a 20 s alarm per case).

No model ever loads: a case the tool accepts reaches the point where a backend would
open (`Registered.loader`), a vLLM child would start (`run_child`) or the TUI would run
(`BisectApp.run`), which stop it as "accepted" (an input the tool may legitimately take,
such as a trace with a BOM). Everything runs in this process, one case after another.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import tempfile
from pathlib import Path

import click
import pytest
from conftest import FIXTURES, model_dir, run_cli_case, synthetic_bundle, trace_path

from numbisect.cli import cli

MODEL = model_dir("qwen3_moe")
TRACE = trace_path("qwen3_moe")
REPORT = str(FIXTURES / "reports" / "qwen3_moe_planted_fault.json")
# A replay bundle the replay takes (written by hand, no engine: conftest.synthetic_bundle); its
# own files against the hostile set: tests/live/test_bundle_hostile.py.
_BUNDLE_DIR = tempfile.mkdtemp(prefix="numbisect-bundle-")
atexit.register(shutil.rmtree, _BUNDLE_DIR, True)
BUNDLE = synthetic_bundle(Path(_BUNDLE_DIR) / "bundle")

# What names a path: a parameter's name (words joined by _) or its metavar.
PATH_NAME = re.compile(r"(^|_)(file|dir|out|log|trace|config|floor|resume|report|path|before|after|ref|engine)($|_)")
PATH_METAVAR = re.compile(r"FILE|DIR|PATH|SPEC|\.json")
# Parameters whose name says "path" but that take none, and why.
NOT_PATHS = {
    "trace_fields": "ROLE=FIELD,... : field names inside the trace",
    "trace_format": "a choice of field-name conventions",
    "ref_dtype": "a dtype", "engine_dtype": "a dtype",
    "ref_opt": "KEY=VALUE backend options", "engine_opt": "KEY=VALUE backend options",
    "engine_fault": "a fault spec", "engine_mode": "prefill or decode",
}
# A spec option takes KIND:DIR; the hostile path goes after the kind its base gives.
SPEC_OPTIONS = {"ref", "engine"}

# `report plot`'s figure, written by the good cases of its REPORT (by default it goes beside the
# report, a name the user's REPORT gives: those cases name one instead).
PLOT_OUT = os.path.join(tempfile.mkdtemp(prefix="numbisect-hostile-plot-"), "figure.png")
ARG_COMPANIONS = {("report plot", "file"): ["--out", PLOT_OUT]}
# The smallest good command line of each command (a path option's good value is replaced
# by the hostile one). Keys are the command's path in the CLI.
BASE = {
    "run": ["--ref", f"hf:{MODEL}", "--engine", f"hf:{MODEL}", "--trace", TRACE, "-q"],
    "compare": ["--ref", f"hf:{MODEL}", "--engine", f"hf:{MODEL}", "--trace", TRACE, "-q"],
    "conditions": ["--ref", f"hf:{MODEL}", "--engine", f"vllm:{MODEL}", "--trace", TRACE, "-q"],
    "calibrate": ["--ref", f"hf:{MODEL}", "--trace", TRACE, "-q"],
    "selftest": ["--ref", f"hf:{MODEL}", "--trace", TRACE, "-q"],
    "tui": ["--ref", f"hf:{MODEL}", "--engine", f"hf:{MODEL}", "--trace", TRACE],
    "report show": [REPORT],
    "report validate": [REPORT],
    "report md": [REPORT],
    "report plot": [REPORT],
    "report diff": [REPORT, REPORT],
    "weights": ["--ref", f"hf:{MODEL}", "--engine", f"hf:{MODEL}", "--trace", TRACE, "-q"],
    "replay": [BUNDLE, "-q"],
}
# Options that only mean something with another one.
COMPANIONS = {"floor_file": ["--threshold", "floor"], "capture_dir": ["--capture", "full"]}
# tui's REPORT.json is the other way in: no live options with it.
ALONE = {("tui", "report_file")}

# Cases excused while an issue that fixes them is open: (command, option, kind) -> why. They are
# reported as xfail while they break; a case that passes is never excused. None is open.
ELSEWHERE: dict = {}

UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]")
CASE_SECONDS = 20


def commands(group: click.Group = cli, prefix: str = ""):
    """(path, command) of every command under `group`, groups walked."""
    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        path = f"{prefix}{name}"
        if isinstance(cmd, click.Group):
            yield from commands(cmd, path + " ")
        else:
            yield path, cmd


def takes_a_path(p: click.Parameter) -> bool:
    if isinstance(p.type, click.Path):
        return True
    if getattr(p, "is_flag", False) or isinstance(p.type, click.Choice) or p.name in NOT_PATHS:
        return False
    return bool(PATH_NAME.search(p.name or "") or PATH_METAVAR.search(getattr(p, "metavar", None) or ""))


def path_params() -> list[tuple[str, click.Parameter]]:
    return [(path, p) for path, cmd in commands() for p in cmd.params if takes_a_path(p)]


# --- the standard hostile set --------------------------------------------------------------

def hostile(d: Path, good_input: Path, good: Path | None) -> dict[str, str]:
    """Kind -> a path of that kind in `d`. `good_input` is the run's own trace (a copy);
    `good` what the option is given on its base line (a file or a directory), None when
    it is not there (an output, say): the names that should be fine (255 bytes, ESC and a
    line break) are given to a copy of it (a link to a directory), and as new names; the
    contents (UTF-16, a BOM) are its own, or the trace's."""
    content = (good.read_bytes() if good is not None and good.is_file() else good_input.read_bytes()).decode()
    (d / "dir").mkdir()
    os.mkfifo(d / "fifo")
    os.symlink(d / "loop2", d / "loop1")
    os.symlink(d / "loop1", d / "loop2")
    os.symlink(good_input, d / "link-to-input")
    os.symlink("/dev/zero", d / "zero-link")
    (d / "deep-100k.json").write_text("[" * 100_000 + "]" * 100_000)
    nested = "1"
    for _ in range(70):
        nested = '{"a": ' + nested + "}"
    (d / "deep-70.json").write_text(nested)
    (d / "utf16.jsonl").write_bytes(content.encode("utf-16"))
    (d / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + content.encode())
    big = "9" * 5000  # over Python's 4300-digit limit for int()
    (d / "huge.json").write_text(f'{{"prompt_ids": [{big}], "completion_ids": [1e999999], "schema_version": {big}, '
                                 f'"enforce_eager": 1e999999, "seed": -1e999999}}\n')
    (d / "nan.json").write_text('{"prompt_ids": [NaN], "completion_ids": [Infinity], "rollout_logprobs": [NaN], '
                                '"schema_version": 1, "temperature": NaN, "seed": -Infinity}\n')
    with open(d / "huge.jsonl", "wb") as f:  # sparse, 2 GiB: over every reader's limit (a trace's 1 GiB), no disk used;
        f.truncate(2**31)  # a reader that read it whole would fail the case with MemoryError, not take the machine
    long, esc = d / ("n" * 249 + ".jsonl"), d / "t\x1b[31m\x07\nforged.jsonl"
    for p in (long, esc):
        if good is not None and good.is_dir():
            p.symlink_to(good)
        else:
            p.write_text(content)
    return {
        "fifo": str(d / "fifo"),
        "dev_zero": "/dev/zero",
        "directory": str(d / "dir"),
        "symlink_loop": str(d / "loop1"),
        "link_to_input": str(d / "link-to-input"),
        "nested_100k": str(d / "deep-100k.json"),
        "nested_70": str(d / "deep-70.json"),
        "utf16": str(d / "utf16.jsonl"),
        "bom": str(d / "bom.jsonl"),
        "huge_numbers": str(d / "huge.json"),
        "nan_literals": str(d / "nan.json"),
        "name_255": str(long),
        "name_255_new": str(d / ("N" * 249 + ".jsonl")),
        "name_256_new": str(d / ("N" * 250 + ".jsonl")),  # one byte over what the filesystem takes
        "under_a_loop": str(d / "loop1" / "x.json"),
        "esc_newline_name": str(esc),
        "esc_newline_name_new": str(d / "o\x1b]0;t\x07\nnew.json"),
        "huge_sparse": str(d / "huge.jsonl"),
        "dev_zero_link": str(d / "zero-link"),
        "nul_in_name": str(d / "a\x00b.json"),  # no real command line carries one; main() called with it must not crash
    }


def good_value(command: str, param: click.Parameter) -> Path | None:
    """What `param` is given on its command's base line (a spec's directory), or None."""
    base = BASE[command]
    if isinstance(param, click.Argument):
        return Path(BUNDLE if command == "replay" else REPORT)
    opt = max(param.opts, key=len)
    if opt not in base:
        return None
    v = base[base.index(opt) + 1]
    return Path(v.partition(":")[2] if param.name in SPEC_OPTIONS else v)


def argv(command: str, param: click.Parameter, value: str, trace: str) -> list[str]:
    """The command line of one case: the base (its trace the case's copy), `param` given `value`."""
    base = [trace if a == TRACE else a for a in BASE[command]]
    if (command, param.name) in ALONE:
        return [*command.split(), value]
    if isinstance(param, click.Argument):
        args = list(base)
        pos = [i for i, a in enumerate(args) if a in (REPORT, BUNDLE)]
        nth = [q.name for q in _cmd(command).params if isinstance(q, click.Argument)].index(param.name)
        args[pos[nth]] = value
        return [*command.split(), *args, *ARG_COMPANIONS.get((command, param.name), [])]
    opt = max(param.opts, key=len)
    if param.name in SPEC_OPTIONS:  # KIND:DIR, the kind its base gives (hf where it gives none)
        kind = base[base.index(opt) + 1].partition(":")[0] if opt in base else "hf"
        value = f"{kind}:{value}"
    args = list(base)
    if opt in args:
        args[args.index(opt) + 1] = value
    else:
        args += [opt, value]
    return [*command.split(), *args, *COMPANIONS.get(param.name, [])]


def _cmd(command: str) -> click.Command:
    return dict(commands())[command]


def run_case(args: list[str]) -> tuple[str, int | None, str, str]:
    return run_cli_case(args, CASE_SECONDS)


def problems(outcome: str, rc, out: str, err: str) -> list[str]:
    found = []
    if outcome == "hung":
        return [f"no answer within {CASE_SECONDS} s"]
    if outcome == "exit" and rc not in (0, 1, 2, 4, 5):  # 3: an internal or backend error
        found.append(f"exit {rc}")
    if "Traceback" in out + err:
        found.append("a traceback")
    if outcome == "exit" and rc == 2:
        lines = [ln for ln in err.splitlines() if ln.strip()]
        if len(lines) != 1 or not lines[0].startswith("bisect: error: "):
            found.append(f"{len(lines)} lines on stderr")
    for name, text in (("stdout", out), ("stderr", err)):
        m = UNSAFE.search(text)  # newline and tab end or space lines: not in UNSAFE
        if m:
            found.append(f"unescaped {m.group(0)!r} on {name}")
    return found


PARAMS = path_params()


def test_the_walk_finds_every_path_option_and_every_command_has_a_base():
    """The walk is the list: it must find what we know takes a path (so a broken walk
    cannot pass as "nothing to test"), and every command it finds has a base line."""
    found = {(c, p.name) for c, p in PARAMS}
    known = {("run", "trace"), ("run", "out"), ("run", "log_path"), ("run", "resume"), ("run", "floor_file"),
             ("run", "capture_dir"), ("run", "engine_config"), ("run", "ref"), ("run", "engine"),
             ("compare", "out"), ("conditions", "good_config"), ("calibrate", "out"), ("selftest", "out"),
             ("report show", "file"), ("report diff", "before"), ("report diff", "after"), ("tui", "report_file")}
    assert known <= found, sorted(known - found)
    assert sorted({c for c, _ in commands()} - set(BASE)) == [], "a command with no base command line: add it to BASE"
    for c, p in PARAMS:  # each one reaches the hostile run: a command line can be built for it
        argv(c, p, "/x", TRACE)


def _files(d: Path) -> dict[Path, bytes | tuple]:
    """Each regular file's bytes (a huge sparse one: its size and modification time)."""
    out: dict[Path, bytes | tuple] = {}
    for p in d.iterdir():
        if not p.is_symlink() and p.is_file() and not p.is_fifo():
            st = p.stat()
            out[p] = p.read_bytes() if st.st_size < 2**26 else (st.st_size, st.st_mtime_ns)
    return out


@pytest.mark.parametrize("command, name", [(c, p.name) for c, p in PARAMS], ids=[f"{c}:{p.name}" for c, p in PARAMS])
def test_hostile_paths(tmp_path, no_models, alarm, command, name):
    param = next(p for c, p in PARAMS if c == command and p.name == name)
    trace = tmp_path / "trace.jsonl"
    trace.write_bytes(Path(TRACE).read_bytes())
    h = tmp_path / "h"
    h.mkdir()
    kinds = hostile(h, trace, good_value(command, param))
    model = _files(Path(MODEL))
    failures, excused = [], []
    for kind, path in kinds.items():
        before = _files(h)
        outcome, rc, out, err = run_case(argv(command, param, path, str(trace)))
        found = problems(outcome, rc, out, err)
        now = _files(h)
        if any(now.get(p) != data for p, data in before.items()) or trace.read_bytes() != Path(TRACE).read_bytes():
            found.append("an input file was changed")
            trace.write_bytes(Path(TRACE).read_bytes())
        for p in set(now) - set(before):  # an output the case named, made before a model would load (a new --log)
            if str(p) != path:
                found.append(f"{p.name} was written")
            p.unlink()
        why = ELSEWHERE.get((command, name, kind)) or ELSEWHERE.get(("*", name, kind))
        for what in found:
            (excused if why else failures).append(f"{kind}: {what}: rc {rc}, stderr {err[-300:]!r}" + (f" [{why}]" if why else ""))
    assert _files(Path(MODEL)) == model, "a model file was changed"
    assert failures == [], f"{command} {name}:\n" + "\n".join(failures)
    if excused:
        pytest.xfail("\n".join(excused))

"""Hostile outputs and hostile report fields (issue 29, items 6-11).

6. an output that a symbolic link leads onto an input (a model's weights, its config, the
   trace) is refused before any model loads, and the input is left as it was;
7. an output name that fits the filesystem is written (the atomic write's temporary name
   is cut to fit), one that does not is refused before any model loads;
8. every path printed (the summary's `report: PATH`, progress lines, `report validate`)
   is escaped: no ESC, BEL or line break of a path reaches the terminal;
9. the log-prob contract says "unknown" (with why) for values that cannot be log-probs;
10. the TUI's export survives a schema-valid report holding NaN / Infinity literals;
11. the report tools type-check every conditions field they read (and the schema types them).
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
from pathlib import Path

import pytest
import torch
from conftest import model_dir, trace_path

from numbisect.cli import main
from numbisect.model.trace import Sample
from numbisect.pipeline.contract import ContractFit
from numbisect.report.document import load_report, validate

MODEL = model_dir("qwen3_moe")
TRACE = trace_path("qwen3_moe")
ROOT = Path(__file__).resolve().parents[2]
CONDITIONS = ROOT / "fixtures" / "reports" / "qwen3_moe_conditions.json"
PLANTED = ROOT / "fixtures" / "reports" / "qwen3_moe_planted_fault.json"
UNSAFE = "\x1b\x07\r\u202e"
pytestmark = pytest.mark.usefixtures("one_thread")  # one torch thread: on a loaded machine, 10x faster here


def bisect(*args) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(args))
    return rc, out.getvalue(), err.getvalue()


def one_error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("bisect: error: "), err
    return lines[0]


@pytest.fixture
def no_model_loads(monkeypatch):
    from numbisect.backends import hf

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the output was checked")

    monkeypatch.setattr(hf.HFBackend, "__init__", refuse)


def snapshot(d: Path) -> dict:
    return {p: (p.read_bytes() if p.is_file() else None, p.stat().st_mtime_ns)
            for p in d.rglob("*") if not p.is_symlink() and not p.is_fifo()}


def copy_model(d: Path) -> Path:
    m = d / "model"
    m.mkdir()
    for f in Path(MODEL).iterdir():
        if f.is_file():
            (m / f.name).write_bytes(f.read_bytes())
    return m


def rollout_trace(d: Path, n: int = 3, logprobs=None) -> Path:
    """The first `n` samples of the fixture trace (its rollout log-probs, or `logprobs(sample)`)."""
    rows = [json.loads(ln) for ln in Path(TRACE).read_text().splitlines()[:n]]
    if logprobs is not None:
        for r in rows:
            r["rollout_logprobs"] = logprobs(r)
    t = d / "t.jsonl"
    t.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return t


# --- 6. outputs never overwrite an input, links followed -----------------------------------

@pytest.mark.parametrize("verb, opt, side, target", [
    ("compare", "--out", "--engine", "model.safetensors"),  # the issue's case: exit 0, weights replaced by JSON
    ("compare", "--out", "--ref", "config.json"),
    ("run", "--log", "--engine", "model.safetensors"),
])
def test_an_output_linked_onto_a_model_file_is_refused(tmp_path, no_model_loads, verb, opt, side, target):
    m = copy_model(tmp_path)
    link = tmp_path / "out.json"
    link.symlink_to(m / target)
    before = snapshot(tmp_path)
    ref, engine = (f"hf:{m}", f"hf:{MODEL}") if side == "--ref" else (f"hf:{MODEL}", f"hf:{m}")
    rc, out, err = bisect(verb, "--ref", ref, "--engine", engine, "--trace", TRACE, "-q", opt, str(link))
    line = one_error_line(err)
    assert rc == 2 and out == ""
    assert f"is a file of the {side} model" in line and "a link to" in line, line
    assert snapshot(tmp_path) == before


def test_an_output_linked_onto_the_blob_a_cached_checkpoint_links_to_is_refused(tmp_path, no_model_loads):
    """A Hugging Face cache snapshot holds links to blobs/ outside it: an output linked onto
    the blob is a file of the model all the same."""
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "abc"
    blobs.mkdir()
    snap.mkdir(parents=True)
    for f in Path(MODEL).iterdir():
        if f.is_file():
            (blobs / f.name).write_bytes(f.read_bytes())
            (snap / f.name).symlink_to(blobs / f.name)
    (tmp_path / "out.json").symlink_to(blobs / "model.safetensors")
    before = snapshot(tmp_path)
    rc, _, err = bisect("compare", "--ref", f"hf:{MODEL}", "--engine", f"hf:{snap}", "--trace", TRACE, "-q",
                        "--out", str(tmp_path / "out.json"))
    assert rc == 2 and "is a file of the --engine model" in one_error_line(err)
    assert snapshot(tmp_path) == before


def test_an_output_through_a_chain_of_links_onto_the_trace_is_refused(tmp_path, no_model_loads):
    trace = rollout_trace(tmp_path)
    (tmp_path / "a").symlink_to(trace)
    (tmp_path / "b").symlink_to(tmp_path / "a")
    before = snapshot(tmp_path)
    rc, out, err = bisect("compare", "--ref", f"hf:{MODEL}", "--engine", "rollout", "--trace", str(trace), "-q",
                          "--out", str(tmp_path / "b"))
    assert rc == 2 and "is the --trace input" in one_error_line(err)
    assert snapshot(tmp_path) == before


def test_an_output_linked_into_a_subfolder_of_a_dump_is_refused(tmp_path, no_model_loads):
    d = tmp_path / "dump"
    (d / "units").mkdir(parents=True)
    (d / "manifest.json").write_text("{}")
    (d / "units" / "layers.0.safetensors").write_bytes(b"x")
    (tmp_path / "o.json").symlink_to(d / "units" / "layers.0.safetensors")
    before = snapshot(tmp_path)
    rc, _, err = bisect("compare", "--ref", f"hf:{MODEL}", "--engine", f"dump:{d}", "--trace", TRACE, "-q",
                        "--out", str(tmp_path / "o.json"))
    assert rc == 2 and "is a file of the --engine dump" in one_error_line(err)
    assert snapshot(tmp_path) == before


# --- 7. a long but legal output name --------------------------------------------------------

@pytest.mark.parametrize("name", ["r" * 242, "r" * 250 + ".json", "r" * 255, "\u00e9" * 122 + ".json"])
def test_the_atomic_write_takes_every_name_the_filesystem_takes(tmp_path, name):
    from numbisect.common.safeio import write_text_atomic

    assert len(os.fsencode(name)) <= 255
    write_text_atomic(tmp_path / name, "one\n")
    write_text_atomic(tmp_path / name, "two\n")  # replacing it too
    assert [p.name for p in tmp_path.iterdir()] == [name]  # no temporary file left
    assert (tmp_path / name).read_text() == "two\n"


def test_a_name_longer_than_the_filesystem_takes_is_refused_before_any_model_loads(tmp_path, no_model_loads):
    rc, out, err = bisect("compare", "--ref", f"hf:{MODEL}", "--engine", f"hf:{MODEL}", "--trace", TRACE, "-q",
                          "--out", str(tmp_path / ("r" * 256)))
    assert rc == 2 and out == "" and "--out" in one_error_line(err)
    assert list(tmp_path.iterdir()) == []


# --- 8. every path printed is escaped ------------------------------------------------------

# --- 9. the log-prob contract says "unknown" when the values cannot be log-probs -------------

def _fit(values_for) -> dict:
    """A ContractFit over 4 samples of 12 completion tokens from random logits; the
    recorded value at each position is `values_for(true_logprob, position)`."""
    g = torch.Generator().manual_seed(1)
    fit = ContractFit()
    pos = 0
    for _ in range(4):
        z = torch.randn(12, 64, generator=g, dtype=torch.float64) * 2.0
        full = torch.log_softmax(z, dim=-1)
        ids, lps = [0], []
        for t in range(12):
            tok = int(torch.multinomial(full[t].exp(), 1, generator=g))
            ids.append(tok)
            lps.append(values_for(float(full[t, tok]), pos))
            pos += 1
        fit.add(Sample(prompt_ids=ids[:1], completion_ids=ids[1:], rollout_logprobs=lps, line=1), full.float())
    return fit.result()


@pytest.mark.parametrize("name, values_for, reason", [
    ("all zero", lambda lp, i: 0.0, "all_zero"),
    ("all -0.0", lambda lp, i: -0.0, "all_zero"),
    ("denormal", lambda lp, i: -1e-40 * (1 + i % 3), "all_zero"),
    ("all -1000", lambda lp, i: -1000.0, "constant"),
    ("constant -2.5", lambda lp, i: -2.5, "constant"),
    ("outside the support", lambda lp, i: -5000.0 - i, "outside_support"),
])
def test_values_that_cannot_be_logprobs_are_unknown_with_why(name, values_for, reason):
    c = _fit(values_for)
    assert c["verdict"] == "unknown", (name, c)
    assert c["unknown_reason"] == reason
    assert "cannot be the model's log-probs" in c["advice"]


def test_true_logprobs_of_the_same_samples_stay_raw():
    """The same samples with their true log-probs: raw (the checks above are not blanket ones)."""
    c = _fit(lambda lp, i: lp)
    assert c["verdict"] == "raw" and "unknown_reason" not in c


# --- one real run for 7, 8 and 9 (a model load costs more than every check here together) -------

# A 250-byte --out name holding an ESC sequence, a BEL and a line break; the reference's
# directory reached through a link whose name holds an OSC sequence; a rollout whose
# log-probs are all 0 (what an engine that records nothing writes).
OUT_NAME = "r\x1b[31mred\x07\nforged line "
OUT_NAME += "x" * (245 - len(OUT_NAME.encode())) + ".json"
LINK_NAME = "m\x1b]0;title\x07"


def escaped(s: str) -> str:
    return s.replace("\x1b", "\\x1b").replace("\x07", "\\x07").replace("\n", "\\n")


@pytest.fixture(scope="module")
def zeros_run(tmp_path_factory):
    import torch as _torch

    from numbisect.session.environment import set_threads

    before = _torch.get_num_threads()
    set_threads(1)
    d = tmp_path_factory.mktemp("zeros")
    model = d / LINK_NAME
    model.symlink_to(MODEL)
    trace = rollout_trace(d, 3, lambda r: [0.0] * len(r["completion_ids"]))
    out = d / OUT_NAME
    rc, text, err = bisect("compare", "--ref", f"hf:{model}", "--engine", "rollout", "--trace", str(trace), "--out", str(out))
    set_threads(before)
    return {"rc": rc, "out": out, "stdout": text, "stderr": err}


def test_a_250_byte_out_name_is_written_with_its_summary(zeros_run):
    """Before: the whole run, then exit 2 from the temporary name (over 255 bytes), no
    report and no summary."""
    assert len(OUT_NAME.encode()) == 250
    assert zeros_run["rc"] in (0, 1), zeros_run["stderr"]
    validate(json.loads(zeros_run["out"].read_text()))
    assert [p.name for p in zeros_run["out"].parent.iterdir() if p.name.startswith(".")] == []  # no temporary file left
    assert zeros_run["stdout"].splitlines()[-1] == f"report: {escaped(str(zeros_run['out']))}"


def test_the_summary_and_progress_escape_the_paths_they_print(zeros_run, capsys):
    """`report: PATH` printed --out raw: an ESC sequence, a BEL and a line break reached the
    terminal. Progress lines name the model's directory (here a link holding an OSC)."""
    for stream in (zeros_run["stdout"], zeros_run["stderr"]):
        assert not any(c in stream for c in UNSAFE), repr(stream[-300:])
    assert escaped(LINK_NAME) in zeros_run["stderr"]  # the progress line, escaped
    rc, text, _ = bisect("report", "validate", str(zeros_run["out"]))
    assert rc == 0 and text.count("\n") == 1 and not any(c in text for c in UNSAFE), repr(text)
    assert text.startswith(escaped(str(zeros_run["out"])) + ": valid")


def test_a_rollout_of_zeros_is_unknown_in_the_report_and_its_summaries(zeros_run):
    """Judged "raw" (mean error 0.72) before; now "unknown" with why, schema-valid, shown by
    the summary, `report show` and `report md`."""
    r = json.loads(zeros_run["out"].read_text())
    c = r["logprob_contract"]
    assert c["verdict"] == "unknown" and c["unknown_reason"] == "all_zero", c
    want = "log-prob contract: unknown (every recorded log-prob"
    assert want in zeros_run["stdout"]
    assert want in bisect("report", "show", str(zeros_run["out"]))[1]
    assert want in bisect("report", "md", str(zeros_run["out"]))[1]


# --- 10. the TUI survives a schema-valid report with NaN / Infinity literals, export included --

@pytest.mark.asyncio
async def test_the_tui_survives_every_action_and_exports_a_report_holding_nan_and_infinity(tmp_path):
    """Such a report is schema-valid and opens; pressing `e` raised in json.dumps(allow_nan=
    False) and ended the app. Every key of the app is pressed, then the report exported:
    strict JSON (the schema's "nan" / "inf"), which numbisect reads back."""
    from textual.widgets import Input

    from numbisect.tui.app import BisectApp
    from numbisect.tui.screens.dialogs import ErrorScreen, PathScreen

    r = json.loads(PLANTED.read_text())
    r["baseline"]["value"] = float("nan")
    r["search"]["baseline"] = float("inf")
    r["units"][1]["propagated"]["rel_l2"] = float("nan")
    r["units"][1]["local"]["rel_l2"] = float("-inf")
    r["trials"][0]["value"] = float("nan")
    src = tmp_path / "nan.json"
    src.write_text(json.dumps(r, indent=1))  # NaN / Infinity literals, as Python's json writes them
    assert "NaN" in src.read_text() and "Infinity" in src.read_text()
    report = load_report(src)  # schema-valid: it opens
    out = tmp_path / "exported.json"
    app = BisectApp(report=report, report_path=str(src))
    keys = [b.key.split(",")[0] for b in BisectApp.BINDINGS if b.action not in ("quit", "export", "open")]
    assert len(keys) >= 10
    async with app.run_test(size=(100, 32)) as pilot:
        for key in keys:
            await pilot.press(key)
            await pilot.pause()
            while app.screen is not app.main:  # a dialog or help: closed again
                await pilot.press("escape")
                await pilot.pause()
        await pilot.press("e")
        assert isinstance(app.screen, PathScreen)
        app.screen.query_one(Input).value = str(out)
        await pilot.press("enter")
        await pilot.pause()
        assert not isinstance(app.screen, (PathScreen, ErrorScreen))
    assert app.failure is None
    text = out.read_text()
    assert "NaN" not in text and "Infinity" not in text  # strict JSON: any JSON reader takes it
    back = load_report(out)  # and numbisect reads its own export
    assert back["baseline"]["value"] == "nan" and back["search"]["baseline"] == "inf"
    assert back["units"][1]["local"]["rel_l2"] == "-inf"
    assert back["culprits"] == r["culprits"]


@pytest.mark.asyncio
async def test_the_tui_export_through_a_link_onto_the_models_weights_is_refused(tmp_path):
    """The export is an output too: onto a file of the model the report names (here through
    a link), an error screen, and the weights stay as they were."""
    from textual.widgets import Input

    from numbisect.tui.app import BisectApp
    from numbisect.tui.screens.dialogs import ErrorScreen

    m = copy_model(tmp_path)
    r = json.loads(PLANTED.read_text())
    r["inputs"]["engine"]["path"] = str(m)
    link = tmp_path / "export.json"
    link.symlink_to(m / "model.safetensors")
    before = snapshot(tmp_path)
    app = BisectApp(report=r, report_path=str(PLANTED))
    async with app.run_test(size=(100, 32)) as pilot:
        await pilot.press("e")
        app.screen.query_one(Input).value = str(link)
        await pilot.press("enter")
        await pilot.pause()
        assert isinstance(app.screen, ErrorScreen)
        assert "is a file of the --engine model" in app.screen.message
    assert snapshot(tmp_path) == before


def test_the_floor_table_escapes_the_paths_it_prints():
    from numbisect.commands.calibrate import render

    doc = {"ref": {"arch": "qwen3_moe", "path": "/m\x1b[2J\nx", "dtype": "bfloat16"},
           "trace": {"path": "/t\x07.jsonl", "samples": 1}, "variants": [], "floor": {}}
    text = render(doc)
    assert not any(c in text for c in UNSAFE) and "hf:/m\\x1b[2J\\nx" in text and "/t\\x07.jsonl" in text


# --- 11. the report tools type-check every conditions field they read -------------------------

def test_report_show_of_a_conditions_report_with_junk_in_vs_reference_is_one_line(tmp_path):
    """Before: `internal error: AttributeError`, exit 3. The schema types the field now."""
    r = json.loads(CONDITIONS.read_text())
    r["conditions"]["vs_reference"]["user"] = "junk"
    f = tmp_path / "c.json"
    f.write_text(json.dumps(r))
    for verb in ("show", "md", "validate"):
        rc, out, err = bisect("report", verb, str(f))
        assert rc == 2 and out == "" and "conditions/vs_reference/user" in one_error_line(err), (verb, err)


def _paths(o, at=()):
    if isinstance(o, dict):
        for k, v in o.items():
            yield at + (k,)
            yield from _paths(v, at + (k,))
    elif isinstance(o, list):
        for i, v in enumerate(o[:1]):
            yield at + (i,)
            yield from _paths(v, at + (i,))


def test_the_renderers_survive_junk_in_every_conditions_field():
    """Past the schema (a reader of an older or newer version, the TUI's live reports): the
    summary, Markdown, diff and every TUI text read each conditions field type-checked."""
    from numbisect.report.summary import render
    from numbisect.report.tools import diff, markdown, render_diff
    from numbisect.tui.app import preflight

    r = json.loads(CONDITIONS.read_text())
    r["baseline"]["per_sample"] = r["baseline"]["per_sample"][:1]  # drawing 20 samples' tokens x 140 costs 10 s, none of it conditions
    tools = {"render": render, "markdown": markdown, "diff": lambda x: render_diff(diff(x, x)),
             "tui": lambda x: preflight(x, "c.json")}
    broken = []
    fields = list(_paths(r["conditions"], ("conditions",)))
    assert len(fields) > 100
    for at in fields:
        x = copy.deepcopy(r)
        o = x
        for k in at[:-1]:
            o = o[k]
        junk = 5 if isinstance(o[at[-1]], str) else "junk"  # the wrong type, whatever the field holds
        o[at[-1]] = junk
        for name, tool in tools.items():
            try:
                tool(x)
            except Exception as e:  # noqa: BLE001 - any exception is the finding
                broken.append(f"{name} with {'/'.join(map(str, at))} = {junk!r}: {type(e).__name__}: {e}")
    assert broken == [], "\n".join(broken[:20])

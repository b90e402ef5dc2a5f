"""`bisect replay BUNDLE` with the bundle as hostile input (#36): every field of the manifest
and every file of the bundle, by construction.

The bundle is written by hand (`conftest.synthetic_bundle`: the layout, version and checksums
`numbisect.live.bundle.write` gives, the qwen3 fixture as both sides), so no engine starts.
The fields are not listed here: `fields()` walks the good manifest, so a field added to the
writer joins the corpus. The parts are the files its sha256 table names, and manifest.json.

What must hold in every case: exit 2 with exactly one "bisect: error:" line on stderr, or the
replay accepted (it reaches the point where a model would load: `Registered.loader` stops it);
never exit 3 (an internal error) nor a traceback; no unescaped control character; no case
hangs (a 20 s alarm); the bundle's files are left as they were and nothing is written.
"""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path

import pytest
from conftest import run_cli_case, synthetic_bundle

from numbisect.cli import main
from numbisect.live import bundle as B

UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")
CASE_SECONDS = 20
SEALED = ("format", "version", "manifest_sha256")  # checked before the fields (tested apart)
# Wrong values for a field, whatever its type: each is wrong for some field and must never
# be an internal error for any.
WRONG = {"null": None, "true": True, "false": False, "negative": -1, "zero": 0, "float": 1.5, "huge": 10**400,
         "string": "x", "nul": "a\x00b", "esc": "\x1b[31mred\x07", "list": [1, "a"], "object": {"a": 1},
         "deep": json.loads("[" * 60 + "]" * 60), "path_out": "../../etc/passwd", "abs": "/etc/passwd",
         "float64": "float64"}


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    return Path(synthetic_bundle(tmp_path_factory.mktemp("good") / "bundle"))


def snapshot(d: Path) -> dict:
    out = {}
    for root, dirs, files in os.walk(d):
        for f in files:
            p = Path(root) / f
            out[p] = p.read_bytes() if p.is_file() and not p.is_symlink() else os.readlink(p) if p.is_symlink() else None
    return out


def replay(args: list[str]) -> tuple[str, int | None, str, str]:
    return run_cli_case(["replay", *args, "-q"], CASE_SECONDS)


def problems(outcome, rc, out, err) -> list[str]:
    if outcome == "hung":
        return [f"no answer within {CASE_SECONDS} s"]
    found = []
    if outcome == "exit":
        lines = [ln for ln in err.splitlines() if ln.strip()]
        if rc != 2:
            found.append(f"exit {rc}")
        elif len(lines) != 1 or not lines[0].startswith("bisect: error: "):
            found.append(f"{len(lines)} lines on stderr")
    if "Traceback" in out + err:
        found.append("a traceback")
    if UNSAFE.search(out + err):
        found.append("an unescaped control character")
    return found


def fields(m, prefix=()) -> list[tuple]:
    """Every field path of the manifest (objects walked; lists and their items are fields)."""
    out = []
    for k, v in m.items():
        if not prefix and k in SEALED:
            continue
        out.append((*prefix, k))
        if isinstance(v, dict):
            out += fields(v, (*prefix, k))
    return out


def set_field(m: dict, path: tuple, value, delete=False) -> None:
    for k in path[:-1]:
        m = m[k]
    if delete:
        del m[path[-1]]
    else:
        m[path[-1]] = copy.deepcopy(value)


def test_the_good_bundle_is_accepted(good, no_models, alarm):
    """The corpus starts from a bundle the replay takes (else every case would pass as refused)."""
    assert replay([str(good)])[0] == "accepted"


def test_every_manifest_field_given_every_wrong_value(good, tmp_path, no_models, alarm):
    """Each field of the manifest, deleted or given each WRONG value, the manifest sealed again
    (its checksum recomputed): refused in one line or taken; never an internal error."""
    manifest = json.loads((good / "manifest.json").read_text())
    paths = fields(manifest)
    assert {("finding", "threshold"), ("engine", "dtype"), ("parts", "reference"), ("finding", "first_divergence")} <= set(paths)
    b = tmp_path / "b"
    synthetic_bundle(b)
    before = {p: d for p, d in snapshot(b).items() if p.name != "manifest.json"}
    failures, cases = [], 0
    for path in paths:
        for label, value in [("deleted", None), *WRONG.items()]:
            def edit(m, path=path, label=label, value=value):
                set_field(m, path, value, delete=label == "deleted")
            try:
                synthetic_bundle(b, edit=edit)
            except ValueError:  # a value the writer's JSON refuses: no such manifest can exist
                continue
            cases += 1
            outcome, rc, out, err = replay([str(b)])
            for what in problems(outcome, rc, out, err):
                failures.append(f"{'.'.join(path)} {label}: {what}: {err[-300:]!r}")
    after = {p: d for p, d in snapshot(b).items() if p.name != "manifest.json"}
    assert after == before, "a file of the bundle was changed"
    print(f"{cases} manifest cases")
    assert cases > 400 and failures == [], "\n".join(failures)


@pytest.mark.parametrize("field, value, words", [
    (("finding", "threshold"), -1, "finding.threshold must be above 0"),
    (("finding", "threshold"), "0.001", "finding.threshold must be a finite number"),
    (("finding", "threshold"), [0.001], "finding.threshold must be a finite number"),
    (("finding", "threshold"), True, "finding.threshold must be a finite number, not true"),
    (("finding", "first_divergence"), "layers.2", "finding.first_divergence must be an object"),
    (("finding",), [1], "finding must be an object"),
    (("reference",), "float32", "reference must be an object"),
    (("engine", "dtype"), "float64", "engine.dtype must be one of float32, bfloat16, float16"),
    (("parts", "trace"), "trace\x00.jsonl", "parts.trace holds a NUL character"),
    (("fire", "threshold"), float("nan"), "fire.threshold must be a finite number"),
])
def test_a_wrong_field_is_named_before_anything_loads(tmp_path, capsys, no_models, field, value, words):
    def edit(m):
        if value != value:  # NaN: JSON has no such number; written as the writer never would
            set_field(m, field, "NaN-placeholder")
        else:
            set_field(m, field, value)

    b = synthetic_bundle(tmp_path / "b", edit=edit)
    if value != value:
        text = (Path(b) / "manifest.json").read_text().replace('"NaN-placeholder"', "NaN")
        (Path(b) / "manifest.json").write_text(text)
    code = main(["replay", b, "-q"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("bisect: error: bundle "), err
    assert words in err[0] or (value != value and "NaN" in err[0]), err[0]


def test_an_edit_to_the_manifest_that_stays_json_is_refused(good, tmp_path, capsys):
    b = tmp_path / "b"
    synthetic_bundle(b)
    m = json.loads((b / "manifest.json").read_text())
    m["finding"]["threshold"] = 0.5
    (b / "manifest.json").write_text(json.dumps(m))
    assert main(["replay", str(b), "-q"]) == 2
    assert "manifest.json was changed after the bundle was written" in capsys.readouterr().err


def test_a_bundle_of_the_previous_version_is_refused_in_one_line(tmp_path, capsys):
    b = synthetic_bundle(tmp_path / "b", edit=lambda m: m.update(version=1))
    assert main(["replay", b, "-q"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bundle version 1 (an older numbisect's: write the bundle again)" in err[0]


def test_engine_settings_not_recorded_are_refused(tmp_path, capsys):
    """An engine.json of `{}` (what attach() on directories wrote before #36) would replay in
    vLLM's defaults, not the engine the bundle measured."""
    b = Path(synthetic_bundle(tmp_path / "b"))
    (b / "engine.json").write_text("{}")

    def reseal(m):
        m["sha256"]["engine.json"] = B.file_sha256(b / "engine.json")

    synthetic_bundle(b, edit=reseal)
    (b / "engine.json").write_text("{}")  # synthetic_bundle wrote it again: put the {} back
    m = json.loads((b / "manifest.json").read_text())
    m["sha256"]["engine.json"] = B.file_sha256(b / "engine.json")
    m["manifest_sha256"] = B.manifest_digest(m)
    (b / "manifest.json").write_text(json.dumps(m))
    assert main(["replay", str(b), "-q"]) == 2
    assert "engine.json does not record enforce_eager" in capsys.readouterr().err


def hostile_files(d: Path, outside: Path) -> dict:
    """Kind -> how to put it in place of a file `p` of the bundle (a function of p)."""
    deep = "[" * 100_000 + "]" * 100_000

    def fifo(p):
        os.mkfifo(p)

    def link(target):
        return lambda p: os.symlink(target, p)

    def write(data):
        return lambda p: p.write_bytes(data)

    def directory(p):
        p.mkdir()

    def loop(p):
        os.symlink(p.with_name(p.name + ".2"), p)
        os.symlink(p, p.with_name(p.name + ".2"))

    def huge(p):  # sparse: over the manifest's limit without the disk
        with open(p, "wb") as f:
            f.truncate(B.MANIFEST_LIMIT + 1)

    return {"fifo": fifo, "dev_zero": link("/dev/zero"), "directory": directory, "loop": loop, "deep_json": write(deep.encode()),
            "huge": huge, "empty": write(b""), "nul": write(b"{\"a\": \"\x00\"}"), "esc": write(b"\x1b[31m\x07"),
            "utf16": write('{"format": 1}'.encode("utf-16")), "link_outside": link(outside),
            "link_missing": link(d / "nowhere")}


def test_every_file_of_the_bundle_replaced_by_every_hostile_kind(good, tmp_path, no_models, alarm):
    """manifest.json and each file its sha256 table names (a checkpoint's config and weights
    included), each replaced by a FIFO, a link to /dev/zero, a directory, a link loop, 100k-deep
    JSON, a sparse file over the manifest's limit, ... : refused in one line, nothing hangs."""
    b = tmp_path / "b"
    synthetic_bundle(b)
    manifest = json.loads((b / "manifest.json").read_text())
    names = ["manifest.json", *manifest["sha256"]]
    assert {"reference/model.safetensors", "engine/config.json", "engine.json", "trace.jsonl"} <= set(names)
    outside = tmp_path / "outside.json"
    failures, cases = [], 0
    for name in names:
        p = b / name
        original = p.read_bytes()
        outside.write_bytes(original)  # the same bytes, but outside the bundle
        for kind, put in hostile_files(tmp_path, outside).items():
            p.unlink()
            put(p)
            cases += 1
            outcome, rc, out, err = replay([str(b)])
            found = problems(outcome, rc, out, err)
            if outcome == "accepted":
                found.append("accepted")
            for what in found:
                failures.append(f"{name} {kind}: {what}: {err[-300:]!r}")
            for q in (p, p.with_name(p.name + ".2")):
                if q.is_dir() and not q.is_symlink():
                    q.rmdir()
                elif os.path.lexists(q):
                    q.unlink()
            p.write_bytes(original)
    assert replay([str(b)])[0] == "accepted"  # put back as it was: taken again
    print(f"{cases} file cases")
    assert failures == [], "\n".join(failures)


def test_out_onto_any_file_of_the_bundle_is_refused_and_nothing_is_written(good, tmp_path, capsys):
    b = tmp_path / "b"
    synthetic_bundle(b)
    before = snapshot(b)
    names = ["manifest.json", *json.loads((b / "manifest.json").read_text())["sha256"]]
    os.symlink(b / "manifest.json", tmp_path / "link-to-manifest")
    for out in [*(str(b / n) for n in names), str(tmp_path / "link-to-manifest")]:
        code = main(["replay", str(b), "--out", out, "-q"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and "would be overwritten" in err[0], (out, err)
    assert snapshot(b) == before


def test_a_bundle_path_with_escapes_is_printed_escaped(tmp_path, capsys):
    code = main(["replay", str(tmp_path / "b\x1b[31m\nx"), "-q"])
    err = capsys.readouterr().err
    assert code == 2 and "\x1b" not in err and len(err.strip().splitlines()) == 1

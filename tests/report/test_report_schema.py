"""The report's JSON Schema (v1), report loading, and the atomic writer. No models needed.

The example report is a real `bisect compare` of the qwen3 fixture against itself with a
float32 engine (hf vs hf). Other shapes (rollout engine, a `run` report) are derived from
it: each one is what the code that writes that shape produces.
"""

import copy
import json
import math
from pathlib import Path

import jsonschema
import pytest

from numbisect.common.errors import InputError
from numbisect.pipeline.measure import sanitize
from numbisect.report.document import (
    SCHEMA_PATH,
    SCHEMA_VERSION,
    load_report,
    schema,
    validate,
    write_json_atomic,
)

DATA = Path(__file__).resolve().parents[1] / "data"
EXAMPLE = DATA / "report_compare_hf.json"


@pytest.fixture
def report() -> dict:
    return json.loads(EXAMPLE.read_text(encoding="utf-8"))


def dump(tmp_path, obj, name="r.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(obj, indent=1), encoding="utf-8")
    return path


def load_error(tmp_path, obj_or_text) -> str:
    path = tmp_path / "bad.json"
    if isinstance(obj_or_text, str):
        path.write_text(obj_or_text, encoding="utf-8")
    else:
        path.write_text(json.dumps(obj_or_text), encoding="utf-8")
    with pytest.raises(InputError) as e:
        load_report(path)
    return str(e.value)


# -- the schema itself -----------------------------------------------------------------------
def test_schema_is_valid_draft_2020_12():
    s = schema()
    jsonschema.Draft202012Validator.check_schema(s)
    assert s["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert s["$id"] == "https://numbisect.invalid/schemas/report-v1.json"
    assert s["properties"]["schema_version"] == {**s["properties"]["schema_version"], "const": SCHEMA_VERSION}
    assert "ignore unknown fields" in s["description"]
    assert SCHEMA_PATH.name == f"report-v{SCHEMA_VERSION}.json"


def test_schema_refs_resolve():
    """Every $ref points at an existing $defs entry (a dangling one only fails when reached)."""
    s = schema()
    refs = set()

    def walk(x):
        if isinstance(x, dict):
            if "$ref" in x:
                refs.add(x["$ref"])
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(s)
    assert refs
    for ref in refs:
        assert ref.startswith("#/$defs/"), ref
        assert ref.split("/")[-1] in s["$defs"], ref


# -- reports that must validate --------------------------------------------------------------
def test_example_report_validates(report):
    assert validate(report) == []
    loaded = load_report(EXAMPLE)
    assert loaded == report
    assert EXAMPLE.stat().st_size < 100_000


def test_example_report_covers_the_interesting_values(report):
    """The example exercises what the schema has to allow: non-finite strings, units, ranking."""
    assert report["kind"] == "compare" and report["units"]
    sqnr = [u["propagated"]["sqnr_db"] for u in report["units"] if u["propagated"]]
    assert "inf" in sqnr  # bitwise-equal embed: infinite SQNR, written as a string
    assert any(isinstance(v, float) for v in sqnr)
    assert report["local_ranking"]
    assert report["baseline"]["groups"]["completion"]["kl"] is not None


def test_rollout_shaped_report_validates(report):
    """--engine rollout: no units, no KL / top-1, empty groups, null k3 on prompt positions."""
    r = copy.deepcopy(report)
    r["inputs"]["engine"] = {"backend": "rollout", "path": r["inputs"]["trace"]["path"], "dtype": None}
    r["units"] = []
    r["first_divergence"] = {"bitwise": None, "above_tol": None}
    del r["local_ranking"]
    empty = {"count": 0, "mean": None, "p50": None, "p99": None, "max": None}
    for name, g in r["baseline"]["groups"].items():
        g["kl"] = None
        g["top1_agree"] = None
        if name != "completion":
            g.update(tokens=0, k1=empty, k2=empty, k3=empty)
    for s in r["baseline"]["per_sample"]:
        s["k3"][: s["prompt_len"] - 1] = [None] * (s["prompt_len"] - 1)
    assert validate(r) == []


def test_non_finite_values_written_by_the_report_writer_validate(report, tmp_path):
    r = copy.deepcopy(report)
    row = r["units"][1]
    row["propagated"].update(max_abs=math.nan, mean_abs=math.nan, rel_l2=math.inf, cosine=math.nan, sqnr_db=-math.inf)
    row["propagated"]["ulps"].update(max_ulps=None, max_ulps_all=None)
    row["local"] = None
    r["baseline"]["value"] = math.inf
    r["baseline"]["groups"]["completion"]["k3"]["max"] = math.inf
    r["baseline"]["per_sample"][0]["k3"][0] = math.inf
    r["baseline"]["worst_tokens"][0]["value"] = math.nan
    path = tmp_path / "r.json"
    write_json_atomic(path, sanitize(r))
    loaded = load_report(path)
    assert loaded["units"][1]["propagated"]["rel_l2"] == "inf"
    assert loaded["units"][1]["propagated"]["sqnr_db"] == "-inf"
    assert loaded["baseline"]["worst_tokens"][0]["value"] == "nan"


def test_unknown_fields_are_allowed(report):
    """Fields are only added within a version: a v1 reader must accept ones it does not know."""
    r = copy.deepcopy(report)
    r["from_the_future"] = {"x": 1}
    r["environment"]["gpu"] = "none"
    r["baseline"]["groups"]["completion"]["entropy"] = {"mean": 1.0}
    r["units"][0]["routing"] = {"agree_frac": 1.0}
    r["units"][1]["propagated"]["new_metric"] = 3
    assert validate(r) == []


def run_fields() -> dict:
    """What a `run` report adds (shapes of Session.self_check, Trial/Culprit/SearchResult.to_dict)."""
    culprit = {"unit": "layers.2.moe.experts", "kind": "experts", "alone": 1e-5, "complement": 0.02, "local_rank": 3}
    return {
        "first_divergence": {"bitwise": "layers.0.attn", "above_tol": None},
        "local_ranking": {"layers.2.moe.experts": 1, "layers.0.attn": 2},
        "self_check": {"k3_mean": 0.0, "tolerance": 1e-7, "dtypes_match": True, "passed": True, "swapped": ["embed", "layers.0"]},
        "swap": {"units": ["layers.0.attn"], "donor_path": "fixtures/models/qwen3", "donor_dtype": "bfloat16", "lines": []},
        "trials": [
            {"index": 0, "swapped": [], "value": 0.02, "metrics": {"forward_s": 0.1}, "duration_s": 0.12, "role": "baseline", "resumed": False},
            {"index": 1, "swapped": ["layers.2.moe"], "value": None, "metrics": {}, "duration_s": 0.1, "role": "probe", "resumed": True},
        ],
        "culprits": [culprit],
        "search": {
            "verdict": "culprits",
            "strategy": "hierarchical",
            "trials_used": 2,
            "stop_reason": "swapping layers.2.moe.experts alone brings k3-mean under 0.001",
            "baseline": 0.02,
            "all_swapped": 0.0,
            "threshold": 0.001,
            "culprits": [culprit],
            "contributions": {"layers.0": {"alone": 0.01, "complement": None}},
        },
        "selftest": {"passed": True},
    }


def test_run_report_validates(report):
    r = {**copy.deepcopy(report), "kind": "run", **run_fields()}
    assert validate(r) == []
    r["search"].update(verdict="budget", baseline=None, all_swapped=None, culprits=[])
    r["culprits"] = [{"unit": "layers.1.attn", "kind": "attn", "alone": None, "complement": None, "local_rank": None}]
    assert validate(r) == []


@pytest.mark.parametrize(
    "path, value, where",
    [
        (("search", "verdict"), "found", "search/verdict"),
        (("search", "trials_used"), 2.5, "search/trials_used"),
        (("trials", 0, "index"), "0", "trials/0/index"),
        (("trials", 0, "swapped"), "layers.0", "trials/0/swapped"),
        (("trials", 0, "resumed"), "no", "trials/0/resumed"),
        (("culprits", 0, "kind"), 7, "culprits/0/kind"),  # unit kinds are an open set of strings
        (("culprits", 0, "local_rank"), 0, "culprits/0/local_rank"),
        (("self_check", "passed"), "yes", "self_check/passed"),
        (("first_divergence", "bitwise"), 3, "first_divergence/bitwise"),
        (("local_ranking", "layers.0.attn"), "2", "local_ranking/layers.0.attn"),
        (("search", "baseline"), "infinity", "search/baseline"),
    ],
)
def test_run_fields_are_typed(report, path, value, where):
    r = {**copy.deepcopy(report), "kind": "run", **run_fields()}
    target = r
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    errors = validate(r)
    assert errors and any(e.startswith(where + ":") for e in errors), errors


# -- reports that must not validate ----------------------------------------------------------
@pytest.mark.parametrize(
    "mutate, where, words",
    [
        (lambda r: r.update(verdict="maybe"), "verdict", ["'maybe'", "aligned", "diverged"]),
        (lambda r: r.pop("units"), "(top)", ["'units'", "required"]),
        (lambda r: r.update(kind="bisect"), "kind", ["'bisect'"]),
        (lambda r: r["threshold"].update(metric="k4-mean"), "threshold/metric", ["'k4-mean'"]),
        (lambda r: r["units"][2].update(kind=""), "units/2/kind", ["''"]),  # open set, but a non-empty string
        (lambda r: r["units"][2].update(layer="0"), "units/2/layer", ["'0'"]),
        (lambda r: r["units"][2]["propagated"]["ulps"].update(bitwise_equal=1), "units/2/propagated/ulps/bitwise_equal", ["boolean"]),
        (lambda r: r["units"][2]["propagated"].update(rel_l2="Infinity"), "units/2/propagated/rel_l2", ["'Infinity'", "inf"]),
        (lambda r: r["units"][2]["propagated"].pop("cosine"), "units/2/propagated", ["'cosine'", "required"]),
        (lambda r: r["units"][2].update(local=5), "units/2/local", ["5", "null"]),
        (lambda r: r["units"][2].pop("local"), "units/2", ["'local'", "required"]),
        (lambda r: r["baseline"]["groups"]["completion"].update(kl=3), "baseline/groups/completion/kl", ["3"]),
        (lambda r: r["baseline"]["groups"]["completion"]["kl"].pop("mean"), "baseline/groups/completion/kl", ["'mean'"]),
        (lambda r: r["baseline"].update(value="big"), "baseline/value", ["'big'", "inf"]),
        (lambda r: r["baseline"]["groups"]["completion"]["k3"].pop("p99"), "baseline/groups/completion/k3", ["'p99'"]),
        (lambda r: r["baseline"]["per_sample"][0]["k3"].__setitem__(0, "0.1"), "baseline/per_sample/0/k3/0", ["'0.1'"]),
        (lambda r: r["environment"].pop("vllm"), "environment", ["'vllm'"]),
        (lambda r: r["inputs"]["trace"].update(sha256="abc"), "inputs/trace/sha256", ["'abc'"]),
        (lambda r: r["inputs"]["engine"].update(backend=None), "inputs/engine/backend", ["None"]),
        (lambda r: r.update(command="bisect compare"), "command", []),
    ],
)
def test_mutated_report_fails_with_a_useful_message(report, tmp_path, mutate, where, words):
    r = copy.deepcopy(report)
    mutate(r)
    errors = validate(r)
    assert errors and any(e.startswith(where + ":") for e in errors), errors
    msg = load_error(tmp_path, r)
    assert "not a valid v1 report" in msg and str(tmp_path / "bad.json") in msg
    for w in words:
        assert w in msg, msg


def test_newer_schema_version_names_both_versions(report, tmp_path):
    r = copy.deepcopy(report)
    r["schema_version"] = 2
    msg = load_error(tmp_path, r)
    assert "schema version 2" in msg and "not supported" in msg
    assert f"1..{SCHEMA_VERSION}" in msg


@pytest.mark.parametrize("version", ["1", 0, -1, 1.5, None])
def test_bad_schema_version_is_refused(report, tmp_path, version):
    r = copy.deepcopy(report)
    r["schema_version"] = version
    msg = load_error(tmp_path, r)
    assert f"schema version {version!r}" in msg


def test_boolean_schema_version_is_refused(report, tmp_path):
    """JSON true is a Python int; it is still not a schema version."""
    r = copy.deepcopy(report)
    r["schema_version"] = True
    assert any(e.startswith("schema_version:") for e in validate(r))
    assert "schema version True is not supported" in load_error(tmp_path, r)


def test_missing_schema_version(report, tmp_path):
    r = copy.deepcopy(report)
    del r["schema_version"]
    assert "no schema_version" in load_error(tmp_path, r)


def test_corrupt_json(report, tmp_path):
    text = json.dumps(report)[:500]
    msg = load_error(tmp_path, text)
    assert "not valid JSON" in msg


@pytest.mark.parametrize("value", [[], [{"schema_version": 1}], "report", 1, None])
def test_json_that_is_not_an_object(tmp_path, value):
    assert "not a numbisect report" in load_error(tmp_path, json.dumps(value))


def test_empty_file(tmp_path):
    assert "not valid JSON" in load_error(tmp_path, "")


def test_bom_prefixed_file_loads(report, tmp_path):
    path = tmp_path / "bom.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(report).encode("utf-8"))
    assert load_report(path) == report


def test_missing_and_unreadable_files(tmp_path):
    with pytest.raises(InputError, match="report not found"):
        load_report(tmp_path / "nope.json")
    path = tmp_path / "latin1.json"
    path.write_bytes(b'{"schema_version": 1, "x": "\xff"}')
    with pytest.raises(InputError, match="cannot read report"):
        load_report(path)


# -- the atomic writer -----------------------------------------------------------------------
def leftovers(directory: Path, name: str) -> list[Path]:
    return sorted(directory.glob(f".{name}.*.tmp"))


def test_write_json_atomic_success(report, tmp_path):
    path = tmp_path / "out.json"
    write_json_atomic(path, report)
    assert json.loads(path.read_text()) == report
    assert path.read_text().endswith("\n")
    assert leftovers(tmp_path, "out.json") == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]
    # overwriting an existing report also leaves nothing behind
    write_json_atomic(path, {"schema_version": 1})
    assert json.loads(path.read_text()) == {"schema_version": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]


@pytest.mark.parametrize(
    "bad, error",
    [
        ({"units": {"a", "b"}}, TypeError),  # json cannot serialise a set
        ({"value": math.nan}, ValueError),  # unsanitised non-finite float (allow_nan=False)
    ],
)
def test_write_json_atomic_failure_leaves_nothing(tmp_path, bad, error):
    path = tmp_path / "out.json"
    with pytest.raises(error):
        write_json_atomic(path, bad)
    assert not path.exists()
    assert list(tmp_path.iterdir()) == []


def test_write_json_atomic_failure_keeps_the_old_file(report, tmp_path):
    path = tmp_path / "out.json"
    write_json_atomic(path, report)
    before = path.read_bytes()
    with pytest.raises(TypeError):
        write_json_atomic(path, {"units": {1, 2}})
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]


def test_write_json_atomic_missing_directory(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        write_json_atomic(tmp_path / "no" / "such" / "out.json", {"a": 1})
    assert list(tmp_path.iterdir()) == []

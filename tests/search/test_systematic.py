"""Kind-level culprits on a real engine: a fault planted in every layer of one kind is named
as that kind soon after the search's first evidence that it is spread, a fault in one layer
pays nothing for that, and a run cut in the middle of the kind-level hypotheses resumes.

fp32 hf engine against the fp32 reference (noise floor 0), Qwen3-MoE fixture, 8 samples;
no checkpoint diff (one directory), so only the search's own evidence brings the kinds.
"""

from __future__ import annotations

import json
import math

from conftest import session

from numbisect.commands.run import run
from numbisect.pipeline.provenance import new_report
from numbisect.report.document import validate
from numbisect.report.summary import systematic_lines
from numbisect.common.errors import ExitCode
from numbisect.model.units import children, unit_graph
from numbisect.search.search import default_candidates

EVERY_LAYER = [f"moe_combine_bf16@layers.{i}.moe" for i in range(4)]
KIND_ROLES = {"kind", "kinds", "kinds screen", "kind share"}


def hf_session(faults):
    return session("qwen3_moe", "hf", ref_dtype="float32", engine_dtype="float32", samples=8, faults=faults,
                   threshold=1e-10)


def search(s, **kw):
    return run(s, swap=None, strategy="hierarchical", max_trials=kw.get("max_trials"), log=kw.get("log"),
               resume=kw.get("resume"))


def sizes(s) -> tuple[int, int, int]:
    """(n units the search can name, K kinds found in two or more layers, L layers)."""
    g = unit_graph(s.engine.units)
    units = []
    for c in default_candidates(g):
        units += [c, *children(g, c)]
    layers: dict[str, set] = {}
    for u in units:
        if g.nodes[u]["layer"] is not None:
            layers.setdefault(g.nodes[u]["kind"], set()).add(g.nodes[u]["layer"])
    n_layers = len({g.nodes[u]["layer"] for u in units} - {None})
    return len(units), sum(len(ls) >= 2 for ls in layers.values()), n_layers


def test_a_fault_in_every_layer_is_named_as_its_kind_within_the_bound():
    """The bound: ceil(log2 n) + 6 + K + L (the descent until its unit fails alone, every kind
    together, each of the two middle layers left out, each kind alone, one share per layer):
    20 here (19 measured), where the search that first ran to 'diffuse' took 41."""
    s = hf_session(EVERY_LAYER)
    body, code = search(s)
    assert code == ExitCode.DIVERGED, body["search"]["stop_reason"]
    sy = body["search"]["systematic"]
    assert sy["kinds"] == ["experts"] and sy["layers"] == 4 and sy["value"] <= 1e-10
    assert "touches every layer" in sy["trigger"]
    assert len(sy["per_layer"]["experts"]) == 4 and all(v > 1e-10 for v in sy["per_layer"]["experts"].values())
    n, k, layers = sizes(s)
    assert body["search"]["trials_used"] <= math.ceil(math.log2(n)) + 6 + k + layers
    # the precision what-ifs, each on every experts unit at once: the fp32 weighted sum is the fix
    p = sy["precision"]
    by = {t["whatif"]: t for t in p["whatifs"]}
    assert by["fp32 weighted sum"]["verdict"] == "fixes" and by["fp32 weighted sum"]["units"] == 4
    assert by["fp32 weighted sum"]["replaced_faults"] == EVERY_LAYER
    assert p["suggested"].startswith("accumulate every MoE block's expert weighted sum in fp32")
    report = new_report("run", "bisect run", s.inputs(), s.settings.to_dict(), body)
    assert validate(report) == []
    assert any(line.startswith("precision what-if for every experts unit: suggested fix: accumulate")
               for line in systematic_lines(report))


def test_a_fault_in_one_layer_pays_nothing_for_the_kinds():
    s = hf_session(["moe_combine_bf16@layers.2.moe"])
    body, code = search(s)
    assert code == ExitCode.DIVERGED and [c["unit"] for c in body["culprits"]] == ["layers.2.moe.experts"]
    assert not {t["role"] for t in body["trials"]} & KIND_ROLES
    n, _, _ = sizes(s)
    assert body["search"]["trials_used"] <= math.ceil(math.log2(n)) + 4


def test_a_run_cut_in_the_kind_level_hypotheses_resumes_from_its_log(tmp_path):
    s = hf_session(EVERY_LAYER)
    full_log = tmp_path / "full.jsonl"
    want, _ = search(s, log=str(full_log))
    full = [json.loads(x) for x in full_log.read_text().splitlines()[1:]]
    start = next(i for i, t in enumerate(full) if t["role"] in KIND_ROLES)
    log = tmp_path / "cut.jsonl"
    body, code = search(s, log=str(log), max_trials=start + 2)  # cut after two kind-level trials
    assert code == ExitCode.NO_CULPRIT and body["search"]["verdict"] == "budget"
    first = [json.loads(x) for x in log.read_text().splitlines()[1:]]
    assert [t["role"] for t in first[start:]] == [t["role"] for t in full[start : start + 2]]
    body, code = search(s, resume=str(log))
    assert code == ExitCode.DIVERGED
    assert body["search"]["systematic"] == want["search"]["systematic"]
    lines = [json.loads(x) for x in log.read_text().splitlines()[1:]]
    assert lines[: len(first)] == first
    assert [t["swapped"] for t in lines] == [t["swapped"] for t in full]  # none repeated, none added

"""What the TUI shows, from a report dict alone: sentences, symbols, abbreviations, tokens."""

from __future__ import annotations

import copy

from numbisect.common.formatting import fmt
from numbisect.tui import model as M
from tui.support import COMPARE_REPORT, REPORT, expected_sentence, read, unit_value


def test_culprit_sentence_carries_its_evidence():
    r = read(REPORT)
    lines = [text for _, text in M.culprit_lines(r)]
    c = r["culprits"][0]
    assert lines[0] == expected_sentence(r)
    assert lines[0].startswith(f"layers.2.moe.experts: swapping it alone takes mean k3 from {fmt(r['baseline']['value'])} to ")
    assert lines[1] == f"◆ culprit · threshold 1.00e-03 · all others swapped: {fmt(c['complement'])} · local rank {c['local_rank']}"


def test_verdict_reads_without_colour():
    r = read(REPORT)
    mark, _, text = M.verdict_line(r)
    v = r["baseline"]["value"]
    assert mark == "!! DIVERGED"
    assert text.startswith(f"mean k3 {fmt(v)} > 1.00e-03 ({v / 1e-3:.1f}x)")
    assert f"{100 * r['baseline']['rl_cost']['seq_frac_rejected']:.1f}% of sequences rejected" in text


def test_a_compare_report_says_no_search_was_run_and_gives_clues():
    r = read(COMPARE_REPORT)
    lines = [t for _, t in M.culprit_lines(r)]
    if r["verdict"] == "diverged":
        assert "no search" in lines[0]
    else:
        assert lines[0].startswith("aligned")


def test_unit_rows_follow_containment_and_execution_order():
    rows = M.unit_rows(read(REPORT))
    names = [r.name for r in rows]
    assert names[:8] == [
        "embed", "layers.0", "layers.0.input_norm", "layers.0.attn", "layers.0.post_attn_norm",
        "layers.0.moe", "layers.0.moe.router", "layers.0.moe.experts",
    ]
    assert names[-2:] == ["final_norm", "lm_head"]
    experts = rows[names.index("layers.2.moe.experts")]
    assert (experts.label, experts.depth) == ("experts", 3)


def test_severity_symbols_against_the_unit_tolerance():
    r = read(REPORT)
    by = {u["name"]: u for u in r["units"]}
    assert M.unit_severity(by["embed"], "propagated", 0.01)[0] == "equal"
    assert M.unit_severity(by["layers.0.attn"], "propagated", 0.01)[0] == "ok"
    assert M.unit_severity(by["layers.1.moe"], "propagated", 0.01)[0] == "ok"
    assert M.unit_severity(by["layers.3.moe"], "propagated", 0.2)[0] == "ok"
    assert M.unit_severity(by["layers.3.moe"], "propagated", 0.1)[0] == "over"  # 0.15
    assert M.unit_severity(by["layers.3.moe"], "propagated", 0.01)[0] == "far"
    ex = by["layers.2.moe.experts"]["propagated"]["rel_l2"]
    assert M.unit_severity(by["layers.2.moe.experts"], "propagated", 0.01)[:2] == ("far", fmt(ex))
    assert M.unit_severity(by["layers.3.attn"], "local", 0.01)[1] == unit_value(r, "layers.3.attn", "local")
    assert M.unit_severity({"name": "x"}, "local", 0.01)[0] == "none"


def test_filter_keeps_matches_and_their_ancestors():
    r = read(REPORT)
    keep = M.visible_units(r, "router")
    assert "layers.2.moe.router" in keep and "layers.2.moe" in keep and "layers.2" in keep
    assert "layers.2.attn" not in keep
    assert M.visible_units(r, "  ") is None


def test_abbreviations_of_swapped_sets():
    r = read(REPORT)
    uni = M.candidate_universe(r)
    assert len(uni) == 19
    assert M.abbreviate([], uni) == "nothing (baseline)"
    assert M.abbreviate(["layers.2.moe.experts"], uni) == "moe.experts[2]"
    assert M.abbreviate(uni, uni) == "all 19"
    assert M.abbreviate([u for u in uni if u != "layers.2.moe"], uni) == "all 19 but moe[2]"
    assert M.abbreviate(["layers.0.attn", "layers.1.attn", "layers.3.attn"]) == "attn[0-1,3]"


def test_trials_that_swapped_a_unit_directly_or_through_a_parent():
    r = read(REPORT)
    hits = M.trials_with(r["trials"], r, "layers.2.moe.experts")
    assert [(t["index"], how) for t, how in hits] == [(1, "via layers.2.moe"), (4, "via layers.2.moe"), (6, "itself")]


def test_token_groups_masks_and_worst_tokens():
    r = read(REPORT)
    td = M.token_data(r, REPORT)
    assert td.groups == ["completion", "prompt", "all", "image"] and td.note == ""
    ps = r["baseline"]["per_sample"][0]
    comp = td.mask(0, "completion")
    assert sum(comp) == len(ps["k3"]) - (ps["prompt_len"] - 1)
    worst = td.worst("completion", 3)
    assert [(w["sample"], w["position"], w["token_id"]) for w in worst] == [
        (t["sample"], t["position"], t["token_id"]) for t in r["baseline"]["worst_tokens"][:3]
    ]
    assert all(td.mask(w["sample"], "image")[w["position"] - 1] for w in td.worst("image", 5))
    assert td.level(1e-3) == 4 and td.level(9.9e-4) == 3 and td.level(0) == 0 and td.level(50) == 7


def test_trace_groups_are_dropped_when_the_trace_is_not_the_reports():
    r = copy.deepcopy(read(REPORT))
    r["inputs"]["trace"]["sha256"] = "0" * 64
    td = M.token_data(r, REPORT)
    assert td.groups == ["completion", "prompt", "all"] and "differs" in td.note
    r["inputs"]["trace"]["path"] = "no/such/trace.jsonl"
    assert "not found" in M.token_data(r, REPORT).note


def test_a_culprits_precision_whatifs_show_in_its_unit_detail():
    from numbisect.tui.widgets.unit_detail import detail_text

    r = read(REPORT)
    c = r["culprits"][0]
    c["precision"] = {"suggested": "accumulate the expert weighted sum in fp32: k3-mean 1.2e-08 -> 3.3e-14 (fixes it)",
                      "whatifs": [{"whatif": "fp32 weighted sum", "line": "k3-mean 1.2e-08 -> 3.3e-14 (fixes it)"},
                                  {"whatif": "fp32 unit", "line": "k3-mean 1.2e-08 -> 1.1e-08 (does not help)"}]}
    text = detail_text(r, c["unit"], "propagated", r["trials"], []).plain
    assert "suggested fix: accumulate the expert weighted sum in fp32" in text
    assert "  fp32 weighted sum: k3-mean 1.2e-08 -> 3.3e-14 (fixes it)" in text
    assert "  fp32 unit: k3-mean 1.2e-08 -> 1.1e-08 (does not help)" in text
    other = next(u["name"] for u in r["units"] if u["name"] != c["unit"])
    assert "suggested fix" not in detail_text(r, other, "propagated", r["trials"], []).plain

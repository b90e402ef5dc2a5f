"""RL rollout dumps as traces: presets, field maps, parquet and JSONL, and --engine rollout.

The fixture dumps (fixtures/make_rl_traces.py) hold the qwen3_moe trace's own token ids
and sampler log-probs in verl's parquet layout and OpenRLHF's padded JSONL layout, so
the reference's recomputed log-probs must give the same k3 as on the native trace.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import FIXTURES, hf, model_dir, trace_path

from numbisect.cli import main
from numbisect.model.rlformats import load_any
from numbisect.model.trace import load_trace
from numbisect.pipeline.measure import Settings
from numbisect.session.session import Session, Spec

pytestmark = pytest.mark.usefixtures("one_thread")
TRACES = FIXTURES / "traces"
VERL = str(TRACES / "qwen3_moe.verl.parquet")
OPENRLHF = str(TRACES / "qwen3_moe.openrlhf.jsonl")


def rollout_compare(trace, **spec):
    s = Session.open(Spec(ref=f"hf:{model_dir('qwen3_moe')}", engine="rollout", trace=trace, **spec), Settings(),
                backends={"ref": hf("qwen3_moe")})
    return s.compare(local=False), s


@pytest.mark.parametrize("path, fmt", [(VERL, "verl"), (OPENRLHF, "openrlhf")])
def test_dump_reads_as_the_native_trace(path, fmt):
    native = load_trace(trace_path("qwen3_moe"))
    dump = load_any(path)  # detected
    assert dump.format == fmt and len(dump.samples) == len(native.samples) == 20
    for a, b in zip(native.samples, dump.samples):
        assert (a.prompt_ids, a.completion_ids) == (b.prompt_ids, b.completion_ids)  # padding cut
        assert b.rollout_logprobs == pytest.approx(a.rollout_logprobs, abs=1e-6)  # float32 in parquet


def test_verl_fixture_is_a_padded_batch():
    t = pq.read_table(VERL).to_pydict()
    assert len({len(p) for p in t["prompts"]}) == 1 and len({len(r) for r in t["responses"]}) == 1
    assert any(m[0] == 0 for m in t["attention_mask"]) and any(m[-1] == 0 for m in t["response_mask"])


def test_mask_with_a_hole(tmp_path, capsys):
    p = tmp_path / "holes.parquet"
    pq.write_table(pa.table({"prompts": [[0, 1, 2]], "responses": [[3, 4]], "rollout_log_probs": [[-0.5, -1.0]],
                             "attention_mask": [[1, 0, 1, 1, 1]]}), p)
    code, line = _err(_args(p), capsys, tmp_path)
    assert code == 2 and "holes.parquet:1: attention_mask: zeros inside the ones" in line


@pytest.mark.parametrize("path, spec", [
    (VERL, {}),
    (VERL, {"trace_format": "verl"}),
    (OPENRLHF, {"trace_fields": "sequence=sequences,completion_mask=action_mask,logprobs=rollout_log_probs"}),
])
def test_rollout_engine_on_dumps(path, spec):
    """Recomputed reference log-probs against the recorded ones, no engine run."""
    want, _ = rollout_compare(trace_path("qwen3_moe"))
    got, s = rollout_compare(path, **spec)
    w, g = want["baseline"]["groups"]["completion"], got["baseline"]["groups"]["completion"]
    assert g["tokens"] == w["tokens"] == 429
    assert 1e-6 < g["k3"]["mean"] == pytest.approx(w["k3"]["mean"], rel=1e-2)
    assert s.inputs()["trace"]["format"] in ("verl", "openrlhf", "fields")


def test_trl_names_in_jsonl(tmp_path):
    rows = [json.loads(x) for x in open(trace_path("qwen3_moe"))][:3]
    p = tmp_path / "trl.jsonl"
    p.write_text("".join(json.dumps({"prompt_ids": r["prompt_ids"], "completion_ids": r["completion_ids"],
                                     "sampling_per_token_logps": r["rollout_logprobs"]}) + "\n" for r in rows))
    t = load_any(str(p))
    assert t.format == "trl" and t.samples[2].rollout_logprobs == rows[2]["rollout_logprobs"]


def _err(args, capsys, tmp_path):
    out = tmp_path / "r.json"
    code = main([*args, "--out", str(out), "-q"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("bisect: error: ") and "Traceback" not in err[0] and not out.exists(), err
    return code, err[0]


def _args(trace, *extra):
    return ["compare", "--ref", f"hf:{model_dir('qwen3_moe')}", "--engine", "rollout", "--trace", str(trace), *extra]


def test_parquet_with_no_known_fields(tmp_path, capsys):
    p = tmp_path / "odd.parquet"
    pq.write_table(pa.table({"input_tokens": [[1, 2]], "output_tokens": [[3]], "lp": [[-0.5]]}), p)
    code, line = _err(_args(p), capsys, tmp_path)
    assert code == 2 and "no known rollout fields; found: input_tokens, output_tokens, lp" in line
    assert "--trace-fields" in line and "verl: prompts, responses, rollout_log_probs" in line


def test_jsonl_with_no_known_fields(tmp_path, capsys):
    p = tmp_path / "odd.jsonl"
    p.write_text('{"input_tokens": [1, 2], "output_tokens": [3]}\n')
    code, line = _err(_args(p), capsys, tmp_path)
    assert code == 2 and "found: input_tokens, output_tokens" in line


def test_trace_fields_map_any_names(tmp_path, capsys):
    p = tmp_path / "odd.parquet"
    pq.write_table(pa.table({"input_tokens": [[1, 2]], "output_tokens": [[3, 4]], "lp": [[-0.5, -1.0]]}), p)
    t = load_any(str(p), None, "prompt=input_tokens,completion=output_tokens,logprobs=lp")
    assert t.samples[0].ids == [1, 2, 3, 4] and t.samples[0].rollout_logprobs == [-0.5, -1.0]
    code, line = _err(_args(p, "--trace-fields", "prompt=input_tokens,completion=nope"), capsys, tmp_path)
    assert code == 2 and "no field nope; found: input_tokens, output_tokens, lp" in line


def test_wrong_preset(tmp_path, capsys):
    code, line = _err(_args(OPENRLHF, "--trace-format", "verl"), capsys, tmp_path)
    assert code == 2 and "not a verl dump: it lacks prompts, responses" in line and "found: sequences" in line


def test_bad_value_names_the_dump_field(tmp_path, capsys):
    p = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"prompts": [[1, 2]], "responses": [[3, 4]], "rollout_log_probs": [[-0.5]]}), p)
    code, line = _err(_args(p), capsys, tmp_path)
    assert code == 2 and "bad.parquet:1: rollout_log_probs has 1 entries, expected 2" in line


def test_not_parquet_nor_text(tmp_path, capsys):
    p = tmp_path / "x.parquet"
    p.write_bytes(b"PAR1" + bytes(range(256)) * 4)
    code, line = _err(_args(p), capsys, tmp_path)
    assert code == 2 and "not a readable parquet file" in line


# Found by a review with hostile dumps: each was read silently (a wrong trace) or crashed.
def _verl(tmp_path, name="d.parquet", **over):
    cols = {"prompts": [[0, 0, 5, 6, 7]], "responses": [[8, 9, 0]], "rollout_log_probs": [[-0.5, -1.0, 0.0]],
            "attention_mask": [[0, 0, 1, 1, 1, 1, 1, 0]], "response_mask": [[1, 1, 0]]}
    cols.update(over)
    p = tmp_path / name
    pq.write_table(pa.table(cols), p)
    return p


def test_a_padded_verl_row_is_cut_and_messages_name_the_dump_field_and_index(tmp_path, capsys):
    t = load_any(str(_verl(tmp_path)))
    assert (t.samples[0].prompt_ids, t.samples[0].completion_ids, t.samples[0].rollout_logprobs) == ([5, 6, 7], [8, 9], [-0.5, -1.0])
    # an id outside the vocabulary: named by the dump's field and its index before the padding was cut
    code, line = _err(_args(_verl(tmp_path, "oov.parquet", prompts=[[0, 0, 5, 999, 7]])), capsys, tmp_path)
    assert code == 2 and "oov.parquet:1: prompts[3] is 999, outside the model's vocabulary" in line


@pytest.mark.parametrize("over, words", [
    ({"attention_mask": [[1, 1, 1, 0, 0, 1, 1, 0]]}, "attention_mask: zeros after the prompt's ones, at attention_mask[3]"),
    ({"response_mask": [[1, 2, 0]]}, "response_mask[1] is 2, expected 0 or 1"),
    ({"response_mask": [[1.0, 0.5, 0.0]]}, "response_mask[1] is 0.5, expected 0 or 1"),
    ({"attention_mask": [[0, 0, 1, 1, 1, 1, None, 0]]}, "attention_mask[6] is null, expected 0 or 1"),
    ({"prompts": [[0, 0, 5, -3, 7]]}, "prompts[3] is -3, expected a non-negative integer"),
    ({"prompts": [[b"0", b"1", b"5", b"6", b"7"]]}, "prompts[2] is b'5', expected a non-negative integer"),
])
def test_bad_verl_rows_are_one_line_errors(tmp_path, capsys, over, words):
    code, line = _err(_args(_verl(tmp_path, **over)), capsys, tmp_path)
    assert code == 2 and words in line, line


def test_padding_ids_cut_by_a_mask_are_not_checked(tmp_path):
    """Some dumps pad with -1: the mask cuts them before the ids are checked."""
    t = load_any(str(_verl(tmp_path, prompts=[[-1, -1, 5, 6, 7]], responses=[[8, 9, -1]])))
    assert (t.samples[0].prompt_ids, t.samples[0].completion_ids) == ([5, 6, 7], [8, 9])


def test_bad_openrlhf_rows_name_the_dump_fields(tmp_path, capsys):
    rows = [{"sequences": [5, True, 7, 8, 9], "action_mask": [1, 1], "rollout_log_probs": [-0.5, -1.0]},
            {"sequences": None, "action_mask": [1, 1], "rollout_log_probs": [-0.5, -1.0]},
            {"sequences": [5, 6, 7, 8, 9], "action_mask": [1, "1"], "rollout_log_probs": [-0.5, -1.0]}]
    for row, words in zip(rows, ["sequences[1] is true, expected a non-negative integer",
                                 "sequences must be a list of token ids, got NoneType",
                                 'action_mask[1] is "1", expected 0 or 1']):
        p = tmp_path / "o.jsonl"
        p.write_text(json.dumps(row) + "\n")
        code, line = _err(_args(p), capsys, tmp_path)
        assert code == 2 and words in line, line


def test_trace_fields_name_every_field_once_and_exclude_a_preset(tmp_path, capsys):
    p = tmp_path / "f.jsonl"
    p.write_text(json.dumps({"a": [1, 2], "b": [3, 4], "lp": [-0.5, -1.0], "cm": [1, 0]}) + "\n")
    code, line = _err(_args(p, "--trace-fields", "prompt=a,completion=b,logprobs=lp,completion_mask=typo"), capsys, tmp_path)
    assert code == 2 and "no field typo; found: a, b, lp, cm" in line  # a mask named wrong is not ignored
    code, line = _err(_args(p, "--trace-fields", "prompt=a,completion=b,prompt=lp"), capsys, tmp_path)
    assert code == 2 and "prompt is given twice" in line
    code, line = _err(_args(p, "--trace-format", "trl", "--trace-fields", "prompt=a,completion=b"), capsys, tmp_path)
    assert code == 2 and "give --trace-format trl or --trace-fields, not both" in line
    t = load_any(str(p), None, "prompt=a,completion=b,logprobs=lp,completion_mask=cm")
    assert t.samples[0].completion_ids == [3] and t.samples[0].rollout_logprobs == [-0.5]


def test_a_preset_dump_without_log_probs_names_the_presets_field(tmp_path, capsys):
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({"prompt_ids": [1, 2], "completion_ids": [3, 4]}) + "\n")
    code, line = _err(_args(p, "--trace-format", "trl"), capsys, tmp_path)
    assert code == 2 and "needs the rollout's log-probs (sampling_per_token_logps)" in line, line

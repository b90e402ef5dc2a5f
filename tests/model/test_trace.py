"""Trace loading: what a user sees when a trace is malformed, and the position convention."""

import hashlib
import json
from pathlib import Path

import pytest
import torch

from numbisect.common.errors import ExitCode, InputError
from numbisect.model.trace import Sample, check_vocab, load_trace

GOOD = {"prompt_ids": [1, 2, 3], "completion_ids": [4, 5], "rollout_logprobs": [-0.5, -1.0]}
FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "traces"


def write(tmp_path, lines, name="t.jsonl"):
    text = "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n"
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def with_(**changes):
    obj = dict(GOOD)
    for key, value in changes.items():
        if value is ...:
            del obj[key]
        else:
            obj[key] = value
    return obj


def test_good_trace_loads(tmp_path):
    path = write(tmp_path, [GOOD, "", with_(rollout_logprobs=...)])
    trace = load_trace(path)
    assert trace.path == str(path)
    assert trace.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert [s.line for s in trace.samples] == [1, 3]
    s = trace.samples[0]
    assert s.ids == [1, 2, 3, 4, 5]
    assert s.rollout_logprobs == [-0.5, -1.0]
    assert trace.samples[1].rollout_logprobs is None


def test_extra_fields_ignored_and_tiny_positive_logprob_allowed(tmp_path):
    trace = load_trace(write(tmp_path, [with_(reward=1.0, rollout_logprobs=[5e-5, -1.0])]))
    assert trace.samples[0].rollout_logprobs == [5e-5, -1.0]


def test_bom_and_crlf(tmp_path):
    path = tmp_path / "win.jsonl"
    body = (json.dumps(GOOD) + "\r\n" + "\r\n" + json.dumps(GOOD) + "\r\n").encode()
    path.write_bytes(b"\xef\xbb\xbf" + body)
    trace = load_trace(path)
    assert [s.line for s in trace.samples] == [1, 3]
    assert trace.samples[1].prompt_ids == [1, 2, 3]


@pytest.mark.parametrize(
    "bad, problem",
    [
        ("{not json", "invalid JSON"),
        ("[1, 2, 3]", "expected a JSON object"),
        (with_(prompt_ids=...), "missing prompt_ids"),
        (with_(prompt_ids=[]), "prompt_ids is empty"),
        (with_(prompt_ids="1 2 3"), "prompt_ids must be a list"),
        (with_(prompt_ids=[1, 2.0, 3]), "prompt_ids[1] is 2.0"),
        (with_(prompt_ids=[1, True, 3]), "prompt_ids[1] is true"),
        (with_(prompt_ids=[1, -2, 3]), "prompt_ids[1] is -2"),
        (with_(completion_ids=...), "missing completion_ids"),
        (with_(completion_ids=[], rollout_logprobs=[]), "completion_ids is empty"),
        (with_(completion_ids=[4, "5"]), 'completion_ids[1] is "5"'),
        (with_(rollout_logprobs=[-0.5]), "rollout_logprobs has 1 entries, expected 2"),
        (with_(rollout_logprobs=[-0.5, 0.3]), "rollout_logprobs[1] is 0.3"),
        (with_(rollout_logprobs=[-0.5, "x"]), "rollout_logprobs[1]"),
        ('{"prompt_ids": [1], "completion_ids": [2], "rollout_logprobs": [NaN]}', "finite"),
        (with_(rollout_logprobs=-1.0), "rollout_logprobs must be a list"),
        (with_(groups=[0, 1]), "groups must be an object"),
        (with_(groups={"image": [0, 1]}), "groups['image'] has 2 flags, expected 5"),
        (with_(groups={"image": [0, 1, 2, 0, 0]}), "groups['image'][2] is 2"),
        (with_(groups={"prompt": [0, 0, 0, 0, 0]}), "reserved"),
    ],
)
def test_malformed_line_names_file_line_and_problem(tmp_path, bad, problem):
    path = write(tmp_path, [GOOD, GOOD, bad])
    with pytest.raises(InputError) as exc:
        load_trace(path)
    msg = str(exc.value)
    assert msg.startswith(f"{path}:3: "), msg
    assert problem in msg, msg
    assert exc.value.code == ExitCode.USAGE


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(InputError, match="no such trace file"):
        load_trace(tmp_path / "nope.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    with pytest.raises(InputError, match="no samples"):
        load_trace(empty)


def test_a_trace_over_the_limit_is_refused_unread_and_its_name_escaped(tmp_path, monkeypatch):
    from numbisect.model import trace as T

    path = write(tmp_path, [GOOD] * 50, name="t\x1b[31m.jsonl")
    monkeypatch.setattr(T, "TRACE_LIMIT", 100)
    with pytest.raises(InputError) as e:
        load_trace(path)
    assert "larger than" in e.value.message and "\x1b" not in e.value.message
    monkeypatch.setattr(T, "TRACE_LIMIT", 10**6)
    assert len(load_trace(path).samples) == 50


def test_invalid_utf8_names_line(tmp_path):
    path = tmp_path / "bin.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n\xff\xfe\n")
    with pytest.raises(InputError, match=r":2: not valid UTF-8"):
        load_trace(path)


def test_position_masks():
    # ids = [10, 11, 12 | 13, 14]; predicted positions predict tokens 1..4
    s = Sample(prompt_ids=[10, 11, 12], completion_ids=[13, 14],
               groups={"image": [1, 1, 0, 1, 0]})
    assert s.position_mask("completion").tolist() == [False, False, True, True]
    assert s.position_mask("prompt").tolist() == [True, True, False, False]
    assert s.position_mask("all").tolist() == [True, True, True, True]
    # token 0 is never predicted, so its flag does not show
    assert s.position_mask("image").tolist() == [True, False, True, False]
    assert s.position_mask("completion").dtype == torch.bool
    with pytest.raises(InputError, match="unknown token group 'video'.*image"):
        s.position_mask("video")


def test_groups_missing_in_some_samples_are_empty(tmp_path):
    trace = load_trace(write(tmp_path, [with_(groups={"image": [0, 1, 1, 0, 0]}), GOOD]))
    assert trace.group_names() == ["image"]
    assert trace.samples[1].position_mask("image").tolist() == [False] * 4


def test_check_vocab(tmp_path):
    path = write(tmp_path, [GOOD, with_(completion_ids=[4, 700])])
    trace = load_trace(path)
    check_vocab(trace, 701)
    with pytest.raises(InputError) as exc:
        check_vocab(trace, 512)
    msg = str(exc.value)
    assert msg.startswith(f"{path}:2: ")
    assert "700" in msg and "512" in msg


@pytest.mark.parametrize("name", ["qwen3.jsonl", "qwen3_moe.jsonl"])
def test_fixture_traces_load(name):
    if not (FIXTURES / name).exists():
        pytest.skip("fixture trace not built")
    trace = load_trace(FIXTURES / name)
    assert trace.samples
    for s in trace.samples:
        assert len(s.position_mask("completion")) == len(s.ids) - 1

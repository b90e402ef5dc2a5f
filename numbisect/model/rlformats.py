"""Rollout dumps of RL frameworks as traces: other field names, JSONL or parquet.

A dump holds one rollout per JSON line or parquet row: the prompt's token ids, the
response's token ids and the log-prob the rollout engine gave each response token.
Frameworks name these fields differently; a preset names them, and `--trace-fields`
names them for any other dump:

    --trace-fields prompt=FIELD,completion=FIELD,logprobs=FIELD
    --trace-fields sequence=FIELD,completion_mask=FIELD,logprobs=FIELD

The second form is for dumps that keep prompt and response as one sequence: the
response is the last len(completion_mask) ids, of which the mask's leading ones are
real (trailing zeros are padding, cut from the ids and the log-probs alike).
Padded batch dumps may also name `attention_mask=FIELD` (one flag per prompt and
response id: leading zeros are left padding of the prompt, trailing zeros right
padding of the response) and, in the first form, `completion_mask=FIELD`; masks
are applied when the record has them.

1. `load_any` picks the reader: numbisect JSONL as before; a preset or a field map
   when given; otherwise the first preset whose fields the file has.
2. Each record is mapped to the numbisect fields and validated by `trace` (the
   problem is reported as `FILE:ROW: ...` with the dump's own field name).
"""

from __future__ import annotations

import hashlib
import json
import os

from numbisect.common.errors import InputError
from numbisect.common.safeio import check_input
from numbisect.common.textsafe import path_text
from numbisect.model.trace import Trace, load_trace, read_trace_bytes, sample_from_json, show

# Where each preset's names come from (field names in the frameworks' own code):
# - verl: the DataProto batch keys its trainer keeps per rollout: `prompts` and
#   `responses` (token ids; prompts left-padded, responses right-padded),
#   `rollout_log_probs` (the rollout engine's log-probs, set when the rollout is asked
#   to return them), `response_mask` and `attention_mask`, verl/trainer/ppo/ray_trainer.py.
# - openrlhf: OpenRLHF's rollout `Sample` / `Experience`: `sequences` (prompt then
#   response), `action_mask` (over the response), `rollout_log_probs` (vLLM's, used
#   for its vLLM importance-sampling correction), openrlhf/trainer/ppo_utils.
# - trl: TRL's GRPOTrainer outputs of `_generate_and_score_completions`: `prompt_ids`,
#   `completion_ids` and `sampling_per_token_logps` (the vLLM sampler's log-probs),
#   trl/trainer/grpo_trainer.py.
PRESETS: dict[str, dict[str, str]] = {
    "numbisect": {"prompt": "prompt_ids", "completion": "completion_ids", "logprobs": "rollout_logprobs"},
    "verl": {"prompt": "prompts", "completion": "responses", "logprobs": "rollout_log_probs",
             "completion_mask": "response_mask", "attention_mask": "attention_mask"},
    "openrlhf": {"sequence": "sequences", "completion_mask": "action_mask", "logprobs": "rollout_log_probs",
                 "attention_mask": "attention_mask"},
    "trl": {"prompt": "prompt_ids", "completion": "completion_ids", "logprobs": "sampling_per_token_logps"},
}
ROLES = ("prompt", "completion", "sequence", "completion_mask", "attention_mask", "logprobs")


def parse_fields(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in text.split(","):
        role, sep, name = part.partition("=")
        role, name = role.strip(), name.strip()
        if not sep or not name or role not in ROLES:
            raise InputError(f"bad --trace-fields {text!r}: expected ROLE=FIELD pairs with ROLE one of {', '.join(ROLES)}")
        if role in out:
            raise InputError(f"bad --trace-fields {text!r}: {role} is given twice")
        out[role] = name
    if "sequence" in out:
        if "completion_mask" not in out:
            raise InputError("--trace-fields: sequence=FIELD needs completion_mask=FIELD (which of its ids are the response)")
    elif not {"prompt", "completion"} <= set(out):
        raise InputError("--trace-fields needs prompt=FIELD and completion=FIELD (or sequence= and completion_mask=)")
    return out


def _required(fields: dict[str, str]) -> list[str]:
    roles = ("sequence", "completion_mask") if "sequence" in fields else ("prompt", "completion")
    return [fields[r] for r in roles]


def _ones(mask: list, name: str, leading_pad: bool, offset: int = 0) -> tuple[int, int]:
    """(start, end) of the run of ones in a 0/1 mask: zeros only before it, the ones
    reaching the end (`leading_pad`), or zeros only after it. `offset`: the index of
    mask[0] in the file's field, for messages."""
    for i, m in enumerate(mask):
        if isinstance(m, str) or m not in (0, 1):
            raise ValueError(f"{name}[{i + offset}] is {show(m)}, expected 0 or 1")
    flags = [bool(m) for m in mask]
    if True not in flags:  # all padding: nothing left (the trace then says what is empty)
        return (len(flags), len(flags)) if leading_pad else (0, 0)
    start = flags.index(True)
    end = start
    while end < len(flags) and flags[end]:
        end += 1
    where = "start" if leading_pad else "end"
    if any(flags[end:]) or (start and not leading_pad):
        raise ValueError(f"{name}: zeros inside the ones (only padding at the {where} is supported)")
    if leading_pad and end < len(flags):
        raise ValueError(f"{name}: zeros after the prompt's ones, at {name}[{end + offset}] (a prompt may be padded at its start only)")
    return start, end


def _check_list(ids, name: str) -> None:
    if not isinstance(ids, list):
        raise ValueError(f"{name} must be a list of token ids, got {type(ids).__name__}")


def _check_ids(ids: list, name: str, offset: int) -> None:
    """The ids the masks keep: non-negative integers, named by the dump's own field and
    index (`offset`: the index of ids[0] there). Padding cut by a mask is not checked."""
    for i, x in enumerate(ids):
        if not isinstance(x, int) or isinstance(x, bool) or x < 0:
            raise ValueError(f"{name}[{i + offset}] is {show(x)}, expected a non-negative integer")


def is_parquet(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"PAR1"
    except OSError:
        return False


def read_records(path: str) -> tuple[list[dict], bytes]:
    """(records, file bytes) of a JSONL or parquet file."""
    data = read_trace_bytes(path, "a trace file")
    if data[:4] == b"PAR1":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise InputError(f"{path_text(path)}: reading parquet needs pyarrow (pip install pyarrow)") from None
        try:
            return pq.read_table(path).to_pylist(), data
        except Exception as e:
            raise InputError(f"{path_text(path)}: not a readable parquet file: {str(e).splitlines()[0]}") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise InputError(f"{path_text(path)}: neither parquet nor UTF-8 JSONL") from None
    rows = []
    for line, raw in enumerate(text.split("\n"), start=1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise InputError(f"{path_text(path)}:{line}: invalid JSON: {getattr(e, 'msg', e)}") from None
        if not isinstance(obj, dict):
            raise InputError(f"{path_text(path)}:{line}: expected a JSON object")
        obj["__line__"] = line
        rows.append(obj)
    return rows, data


def _found(rows: list[dict]) -> list[str]:
    names: list[str] = []
    for r in rows[:20]:
        names += [k for k in r if k != "__line__" and k not in names]
    return names


def detect(path: str, rows: list[dict]) -> tuple[str, dict[str, str]]:
    """The first preset whose required fields the first record has, or a one-line error."""
    if not rows:
        raise InputError(f"{path_text(path)}: no samples (the file is empty)")
    for with_logprobs in (True, False):  # prefer the preset whose log-prob field is there too
        for name, fields in PRESETS.items():
            need = _required(fields) + ([fields["logprobs"]] if with_logprobs else [])
            if all(f in rows[0] for f in need):
                return name, fields
    found = ", ".join(_found(rows)) or "(none)"
    known = "; ".join(f"{n}: {', '.join(_required(f) + [f['logprobs']])}" for n, f in PRESETS.items())
    raise InputError(
        f"{path_text(path)}: no known rollout fields; found: {found}",
        hint=f"presets: {known}; or name them with --trace-fields prompt=...,completion=...,logprobs=...",
    )


def _list(x):
    """Parquet list columns come back as lists; numpy arrays (pandas dumps) too."""
    return x.tolist() if hasattr(x, "tolist") and not isinstance(x, (int, float)) else x


def to_native(rec: dict, fields: dict[str, str]) -> dict:
    """One record in numbisect's field names."""
    missing = [f for f in _required(fields) if f not in rec]
    if missing:
        raise ValueError(f"missing {', '.join(missing)}")
    lps = _list(rec[fields["logprobs"]]) if fields.get("logprobs") in rec else None
    if "sequence" in fields:
        seq, cm_raw = _list(rec[fields["sequence"]]), _list(rec[fields["completion_mask"]])
        _check_list(seq, fields["sequence"])
        n_resp = len(cm_raw) if isinstance(cm_raw, list) else 0
        if not 0 < n_resp < len(seq):
            raise ValueError(f"{fields['completion_mask']} must be a list shorter than {fields['sequence']} (one flag per response token)")
        prompt, completion = seq[: len(seq) - n_resp], seq[len(seq) - n_resp :]
        names = {"prompt_ids": (fields["sequence"], 0), "completion_ids": (fields["sequence"], len(prompt))}
    else:
        prompt, completion = _list(rec[fields["prompt"]]), _list(rec[fields["completion"]])
        _check_list(prompt, fields["prompt"])
        _check_list(completion, fields["completion"])
        names = {"prompt_ids": (fields["prompt"], 0), "completion_ids": (fields["completion"], 0)}
    n_comp = len(completion)
    am_name = fields.get("attention_mask")
    am = _list(rec.get(am_name)) if am_name in rec else None
    if am is not None:
        if not isinstance(am, list) or len(am) != len(prompt) + len(completion):
            raise ValueError(f"{am_name} must have one flag per prompt and response token")
        start, _ = _ones(am[: len(prompt)], am_name, leading_pad=True)
        prompt = prompt[start:]
        names["prompt_ids"] = (names["prompt_ids"][0], names["prompt_ids"][1] + start)
        _, n_comp = _ones(am[len(am) - len(completion) :], am_name, leading_pad=False, offset=len(am) - len(completion))
    cm_name = fields.get("completion_mask")
    cm = _list(rec.get(cm_name)) if cm_name in rec else None
    if cm is not None:
        if not isinstance(cm, list) or len(cm) != len(completion):
            raise ValueError(f"{cm_name} must have one flag per response token")
        n_comp = min(n_comp, _ones(cm, cm_name, leading_pad=False)[1])
    if isinstance(lps, list) and len(lps) == len(completion):
        lps = lps[:n_comp]
    completion = completion[:n_comp]
    _check_ids(prompt, *names["prompt_ids"])
    _check_ids(completion, *names["completion_ids"])
    obj = {"prompt_ids": prompt, "completion_ids": completion}
    if lps is not None:
        obj["rollout_logprobs"] = lps
    names["rollout_logprobs"] = (fields.get("logprobs", "rollout_logprobs"), 0)
    obj["__source__"] = names
    return obj


def _rename(msg: str, fields: dict[str, str]) -> str:
    for role, native in (("prompt", "prompt_ids"), ("completion", "completion_ids"), ("logprobs", "rollout_logprobs")):
        if role in fields and fields[role] != native:
            msg = msg.replace(native, fields[role])
    return msg


def load_rollouts(path: str, fmt: str | None = None, fields_text: str | None = None) -> Trace:
    rows, data = read_records(path)
    if fields_text:
        if fmt and fmt != "numbisect":
            raise InputError(f"give --trace-format {fmt} or --trace-fields, not both (--trace-fields names every field)")
        fields, fmt = parse_fields(fields_text), None
        if not rows:
            raise InputError(f"{path_text(path)}: no samples (the file is empty)")
        missing = [f for f in fields.values() if f not in rows[0]]  # every field named must be there
        if missing:
            raise InputError(f"{path_text(path)}: no field {', '.join(missing)}; found: {', '.join(_found(rows)) or '(none)'}")
    elif fmt:
        fields = PRESETS[fmt]
        if rows and not all(f in rows[0] for f in _required(fields)):
            raise InputError(
                f"{path_text(path)}: not a {fmt} dump: it lacks {', '.join(f for f in _required(fields) if f not in rows[0])}; "
                f"found: {', '.join(_found(rows)) or '(none)'}"
            )
    else:
        fmt, fields = detect(path, rows)
    samples = []
    for i, rec in enumerate(rows):
        where = rec.pop("__line__", i + 1)
        try:
            native = to_native(rec, fields)
            source = native.pop("__source__", None)
            samples.append(sample_from_json(native, where, os.path.dirname(os.path.abspath(path))))
            samples[-1].source = source
        except ValueError as e:
            raise InputError(f"{path_text(path)}:{where}: {_rename(str(e), fields)}") from None
    if not samples:
        raise InputError(f"{path_text(path)}: no samples (the file is empty)")
    return Trace(samples=samples, path=path, sha256=hashlib.sha256(data).hexdigest(), format=fmt or "fields")


def load_any(path: str, fmt: str | None = None, fields_text: str | None = None) -> Trace:
    """A trace from any supported file; numbisect JSONL keeps its own reader and errors."""
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        check_input(path, "trace")  # a FIFO would hang and a device never end: refused here
    if fmt is not None and fmt not in PRESETS:
        raise InputError(f"unknown --trace-format {fmt!r}; choose one of {', '.join(PRESETS)}")
    if fmt in (None, "numbisect") and not fields_text and not is_parquet(path) and not _foreign_jsonl(path):
        return load_trace(path)
    return load_rollouts(path, fmt, fields_text)


_FIRST_LINE_LIMIT = 64 * 2**20  # a first record longer than this is no rollout dump's


def _foreign_jsonl(path: str) -> bool:
    """A JSONL file whose first record is not in numbisect's names (no prompt_ids and
    completion_ids, or another preset's log-prob field instead of rollout_logprobs)."""
    try:
        with open(path, "rb") as f:
            seen = 0
            while seen < _FIRST_LINE_LIMIT:  # line by line, bounded (a file of zeros is one endless line)
                raw = f.readline(_FIRST_LINE_LIMIT)
                seen += len(raw)
                if not raw:
                    break
                if len(raw) >= _FIRST_LINE_LIMIT and not raw.endswith(b"\n"):
                    return False  # numbisect's own reader refuses it in one line
                if raw.strip():
                    obj = json.loads(raw.decode("utf-8-sig"))
                    if not isinstance(obj, dict):
                        return False
                    if "prompt_ids" not in obj and "completion_ids" not in obj:
                        return True
                    other = {f["logprobs"] for f in PRESETS.values()} - {"rollout_logprobs"}
                    return "rollout_logprobs" not in obj and any(k in obj for k in other)
    except (OSError, ValueError, RecursionError):
        return False
    return False

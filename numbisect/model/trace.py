"""Token traces: the samples both backends are run over, read from JSONL.

One JSON object per line:

    {"prompt_ids": [..], "completion_ids": [..],
     "rollout_logprobs": [..],          # optional, one per completion token
     "groups": {"image": [0, 1, ..]},   # optional, one 0/1 flag per token
     "images": {"pixel_values": "pix.safetensors#s0",   # optional, multimodal models
                "image_grid_thw": [[1, 4, 4]]}}

Positions: a sample with T token ids has T-1 predicted positions; element j of a
per-token array (log-probs, k3) is token ids[j+1] predicted from ids[:j+1].
Completion positions are tokens at index >= len(prompt_ids); prompt positions
are tokens 1..len(prompt_ids)-1.

1. `load_trace` reads and validates a file; every problem is an InputError
   naming `path:line`.
2. `check_vocab` checks the ids against a model's vocabulary once it is known.
3. `Sample.position_mask` selects completion, prompt, all or a token group.

Images (for multimodal models): `pixel_values` names a float tensor of shape
`[patches, features]`, the model's processor output, in a `.npy` file or under a key
of a `.safetensors` file (`FILE#KEY`), relative to the trace file; `image_grid_thw`
holds one `[t, h, w]` per image, with t*h*w patches each. The prompt holds the
model's image placeholder tokens (see `groups.check_images`).
RL frameworks' rollout dumps (other field names, parquet) are read by `rlformats`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from numbisect.common.errors import InputError
from numbisect.common.safeio import MB, read_bytes
from numbisect.common.textsafe import printable

BUILTIN_GROUPS = ("completion", "prompt", "all")
LOGPROB_SLACK = 1e-4  # rollout log-probs up to this far above 0 are taken as rounding


# A trace larger than this is refused before it is read: token ids of ~100M tokens as JSON
# (images are files of their own).
TRACE_LIMIT = 1024 * MB


@dataclass
class Sample:
    """One prompt and the completion the engine sampled for it."""

    prompt_ids: list[int]
    completion_ids: list[int]
    rollout_logprobs: list[float] | None = None  # one per completion token
    groups: dict[str, list[int]] = field(default_factory=dict)  # name -> 0/1 per token
    line: int = 0  # 1-based line number in the file
    images: "Images | None" = None  # pixel inputs of a multimodal sample
    # Rollout dumps: (field name, index of id 0) in the file for prompt_ids / completion_ids,
    # so messages name the dump's own field and position (left padding cut included).
    source: dict | None = None

    @property
    def ids(self) -> list[int]:
        """Prompt then completion token ids."""
        return self.prompt_ids + self.completion_ids

    def position_mask(self, which: str) -> torch.Tensor:
        """Bool mask over the T-1 predicted positions.

        `which` is "completion", "prompt", "all" or a token group name.
        """
        t = torch.arange(1, len(self.prompt_ids) + len(self.completion_ids))
        if which == "completion":
            return t >= len(self.prompt_ids)
        if which == "prompt":
            return t < len(self.prompt_ids)
        if which == "all":
            return torch.ones_like(t, dtype=torch.bool)
        if which not in self.groups:
            available = ", ".join([*BUILTIN_GROUPS, *sorted(self.groups)])
            raise InputError(f"unknown token group {which!r} (available: {available})")
        return torch.tensor(self.groups[which][1:], dtype=torch.int64) == 1


@dataclass
class Images:
    """The pixel inputs of one sample: every image's patches, concatenated."""

    pixel_values: torch.Tensor  # [patches, features] float32
    grid_thw: torch.Tensor  # [images, 3] int64; patches = sum of t*h*w
    source: str  # as written in the trace

    @property
    def patches(self) -> int:
        return int(self.grid_thw.prod(-1).sum())


@dataclass
class Trace:
    """The samples of one trace file, with the file's digest."""

    samples: list[Sample]
    path: str
    sha256: str
    format: str = "numbisect"  # or the rollout-dump preset / "fields" it was read with

    def group_names(self) -> list[str]:
        """Sorted names of the token groups any sample defines."""
        return sorted({name for s in self.samples for name in s.groups})


def show(x: object) -> str:
    """A value as JSON for a message; one JSON cannot hold (bytes, Decimal from parquet) as repr."""
    try:
        return json.dumps(x)
    except (TypeError, ValueError):
        return repr(x)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _token_ids(obj: dict, key: str) -> list[int]:
    """A required non-empty list of non-negative integer ids; problem raised as ValueError."""
    if key not in obj:
        raise ValueError(f"missing {key}")
    ids = obj[key]
    if not isinstance(ids, list):
        raise ValueError(f"{key} must be a list of token ids, got {type(ids).__name__}")
    if not ids:
        raise ValueError(f"{key} is empty (need at least one token)")
    for i, x in enumerate(ids):
        if not _is_int(x):
            raise ValueError(f"{key}[{i}] is {show(x)}, expected a non-negative integer")
        if x < 0:
            raise ValueError(f"{key}[{i}] is {x}: token ids must be non-negative")
    return ids


def _logprobs(obj: dict, n: int) -> list[float] | None:
    """Optional rollout log-probs, one finite value <= 0 per completion token."""
    lps = obj.get("rollout_logprobs")
    if lps is None:
        return None
    if not isinstance(lps, list):
        raise ValueError(f"rollout_logprobs must be a list of numbers, got {type(lps).__name__}")
    if len(lps) != n:
        raise ValueError(
            f"rollout_logprobs has {len(lps)} entries, expected {n} (one per completion token)"
        )
    out = []
    for i, x in enumerate(lps):
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            raise ValueError(f"rollout_logprobs[{i}] is {show(x)}, expected a number")
        if not math.isfinite(x):
            raise ValueError(f"rollout_logprobs[{i}] is {x}, expected a finite number")
        if x > LOGPROB_SLACK:
            raise ValueError(f"rollout_logprobs[{i}] is {x}: log-probs must be <= 0 (values above 0 are logits: "
                             "was the engine's logprobs_mode raw_logits or processed_logits? record raw_logprobs)")
        out.append(float(x))
    return out


def _groups(obj: dict, n: int) -> dict[str, list[int]]:
    """Optional token groups: name -> one 0/1 flag per prompt+completion token."""
    groups = obj.get("groups")
    if groups is None:
        return {}
    if not isinstance(groups, dict):
        raise ValueError(f"groups must be an object of name -> flags, got {type(groups).__name__}")
    for name, flags in groups.items():
        if not name:
            raise ValueError("groups: a group name is empty")
        if name in BUILTIN_GROUPS:
            raise ValueError(f"groups: the name {name!r} is reserved")
        if not isinstance(flags, list):
            raise ValueError(f"groups[{name!r}] must be a list of 0/1 flags")
        if len(flags) != n:
            raise ValueError(
                f"groups[{name!r}] has {len(flags)} flags, expected {n} "
                "(one per prompt and completion token)"
            )
        for i, x in enumerate(flags):
            if not _is_int(x) or x not in (0, 1):
                raise ValueError(f"groups[{name!r}][{i}] is {show(x)}, expected 0 or 1")
    return groups


def _read_pixels(ref: str, base: str) -> torch.Tensor:
    """A float tensor from `FILE.npy` or `FILE.safetensors#KEY` (no pickles)."""
    fname, _, key = ref.partition("#")
    path = fname if os.path.isabs(fname) else os.path.join(base, fname)
    if not os.path.isfile(path):
        raise ValueError(f"images.pixel_values: no such file {fname}")
    if path.endswith(".npy"):
        try:
            arr = np.load(path, allow_pickle=False)
        except Exception as e:
            raise ValueError(f"images.pixel_values: cannot read {fname}: {e}") from None
        t = torch.from_numpy(np.ascontiguousarray(arr))
    elif path.endswith(".safetensors"):
        from safetensors import safe_open

        try:
            with safe_open(path, framework="pt") as f:
                if not key or key not in f.keys():
                    raise ValueError(f"images.pixel_values: {fname} has no tensor {key!r} (keys: {', '.join(sorted(f.keys())[:8])})")
                t = f.get_tensor(key)
        except ValueError:
            raise
        except Exception as e:
            raise ValueError(f"images.pixel_values: cannot read {fname}: {e}") from None
    else:
        raise ValueError(f"images.pixel_values: {fname}: expected a .npy or .safetensors file")
    if t.dim() != 2 or not t.is_floating_point():
        raise ValueError(f"images.pixel_values: expected a 2-D float tensor [patches, features], got {tuple(t.shape)} {t.dtype}")
    return t.float()


def _images(obj: dict, base: str) -> Images | None:
    img = obj.get("images")
    if img is None:
        return None
    if not isinstance(img, dict) or not isinstance(img.get("pixel_values"), str) or "image_grid_thw" not in img:
        raise ValueError('images must be {"pixel_values": "FILE[#KEY]", "image_grid_thw": [[t, h, w], ...]}')
    grid = img["image_grid_thw"]
    if (not isinstance(grid, list) or not grid
            or not all(isinstance(g, list) and len(g) == 3 and all(_is_int(x) and x > 0 for x in g) for g in grid)):
        raise ValueError(f"images.image_grid_thw must be a list of [t, h, w] positive integers, got {show(grid)}")
    pix = _read_pixels(img["pixel_values"], base)
    out = Images(pixel_values=pix, grid_thw=torch.tensor(grid, dtype=torch.int64), source=img["pixel_values"])
    if pix.shape[0] != out.patches:
        raise ValueError(f"images: pixel_values has {pix.shape[0]} rows, image_grid_thw gives {out.patches} patches")
    return out


def sample_from_json(obj: object, line: int, base: str = ".") -> Sample:
    """One sample from its parsed JSON object (`line`: where it was read, for messages; `base`:
    the folder image paths are relative to); ValueError naming what is wrong."""
    if not isinstance(obj, dict):
        kind = "array" if isinstance(obj, list) else type(obj).__name__
        raise ValueError(f"expected a JSON object, got {kind}")
    prompt = _token_ids(obj, "prompt_ids")
    completion = _token_ids(obj, "completion_ids")
    return Sample(
        prompt_ids=prompt,
        completion_ids=completion,
        rollout_logprobs=_logprobs(obj, len(completion)),
        groups=_groups(obj, len(prompt) + len(completion)),
        line=line,
        images=_images(obj, base),
    )


def read_trace_bytes(path: str, what: str = "a JSONL trace file") -> bytes:
    """The bytes of a trace file through the one reader of inputs (common.safeio: a regular
    file, at most TRACE_LIMIT bytes), refused in one line where it cannot be read (a FIFO
    would hang and a device never end)."""
    if os.path.isdir(path):
        raise InputError(f"{printable(path)}: is a directory, expected {what}")
    if not os.path.lexists(path):
        raise InputError(f"{printable(path)}: no such trace file")
    return read_bytes(path, "trace", TRACE_LIMIT)


def load_trace(path: str | os.PathLike) -> Trace:
    """Read and validate a JSONL trace. Blank lines are skipped; extra fields ignored.

    Samples that lack a group another sample defines get it with all flags 0.
    """
    path = os.fspath(path)
    data = read_trace_bytes(path)
    shown = printable(path)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise InputError(f"{shown}:{line}: not valid UTF-8") from None

    samples = []
    for line, raw in enumerate(text.split("\n"), start=1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            raise InputError(
                f"{shown}:{line}: invalid JSON: {e.msg} (column {e.colno})"
            ) from None
        except ValueError as e:  # e.g. an integer with too many digits
            raise InputError(f"{shown}:{line}: invalid JSON: {e}") from None
        except RecursionError:
            raise InputError(f"{shown}:{line}: invalid JSON: nested too deeply") from None
        try:
            samples.append(sample_from_json(obj, line, os.path.dirname(os.path.abspath(path))))
        except ValueError as e:
            raise InputError(f"{shown}:{line}: {e}") from None
    if not samples:
        raise InputError(f"{shown}: no samples (the file is empty)")

    trace = Trace(samples=samples, path=path, sha256=hashlib.sha256(data).hexdigest())
    for name in trace.group_names():
        for s in samples:
            s.groups.setdefault(name, [0] * len(s.ids))
    return trace


def check_vocab(trace: Trace, vocab_size: int) -> None:
    """Raise InputError at the first token id >= vocab_size."""
    for s in trace.samples:
        for key in ("prompt_ids", "completion_ids"):
            name, offset = (s.source or {}).get(key, (key, 0))
            for i, x in enumerate(getattr(s, key)):
                if x >= vocab_size:
                    raise InputError(
                        f"{trace.path}:{s.line}: {name}[{i + offset}] is {x}, outside the model's "
                        f"vocabulary of {vocab_size} tokens",
                        hint="is the trace tokenized for this model?",
                    )


def samples_digest(samples) -> str:
    """SHA-256 of what a run reads of a trace: each sample's prompt and completion ids,
    rollout log-probs and token groups, in order. The file's own digest cannot tell two
    runs on one file apart that read other samples of it (`--trace-fields`,
    `--trace-format`): a trial log is resumed only where this one matches too."""
    h = hashlib.sha256()
    for s in samples:
        h.update(json.dumps([s.prompt_ids, s.completion_ids, s.rollout_logprobs,
                             sorted((k, list(v)) for k, v in (s.groups or {}).items())]).encode())
        h.update(b"\n")
    return h.hexdigest()

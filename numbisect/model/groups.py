"""Token groups from the model's config and the command line, and image checks.

1. `add_groups`: a trace may carry its own groups (`"groups"` per sample). On top of
   those, the tokens whose id is the config's `image_token_id` form the group `image`
   (when the trace has no `image` group and holds such a token), and each
   `--group-def NAME=ID[,ID]` makes a group of the tokens with those ids.
2. `check_images`: samples with pixel inputs need a model that takes images, and as
   many image placeholder tokens as their images give after the spatial merge.

A group holds positions whose *predicted* token is in it (see `trace.Sample`): the
first image token is predicted from the text before it, the others from image
positions.
"""

from __future__ import annotations

import hashlib
import json

from numbisect.common.errors import InputError
from numbisect.model.trace import BUILTIN_GROUPS, Trace


def image_token_id(config) -> int | None:
    for cfg in (config, config.get_text_config()):
        tok = getattr(cfg, "image_token_id", None)
        if isinstance(tok, int):
            return tok
    return None


def parse_group_defs(defs: list[str] | tuple[str, ...]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for d in defs:
        name, sep, ids = d.partition("=")
        name = name.strip()
        try:
            toks = [int(x) for x in ids.split(",")] if sep and ids.strip() else []
        except ValueError:
            toks = []
        if not name or not toks or any(t < 0 for t in toks):
            raise InputError(f"bad --group-def {d!r}: expected NAME=ID[,ID], e.g. image=151655")
        if name in BUILTIN_GROUPS:
            raise InputError(f"bad --group-def {d!r}: the name {name!r} is reserved")
        if name in out:
            raise InputError(f"--group-def {name} is given twice")
        out[name] = toks
    return out


def add_groups(trace: Trace, config, defs: dict[str, list[int]]) -> dict[str, str]:
    """Add the config's image group and the user's groups to every sample.

    Returns name -> where it came from ("trace", "config image_token_id 253", "--group-def").
    """
    origin = {name: "trace" for name in trace.group_names()}
    wanted = dict(defs)
    for name in defs:
        if name in origin:
            raise InputError(f"--group-def {name}: the trace already defines a group {name!r}")
    tok = image_token_id(config)
    if tok is not None and "image" not in origin and "image" not in wanted and any(tok in s.ids for s in trace.samples):
        wanted["image"] = [tok]
        origin["image"] = f"config image_token_id {tok}"
    for name, ids in wanted.items():
        chosen = set(ids)
        for s in trace.samples:
            s.groups[name] = [int(t in chosen) for t in s.ids]
        origin.setdefault(name, "--group-def")
    return origin


def check_images(trace: Trace, config, arch) -> None:
    """Refuse images for a text model, and a sample whose placeholders do not match its images."""
    tok = image_token_id(config)
    merge = getattr(getattr(config, "vision_config", None), "spatial_merge_size", 1) ** 2
    for s in trace.samples:
        n_tok = 0 if tok is None else s.prompt_ids.count(tok)
        if s.images is None:
            if arch.vision and n_tok:
                raise InputError(f"{trace.path}:{s.line}: {n_tok} image tokens (id {tok}) but no images on the sample")
            continue
        if not arch.vision:
            raise InputError(f"{trace.path}:{s.line}: the sample has images but {arch.name} is a text model")
        want = s.images.patches // merge
        if n_tok != want:
            raise InputError(
                f"{trace.path}:{s.line}: the prompt has {n_tok} image tokens (id {tok}), "
                f"image_grid_thw gives {want} ({s.images.patches} patches / {merge})"
            )


def inputs_digest(trace: Trace, defs) -> str | None:
    """sha256 of what decides the trace's metrics besides the file: the pixel tensors and
    the --group-def list (None when there are neither, so older trial logs still match)."""
    images = [s.images for s in trace.samples if s.images is not None]
    if not images and not defs:
        return None
    h = hashlib.sha256(json_bytes(sorted(defs)))
    for img in images:
        h.update(img.pixel_values.numpy().tobytes())
        h.update(img.grid_thw.numpy().tobytes())
    return h.hexdigest()


def json_bytes(x) -> bytes:
    return json.dumps(x).encode()

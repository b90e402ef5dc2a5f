"""The report: one versioned JSON document per run, written atomically.

Compatibility promise: `schema_version` is an integer. Fields are only added within a
version (readers must ignore unknown fields); a field removed or whose meaning changes
bumps the version. Sets that grow with the tool (unit kinds, backends, engine modes,
what-ifs) are open strings in the schema: a later version may add values within a
version, and readers show a value they do not know as it is. Closed sets (verdicts,
report kinds) only change with the version. This tool reads every version up to its own and refuses newer ones
with a message naming both. `numbisect/report/schemas/report-v1.json` is the JSON Schema.

Torch-free (`bisect report ...` reads reports without the models); a new report's
envelope and environment are made by `numbisect.pipeline.provenance.new_report`.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from numbisect import __version__
from numbisect.common.errors import InputError
from numbisect.common.safeio import depth_over, loads_json, read_text, write_text_atomic
from numbisect.common.textsafe import clip, printable

SCHEMA_VERSION = 1
SCHEMA_PATH = Path(__file__).parent / "schemas" / "report-v1.json"


def write_json_atomic(path: str | os.PathLike, obj) -> None:
    """Write `obj` as JSON through `safeio.write_text_atomic`: never a half-written file,
    and never a device or a link replaced by a regular file."""
    text = json.dumps(obj, indent=1, allow_nan=False) + "\n"
    try:
        write_text_atomic(path, text)
    except OSError as e:
        raise InputError(f"cannot write {path}: {e.strerror or e}") from None


def schema() -> dict:
    return json.loads(SCHEMA_PATH.read_text())


MAX_DEPTH = 64  # nesting a report may have (the tool writes at most 8 levels)


def validate(report: dict) -> list[str]:
    """Schema errors as 'path: message' lines (empty when valid), printable and clipped."""
    import jsonschema  # lazy: jsonschema loads only when this runs


    v = jsonschema.Draft202012Validator(schema())
    out = []
    for e in v.iter_errors(report):
        where = "/".join(str(p) for p in e.absolute_path) or "(top)"
        out.append(printable(f"{clip(where, 120)}: {clip(e.message, 200)}"))
    return out


def load_report(path: str | os.PathLike) -> dict:
    """Read and check a report; one clear InputError (printable, one line) for anything
    that is not one: a missing file, a directory, a FIFO or device (never read), a file
    over `safeio.JSON_LIMIT`, text that is not UTF-8 or not JSON, nesting deeper than
    `MAX_DEPTH`, an unsupported schema version, or a schema error."""
    name = printable(clip(os.fspath(path), 300))
    try:
        text = read_text(path, "report")
        obj = loads_json(text, name)
    except InputError as e:
        raise InputError(printable(e.message), e.hint) from None
    if not isinstance(obj, dict) or "schema_version" not in obj:
        raise InputError(f"{name}: not a numbisect report (no schema_version)")
    ver = obj["schema_version"]
    if isinstance(ver, bool) or not isinstance(ver, int) or ver < 1 or ver > SCHEMA_VERSION:
        raise InputError(
            f"{name}: report schema version {printable(clip(repr(ver), 40))} is not supported (this numbisect {__version__} reads 1..{SCHEMA_VERSION})"
        )
    if depth_over(obj, MAX_DEPTH):
        raise InputError(f"{name}: JSON nested deeper than {MAX_DEPTH} levels; not a numbisect report")
    try:
        errors = validate(obj)
    except RecursionError:
        raise InputError(f"{name}: JSON nested too deeply") from None
    if errors:
        raise InputError(f"{name}: not a valid v{ver} report: {errors[0]}" + (f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""))
    return obj


def command_line(argv: list[str] | None = None) -> list[str]:
    argv = list(sys.argv if argv is None else argv)
    if argv:
        argv[0] = "bisect"
    return argv

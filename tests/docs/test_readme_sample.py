"""README.md's sample of `bisect run` is what that command printed: the committed report
(`scripts/readme_sample.py`'s REPORT) is a run of the command the README quotes (and the
demo runs), and the README shows that report's summary, rendered by numbisect's own summary
code, cut only where it says `...`. No engine starts: the report is the run's."""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import readme_sample as R  # noqa: E402

from numbisect.report.summary import render  # noqa: E402

README = (ROOT / "README.md").read_text()


@pytest.fixture(scope="module")
def report() -> dict:
    return json.loads(R.REPORT.read_text())


def _quoted() -> list[str]:
    """The `bisect run` command README.md quotes, as argv."""
    block = README.split(R.BEGIN, 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return shlex.split(block.replace("\\\n", " "))


def test_the_committed_report_is_a_run_of_the_quoted_command(report):
    assert _quoted() == ["bisect", *R.COMMAND] == report["command"]
    assert report["kind"] == "run" and report["inputs"]["engine"]["backend"] == "vllm"


def test_the_quoted_command_is_the_demos_second(report):
    demo = (ROOT / "scripts" / "demo.sh").read_text()
    run = re.search(r"^\.venv/bin/bisect run (.*?)$(?<!\\)", demo, re.M | re.S).group(1)
    argv = shlex.split(run.replace("\\\n", " ").replace('"$M"', R.M).replace('"$T"', R.T).replace("$M", R.M).replace("$T", R.T))
    assert ["bisect", "run", *argv] == _quoted()


def test_the_readme_shows_the_reports_summary(report):
    assert R.readme_with(README, report) == README, "run: python scripts/readme_sample.py"


def test_the_sample_is_the_printed_summary_cut_only_at_dots(report):
    """Every sample line is a line of the whole summary, in order; `...` stands for lines left out."""
    whole = (render(report) + f"report: {report['command'][-1]}\n").splitlines()
    shown = R.sample(report).splitlines()
    it = iter(whole)
    for ln in shown:
        if ln == "..." or ln.endswith("; ..."):
            continue
        assert ln in it, ln  # consumes `whole` up to the line: order kept
    assert len(shown) < len(whole) and shown[0] == whole[0] and shown[-1] == whole[-1]

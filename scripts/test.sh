#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite, real vLLM-CPU tests included.
#   bash scripts/test.sh           everything (CI runs this), then the 30 slowest tests
#   bash scripts/test.sh --fast    only the tests that need no model (marker `engine` unset)
#   bash scripts/test.sh ARGS...   pytest ARGS (a single extra argument still runs the TP tests)
# The tensor-parallel tests start vLLM worker processes; they run in a pytest process of
# their own, after the suite (in the suite's process, beside its in-process engines, the
# TP engine's start-up failed).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
if [ "${1:-}" = "--fast" ]; then
    shift
    NUMBISECT_TEST_NO_MODELS=1 NUMBISECT_TP_TESTS=0 exec .venv/bin/python -m pytest -m "not engine" --durations=10 "$@"
fi
NUMBISECT_TP_TESTS=0 .venv/bin/python -m pytest --durations=30 "$@"
if [ "${NUMBISECT_TP_TESTS:-1}" != "0" ] && [ "$#" -le 1 ]; then
    .venv/bin/python -m pytest --durations=10 "$@" tests/backends/test_vllm_tp.py
fi

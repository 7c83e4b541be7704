#!/usr/bin/env bash
# Install eaglesrv and its dependencies into the current Python environment.
# On a machine without CUDA this takes the CPU build of torch (pinned, so pip does not
# pull a multi-GB CUDA build); on a GPU machine, install your CUDA torch first.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python -m pip"
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    $PIP install "torch>=2.4"
  else
    $PIP install "torch==2.13.0" || $PIP install "torch>=2.4"
  fi
fi
$PIP install -e ".[server,test,bench]"
python -m eaglesrv.download   # the default model and the ShareGPT data, cached once
# The CPU attention kernel compiles once per machine (about 30 s); do it now rather than
# at the first server start. A failure here is not fatal: the torch backend takes over.
python -m eaglesrv.kernels.attention.cpu_build || echo "CPU attention kernel did not build; the torch backend will be used"

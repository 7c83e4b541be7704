#!/usr/bin/env bash
# Set up and run eaglesrv on the default model (SmolLM2-135M-Instruct) in one command.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
python -m eaglesrv.generate --prompt "What is the capital of France?" --prompt "Write a haiku about the sea." "$@"

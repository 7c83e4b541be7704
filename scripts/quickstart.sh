#!/usr/bin/env bash
# Set up eaglesrv and serve the default model (SmolLM2-135M-Instruct) on 127.0.0.1:30000.
# Extra arguments go to the launcher, e.g. --port 8000 or --model-path /path/to/model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec python -m eaglesrv.launch "$@"

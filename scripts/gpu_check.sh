#!/usr/bin/env bash
# The GPU checks in one call on a lent GPU machine (about 15 minutes of device time per
# session, starts included; no network there). From the repository root:
#     bash scripts/gpu_check.sh          # results under $OUT (the device tool's folder) or /tmp/gpu_check
# It records the machine, runs every `-m gpu` test (the Triton kernels against their torch
# references on the device, greedy output through the Triton backend equal to the torch
# backend, CUDA-graph replay equal to eager) and compiles every Triton kernel for this GPU's
# architecture. Each part writes its own file, so a failure in one keeps the others.
# pytest must be on the machine; nothing else beyond torch, triton and transformers is used.
set -uo pipefail
out=${OUT:-/tmp/gpu_check}
mkdir -p "$out"
status=0
{ nvidia-smi; python -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"; } \
  > "$out/machine.txt" 2>&1 || status=1
timeout 420 python -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_graph_capture.py \
  > "$out/gpu_tests.txt" 2>&1 || status=1
timeout 120 python -m eaglesrv.kernels.sm90_report > "$out/sm90_report.txt" 2>&1 || status=1
tail -n 3 "$out"/*.txt
exit $status

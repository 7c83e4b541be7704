#!/usr/bin/env bash
# The GPU checks and benchmarks in one call on a lent GPU machine (no network there), in
# under 8 minutes. First, on a machine with network:
#     python scripts/gpu_wheels.py          # the wheels the GPU machine lacks, into .devcarry/wheels
# then there, from the repository root, carrying .devcarry/wheels:
#     bash scripts/gpu_check.sh [WHEEL_DIR]  # results under $OUT (the device tool's folder) or /tmp/gpu_check
# Parts, each under `timeout` within one deadline, each writing its own file (a failure in
# one keeps the others):
#   wheels      every wheel in WHEEL_DIR (default .devcarry/wheels) installed with pip --no-index
#               --no-deps --target (as the device README does; flashinfer, apache-tvm-ffi and
#               cuda-python must go in without their dependencies, and --target would otherwise
#               reinstall what the machine has), then imported                       -> install.txt
#   machine     nvidia-smi, nvcc, library versions, the GPU's name                  -> machine.txt
#   sm90        every Triton kernel compiled for sm_90, on the CPU beside the tests -> sm90_report.txt
#   GPU tests   pytest -m gpu over every tests/test_*.py that marks tests gpu       -> gpu_tests.txt
#   TP tests    tests/test_gpu_tensor_parallel.py (NCCL), when the machine has 2 GPUs or more;
#               on one GPU the part records that it did not run                  -> tp_tests.txt
#   benchmarks  python -m eaglesrv.bench_gpu: Llama-3.1-8B shape, dummy bf16 weights; decode, batch,
#               EAGLE-3 round, shared-prefix TTFT with the prefix cache off and on -> bench.txt, bench.json
# It prints one table last (also table.md): each part's outcome, then each figure beside its
# target. Exit status 1 if any part failed or did not run. Eight files in all under $OUT (the
# device tool brings back eight at most).
# GPU_CHECK_DRY_RUN=1 runs the same logic on a CPU machine, to catch the script's own errors:
# the wheels are listed, not installed; pytest only collects; bench_gpu runs --smoke on the CPU.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/gpu_check}
wheels=${1:-.devcarry/wheels}
dry=${GPU_CHECK_DRY_RUN:-}
budget=${GPU_CHECK_BUDGET_S:-460}  # the whole run, table included, stays under 8 minutes
deadline=$((SECONDS + budget))
py=$(command -v python3 || command -v python)
export py
site=${GPU_CHECK_SITE:-/tmp/eaglesrv-site}
state=$(mktemp -d)
trap 'rm -rf "$state"' EXIT
mkdir -p "$out"
rm -f "$out"/{install,machine,sm90_report,gpu_tests,tp_tests,bench}.txt "$out"/bench.json "$out"/table.md
export PYTHONUNBUFFERED=1

log() { printf '[gpu_check %3d s] %s\n' "$SECONDS" "$*" >&2; }

# record FILE NAME RC SECONDS: the part's line for the table (detail: $DETAIL, else the file's last line)
record() {
  local detail=${DETAIL:-$(grep -v '^[[:space:]]*$' "$out/$1" 2>/dev/null | tail -n 1 | cut -c1-200)}
  printf '%s\t%s\t%s\t%s\n' "$2" "$3" "$4" "${detail//$'\t'/ }" > "$state/$1.tsv"
}

# run_part FILE NAME CAP_S RESERVE_S COMMAND...: at most CAP_S seconds, leaving RESERVE_S for later parts
run_part() {
  local file=$1 name=$2 cap=$3 reserve=$4
  shift 4
  local limit=$((deadline - SECONDS - reserve))
  ((limit > cap)) && limit=$cap
  if ((limit < 10)); then
    echo "not run: the ${budget} s budget was spent" > "$out/$file"
    record "$file" "$name" skipped 0
    log "$name: not run (out of time)"
    return
  fi
  log "$name: up to $limit s"
  local start=$SECONDS rc=0
  timeout -k 10 "$limit" "$@" > "$out/$file" 2>&1 || rc=$?
  record "$file" "$name" "$rc" $((SECONDS - start))
  log "$name: exit $rc after $((SECONDS - start)) s"
}

install_wheels() {  # WHEEL_DIR SITE DRY
  local dir=$1 site=$2 dry=$3 wheels
  shopt -s nullglob
  wheels=("$dir"/*.whl)
  if ((${#wheels[@]} == 0)); then
    echo "no wheels in $dir: run python scripts/gpu_wheels.py on a machine with network and carry $dir"
    [[ -n $dry ]]
    return
  fi
  printf '%s\n' "${wheels[@]##*/}"
  if [[ -n $dry ]]; then
    echo "dry run: ${#wheels[@]} wheels listed, not installed"
    return
  fi
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
    --upgrade --target "$site" "${wheels[@]}" || return 1
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  echo "--- pip check (flashinfer's own requirements are expected to be missing: installed with --no-deps)"
  "$py" -m pip check --disable-pip-version-check || true
  "$py" - "${#wheels[@]}" "$site" <<'EOF'
import importlib
import sys

failed = []
for name in ("fastapi", "uvicorn", "pydantic", "openai", "gguf", "flashinfer"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"), module.__file__)
    except Exception as exc:  # noqa: BLE001 - each failure is reported
        failed.append(f"{name} ({type(exc).__name__}: {exc})"[:120])
print(f"{sys.argv[1]} wheels installed into {sys.argv[2]}; "
      + ("every import works" if not failed else "imports FAILED: " + "; ".join(failed)))
sys.exit(1 if failed else 0)
EOF
}

machine() {  # DRY
  { nvidia-smi || echo "no nvidia-smi"; } 2>&1
  { nvcc --version | tail -n 2; } 2>/dev/null || echo "no nvcc"
  "$py" - "$1" <<'EOF'
import platform
import sys

import torch
import transformers
import triton

print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "triton", triton.__version__, "transformers", transformers.__version__)
if torch.cuda.is_available():
    print(torch.cuda.get_device_name(), f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
else:
    print("no CUDA device" + (" (dry run)" if sys.argv[1] else ""))
    sys.exit(0 if sys.argv[1] else 1)
EOF
}
export -f install_wheels machine

log "results under $out; wheels from $wheels${dry:+; DRY RUN}"
run_part install.txt "wheels ($wheels)" 60 300 bash -c 'install_wheels "$@"' _ "$wheels" "$site" "$dry"
[[ -z $dry && -d $site ]] && export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
run_part machine.txt "machine" 30 300 bash -c 'machine "$@"' _ "$dry"

# The sm_90 compile report needs no GPU: it runs on the CPU while the GPU tests run.
run_part sm90_report.txt "sm90 compile report" 150 30 "$py" -m eaglesrv.kernels.sm90_report &
sm90=$!

tp_file=tests/test_gpu_tensor_parallel.py
mapfile -t gpu_files < <(grep -l 'mark\.gpu' tests/test_*.py | grep -v -x "$tp_file")
pytest_args=(-q -p no:cacheprovider -m gpu --durations=10)
[[ -n $dry ]] && pytest_args+=(--collect-only)
run_part gpu_tests.txt "GPU tests (pytest -m gpu, ${#gpu_files[@]} files)" 230 255 \
  "$py" -m pytest "${pytest_args[@]}" "${gpu_files[@]}"

gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if ((gpus >= 2)) || [[ -n $dry ]]; then
  run_part tp_tests.txt "tensor parallelism over NCCL ($gpus GPUs)" 150 255 \
    "$py" -m pytest "${pytest_args[@]}" "$tp_file"
else
  echo "not run: tensor parallelism needs 2 GPUs, this machine has ${gpus:-0}" > "$out/tp_tests.txt"
  record tp_tests.txt "tensor parallelism over NCCL" 0 0
fi

bench_args=(--output-json "$out/bench.json")
[[ -n $dry ]] && bench_args+=(--smoke --device cpu)
DETAIL="python -m eaglesrv.bench_gpu ${bench_args[*]:2}: the figures are below" \
  run_part bench.txt "benchmarks" 240 15 "$py" -m eaglesrv.bench_gpu "${bench_args[@]}"

wait "$sm90"
checks="$state/parts.tsv"
for file in install.txt machine.txt sm90_report.txt gpu_tests.txt tp_tests.txt bench.txt; do
  cat "$state/$file.tsv" 2>/dev/null || printf '%s\tmissing\t\tno record\n' "$file"
done > "$checks"
status=0
awk -F'\t' '$2 != "0" { bad = 1 } END { exit bad }' "$checks" || status=1

if ! timeout 60 "$py" -m eaglesrv.bench_gpu --table "$out/bench.json" --checks "$checks" > "$out/table.md" \
    2> "$state/table.err"; then
  cat "$state/table.err" >&2
  { echo "| check | exit status | seconds | last line |"; echo "|---|---|---|---|"
    awk -F'\t' '{ printf "| %s | %s | %s | %s |\n", $1, $2, $3, $4 }' "$checks"; } > "$out/table.md"
  status=1
fi
cat "$out/table.md"
exit $status

#!/usr/bin/env bash
# The whole device check for a GPU machine, in one command, under 10 minutes: the GPU
# benchmark first (its smoke phase: start-up, kernels against torch on the device, one timed
# decode; then the table), then the CUDA tests. Runs with the machine's own python3 (torch,
# triton, transformers; no Ray, no pydantic, no network). Packages it lacks travel as wheels
# in .whl/ (benchmarks/README.md says how to fetch them). gpu.json is written as each phase
# ends, so a crash or the time limit leaves every finished phase; gpu_check.log holds the
# rest. Everything goes to $OUT (default benchmarks/results); exits non-zero when a phase or
# a test failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
BENCH_BUDGET_S=${BENCH_BUDGET_S:-300}  # no benchmark phase starts after this
BENCH_LIMIT_S=${BENCH_LIMIT_S:-400}    # SIGTERM: the running phase is recorded as cut
TESTS_LIMIT_S=${TESTS_LIMIT_S:-170}
PYTHON=${PYTHON:-python3}
# The CPU dry run (tests/test_gpu_bench.py): GPU_BENCH_ARGS="--quick --device cpu".
read -r -a BENCH_ARGS <<< "${GPU_BENCH_ARGS:-}"
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
{ date -u; if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv
  else echo "no nvidia-smi: a dry run"; fi; } 2>&1 | tee "$LOG"
status=0
# The table (gpu.json, gpu.png when matplotlib is there). -k: a phase stuck in the device
# past SIGTERM is killed; gpu.json still holds every phase before it.
timeout -k 15 "$BENCH_LIMIT_S" "$PYTHON" -m benchmarks.gpu_bench --out "$OUT/gpu.json" \
    --budget-s "$BENCH_BUDGET_S" "${BENCH_ARGS[@]}" 2>&1 | tee -a "$LOG" || status=1
# CUDA kernels against torch, fp32 greedy against transformers, start-up and no-sync steps,
# the step pipeline, NVML. pytest is on the image; where it is not, say so and go on.
if "$PYTHON" -c "import pytest" 2>/dev/null; then
    timeout -k 10 "$TESTS_LIMIT_S" "$PYTHON" -m pytest -q -p no:cacheprovider -rs \
        tests/workers/test_cuda_path.py tests/workers/test_cuda_graphs.py \
        tests/workers/test_nvml_device.py 2>&1 | tee -a "$LOG" || status=1
else
    echo "pytest is not installed: the CUDA tests did not run (carry its wheels in .whl/)" \
        | tee -a "$LOG"
    status=1
fi
date -u | tee -a "$LOG"
exit $status

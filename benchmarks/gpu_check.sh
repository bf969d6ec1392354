#!/usr/bin/env bash
# The whole device check for a GPU machine, in one command: the CUDA tests, then the GPU
# benchmark (benchmarks/README.md, "gpu"). Runs with the machine's own python3 (torch,
# triton, transformers, pytest; no Ray, no pydantic, no network). Packages it lacks travel
# as wheels in .whl/ (benchmarks/README.md says how to fetch them). Logs and gpu.json go to
# $OUT (default benchmarks/results); exits non-zero when the tests or the benchmark fail.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$OUT/gpu_check.log"
status=0
# CUDA kernels against torch, fp32 greedy against transformers, the step pipeline, NVML.
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/workers/test_cuda_path.py \
    tests/workers/test_triton_compile.py tests/workers/test_nvml_device.py \
    tests/workers/test_cuda_graphs.py 2>&1 | tee -a "$OUT/gpu_check.log" || status=1
# The table of issue 10 (under 6 minutes on an H200): gpu.json and gpu.png.
timeout 360 python3 -m benchmarks.gpu_bench --out "$OUT/gpu.json" 2>&1 \
    | tee -a "$OUT/gpu_check.log" || status=1
exit $status

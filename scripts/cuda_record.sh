#!/usr/bin/env bash
# On a CUDA machine with kvlayout built: run the test suite, the CPU+CUDA
# conformance run (with compute-sanitizer) and, with "bench", the benchmark;
# logs and reports go under OUTDIR.
#   scripts/cuda_record.sh OUTDIR [tests|bench|all]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: cuda_record.sh OUTDIR [tests|bench|all]}
what=${2:-all}
mkdir -p "$out/conformance" "$out/bench"
export JAX_PLATFORMS=cpu PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
status=0
if [ "$what" != bench ]; then
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/tests.txt"
    $py -m pytest -q -p no:cacheprovider tests 2>&1 | tee -a "$out/tests.txt" || status=1
    $py -m kvlayout conformance --device cpu,cuda --sanitize --no-progress --report "$out/conformance" \
        2>&1 | tee "$out/conformance.txt" || status=1
fi
if [ "$what" != tests ]; then
    $py -m kvlayout bench --device cuda --out "$out/bench" 2>"$out/bench_progress.txt" | tail -5 || status=1
fi
exit $status

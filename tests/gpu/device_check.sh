#!/usr/bin/env bash
# The whole GPU check as one prepared run, in order of value, for a lent GPU
# machine (a lease is short: every step has its own time-out, and what each
# step printed lands in $OUT even if a later one is cut off).
#   bash tests/gpu/device_check.sh [HVD_SUITE_DIR]
# HVD_SUITE_DIR: a folder holding Horovod's test/parallel/test_torch.py and
# test/utils/common.py as tests/test_torch.py and utils/common.py plus
# ../shared/horovod_suite's shims under shim/ (copy them into an ignored,
# carried folder beforehand: shared/ and the Horovod mirror do not travel),
# and a wheel of mock under HVD_SUITE_DIR/whl if the machine lacks it.
# First, ordering and lifetime with torch's real caching allocator
# (tests/gpu/ordering_check.py; issue 33): two processes on the one GPU
# through host staging, plain and under TORCH_CUDA_SANITIZER=1, and one
# process through NCCL (gradient buckets); about 20 s each, results in
# $OUT/ordering_*/rank*.json. Then the project's own checks and Horovod's
# suite run side by side (each at world size 1, in its own process); the
# benchmark runs alone afterwards.
# Settings: CRING_DEVICE_LIGHTNING=1 adds the Lightning cring-vs-ddp comparison
# (minutes; it passed on both earlier loans); CRING_DEVICE_BENCH=full runs the
# whole benchmark instead of its per-call, allgather and step parts.
# Nothing here runs without a GPU; CI never runs it.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/cring-gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
step() { # name, seconds, command...
    local name=$1 secs=$2
    shift 2
    echo "== $name (limit ${secs}s) started at $SECONDS s" >>"$OUT/summary.txt"
    local t0=$SECONDS
    timeout -k 5 "$secs" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    {
        echo "== $name: rc=$rc in $((SECONDS - t0))s"
        tail -8 "$OUT/$name.log" | sed 's/^/   /'
    } >>"$OUT/summary.txt"
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$OUT/summary.txt" 2>&1
step build 150 "$PY" setup.py -q build_ext --inplace -j 16
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
order=("$PY" tests/gpu/ordering_check.py)
step ordering_host 60 env CRING_GPU_OPERATIONS=host CRING_TIMEOUT_SECONDS=30 \
    "$PY" -m cring.run -np 2 "${order[@]}" --out "$OUT/ordering_host"
step ordering_sanitizer 120 env CRING_GPU_OPERATIONS=host CRING_TIMEOUT_SECONDS=30 \
    TORCH_CUDA_SANITIZER=1 "$PY" -m cring.run -np 2 "${order[@]}" --out "$OUT/ordering_sanitizer"
step ordering_nccl 60 env CRING_TIMEOUT_SECONDS=30 "$PY" -m cring.run -np 1 "${order[@]}" \
    --checks side_streams,freed_after_sync,bucket_with_traffic --out "$OUT/ordering_nccl"
skip=(--skip-lightning)
[ "${CRING_DEVICE_LIGHTNING:-0}" = 1 ] && skip=()
step checks 300 "$PY" tests/gpu/run_gpu_checks.py --out "$OUT/gpu_checks.json" "${skip[@]}" &
if [ -n "${1:-}" ] && [ -d "$1" ]; then
    H=$(cd "$1" && pwd)
    [ -d "$H/whl" ] && "$PY" -m pip install -q --no-index --no-deps --target /tmp/hvd-site "$H"/whl/*.whl
    (cd "$H/tests" && step horovod_suite 300 env \
        PYTHONPATH="$H/shim:$H/tests:$H/utils:/tmp/hvd-site:$PYTHONPATH" CRING_TIMEOUT_SECONDS=20 \
        "$PY" -m pytest -q -p no:cacheprovider --timeout 120 -rfEs -o junit_family=xunit2 \
        --junitxml="$OUT/horovod_junit.xml" test_torch.py)
fi
wait
bench=(--only steps)
[ "${CRING_DEVICE_BENCH:-}" = full ] && bench=()
step bench 240 "$PY" benchmarks/gpu.py --repeats 3 "${bench[@]}"
cat "$OUT/summary.txt"

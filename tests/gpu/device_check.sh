#!/usr/bin/env bash
# The whole GPU check as one prepared run, in order of value, for a lent GPU
# machine (a lease is short: every step has its own time-out, and what each
# step printed lands in $OUT even if a later one is cut off).
#   bash tests/gpu/device_check.sh [HVD_SUITE_DIR]
# HVD_SUITE_DIR: a folder holding Horovod's test/parallel/test_torch.py and
# test/utils/common.py as tests/test_torch.py and utils/common.py plus
# ../shared/horovod_suite's shims (copy them into an ignored, carried folder
# beforehand: shared/ and the Horovod mirror do not travel), and wheels of
# mock and pytest-timeout under HVD_SUITE_DIR/whl if the machine lacks them.
# Nothing here runs without a GPU; CI never runs it.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/cring-gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
step() { # name, seconds, command...
    local name=$1 secs=$2
    shift 2
    echo "== $name (limit ${secs}s)" | tee -a "$OUT/summary.txt"
    local t0=$SECONDS
    timeout "$secs" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "   rc=$rc in $((SECONDS - t0))s" | tee -a "$OUT/summary.txt"
    tail -5 "$OUT/$name.log" | sed 's/^/   /' >>"$OUT/summary.txt"
}
step build 120 "$PY" setup.py -q build_ext --inplace -j 16
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
step checks 300 "$PY" tests/gpu/run_gpu_checks.py --out "$OUT/gpu_checks.json"
if [ -n "${1:-}" ] && [ -d "$1" ]; then
    H=$1
    [ -d "$H/whl" ] && "$PY" -m pip install -q --no-index --no-deps --target /tmp/hvd-site "$H"/whl/*.whl
    step horovod_suite 300 env PYTHONPATH="$H/shim:$H/tests:$H/utils:/tmp/hvd-site:$PYTHONPATH" \
        CRING_TIMEOUT_SECONDS=20 "$PY" -m pytest -q -p no:cacheprovider --timeout 120 \
        "$H/tests/test_torch.py"
fi
step bench 180 "$PY" benchmarks/gpu.py --repeats 3
cat "$OUT/summary.txt"

#!/usr/bin/env bash
# The whole test suite, from a clean clone: installs what it needs (Open MPI
# and clang-format from Debian, pinned pip packages with the CPU build of
# torch), builds and runs the C tests, builds the wheel, installs it and runs
# pytest on two workers. README.md's test command; .ci/run runs exactly this.
#
#   bash scripts/test.sh            everything (CI; under CI=true no test may skip)
#   bash scripts/test.sh --fast     the same installs, then only `pytest -m "not slow"`
#                                   and the C tests without the sanitizers
#   bash scripts/test.sh -- ARGS    extra pytest arguments (e.g. -- -k allreduce)
#
# docs/testing.md: the markers, the fast set, the knobs, what runs where.
set -euo pipefail
cd "$(dirname "$0")/.."

FAST=0
PYTEST_EXTRA=()
while [ $# -gt 0 ]; do
    case "$1" in
    --fast) FAST=1 ;;
    --)
        shift
        PYTEST_EXTRA=("$@")
        break
        ;;
    *)
        echo "usage: bash scripts/test.sh [--fast] [-- PYTEST_ARGS...]" >&2
        exit 2
        ;;
    esac
    shift
done

START=$(date +%s)
stamp() { echo "== [$(($(date +%s) - START)) s] $*"; }

export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
# Everything Python goes into a fresh virtual environment, so that a package
# the tests use but nobody installs fails here as it would for a user (a
# machine's global Python may have it by chance). Inside an activated venv that
# one is used (`python3 -m venv /tmp/v && . /tmp/v/bin/activate && bash
# scripts/test.sh`); otherwise build/test-venv is made anew.
if [ -z "${VIRTUAL_ENV:-}" ]; then
    python3 -m venv --clear build/test-venv
    # shellcheck disable=SC1091  # made just above
    . build/test-venv/bin/activate
fi
stamp "Python: $(command -v python3) ($VIRTUAL_ENV)"
PIP="python3 -m pip"

# Debian packages: Open MPI (mpirun, mpi4py's build), clang-format at the
# major version tests/test_style.py checks the C against (Debian bookworm's
# clang-format; clang-format-14 by name elsewhere), util-linux's unshare and
# nsenter (the simulated hosts of the multi-host tests).
CLANG_FORMAT_MAJOR=14
clang_format_ok() {
    local tool
    for tool in "clang-format-$CLANG_FORMAT_MAJOR" clang-format; do
        command -v "$tool" >/dev/null 2>&1 &&
            "$tool" --version | grep -q "version $CLANG_FORMAT_MAJOR\." && return 0
    done
    return 1
}
APT_PACKAGES=""
command -v mpirun >/dev/null 2>&1 || APT_PACKAGES="openmpi-bin libopenmpi-dev"
if ! clang_format_ok; then
    if command -v clang-format >/dev/null 2>&1; then
        APT_PACKAGES="$APT_PACKAGES clang-format-$CLANG_FORMAT_MAJOR" # another major is installed
    else
        APT_PACKAGES="$APT_PACKAGES clang-format"
    fi
fi
{ command -v unshare && command -v nsenter; } >/dev/null 2>&1 || APT_PACKAGES="$APT_PACKAGES util-linux"
if [ -n "$APT_PACKAGES" ]; then
    SUDO=""
    [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    # shellcheck disable=SC2086  # a list of package names
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $APT_PACKAGES >/dev/null
fi
clang_format_ok || {
    echo "== no clang-format $CLANG_FORMAT_MAJOR after installing it (tests/test_style.py needs it)" >&2
    exit 1
}

# Three jobs run in the background while pip installs below, each into its own
# log, shown once it is done; a failed install stops them (the trap).
mkdir -p build
BG_PIDS=()
trap 'for p in "${BG_PIDS[@]}"; do kill "$p" 2>/dev/null || true; done' EXIT

# 1. The C tests need no Python: plain, then under ASan and UBSan. They go on
#    while pytest runs; their log is shown (and their status counted) at the end.
C_LOG=build/c-tests.log
(
    set -e
    echo "== C tests (no Python)"
    make -j2 all >/dev/null
    make test
    if [ "$FAST" -eq 0 ]; then
        echo "== C tests under AddressSanitizer + UndefinedBehaviorSanitizer"
        make -j2 SANITIZE=1 all >/dev/null
        make SANITIZE=1 test
    fi
) >"$C_LOG" 2>&1 &
C_PID=$!
BG_PIDS+=("$C_PID")

# 2. The wheel, built once by scripts/build_wheel.sh (sdist, then the wheel
#    from it, repaired by auditwheel): the suite runs on it, and
#    tests/test_wheel.py checks that same wheel (CRING_TEST_WHEEL_DIR) instead
#    of compiling the extension a second time.
WHEEL_DIR=build/dist
WHEEL_LOG=build/wheel.log
rm -rf "$WHEEL_DIR"
bash scripts/build_wheel.sh "$WHEEL_DIR" >"$WHEEL_LOG" 2>&1 &
WHEEL_PID=$!
BG_PIDS+=("$WHEEL_PID")

# 3. NCCL's own wheel, in a folder of its own (not the test venv: the tests of
#    the error a CUDA tensor gets without NCCL need a venv without it), for
#    tests/test_gpu_loader.py's check that the real libnccl loads from the
#    wheel's layout (CRING_TEST_NCCL_SITE).
NCCL_SITE=build/nccl-site
NCCL_LOG=build/nccl-wheel.log
rm -rf "$NCCL_SITE"
$PIP install -q --no-deps --target "$NCCL_SITE" "nvidia-nccl-cu13==2.30.7" >"$NCCL_LOG" 2>&1 &
NCCL_PID=$!
BG_PIDS+=("$NCCL_PID")

# torch is pinned: an unpinned torch pulls several GB of CUDA packages.
# Lightning and Ray are only needed for the cring.lightning and cring.ray tests
# (ray[serve] for examples/serve_ray.py). ruff is pinned too:
# tests/test_style.py checks the tree with this version. pytest-xdist runs the
# tests on two workers, pytest-timeout stops a test that hangs past every
# time-out of its own.
$PIP install -q "torch==2.13.0" "mpi4py==4.1.2" "numpy" "pytest==9.0.3" "hypothesis" \
    "pytest-xdist==3.8.0" "pytest-timeout==2.4.0" \
    "lightning==2.6.6" "ray[train,serve]==2.58.0" "ruff==0.17.6"
stamp "packages installed"

wait_for() { # $1: pid, $2: what, $3: log
    local status=0
    wait "$1" || status=$?
    if [ "$status" -ne 0 ]; then
        cat "$3"
        echo "== $2 failed (exit status $status)"
        exit "$status"
    fi
}
wait_for "$WHEEL_PID" "scripts/build_wheel.sh" "$WHEEL_LOG"
wait_for "$NCCL_PID" "installing nvidia-nccl-cu13" "$NCCL_LOG"
WHEELS=("$WHEEL_DIR"/cring-*.whl)
$PIP install -q "${WHEELS[@]}" # with its dependencies (cloudpickle), as a user gets it
stamp "cring installed from ${WHEELS[*]}"
export CRING_TEST_WHEEL_DIR="$PWD/$WHEEL_DIR" CRING_TEST_NCCL_SITE="$PWD/$NCCL_SITE"

stamp "Python tests$([ "$FAST" -eq 1 ] && echo ' (fast set: -m "not slow")')"
MARKS=()
[ "$FAST" -eq 1 ] && MARKS=(-m "not slow")
cd tests
# Two workers (--dist loadgroup: the groups tests/conftest.py gives stay on one
# worker); a test past 900 s (every test's own time-outs are shorter) fails
# with its stack instead of holding CI to its limit.
# pytest exits 5 when it collected nothing: set -e treats that as the failure it is.
PYTEST_STATUS=0
python3 -m pytest -q -p no:cacheprovider --durations=40 -n 2 --dist loadgroup \
    --timeout 900 "${MARKS[@]}" "${PYTEST_EXTRA[@]}" || PYTEST_STATUS=$?
cd ..
stamp "Python tests done (exit status $PYTEST_STATUS)"

C_STATUS=0
wait "$C_PID" || C_STATUS=$?
cat "$C_LOG"
stamp "C tests done (exit status $C_STATUS)"
[ "$C_STATUS" -ne 0 ] && echo "== C tests failed (exit status $C_STATUS)"
[ "$PYTEST_STATUS" -ne 0 ] && exit "$PYTEST_STATUS"
exit "$C_STATUS"

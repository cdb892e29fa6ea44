#!/usr/bin/env bash
# The whole test suite, from a clean clone: installs what it needs (Open MPI
# and clang-format from Debian, pinned pip packages with the CPU build of
# torch), builds and runs the C tests, installs cring and runs pytest.
# README.md's test command; .ci/run runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."

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
echo "== Python: $(command -v python3) ($VIRTUAL_ENV)"
PIP="python3 -m pip"
APT_PACKAGES=""
command -v mpirun >/dev/null 2>&1 || APT_PACKAGES="openmpi-bin libopenmpi-dev"
# clang-format checks the C style (tests/test_style.py); looked for on its own,
# so that a machine with MPI but no clang-format still gets it.
command -v clang-format >/dev/null 2>&1 || APT_PACKAGES="$APT_PACKAGES clang-format"
if [ -n "$APT_PACKAGES" ]; then
    SUDO=""
    [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    # shellcheck disable=SC2086  # a list of package names
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $APT_PACKAGES >/dev/null
fi
# The C tests need no Python: they build and run (plain, then under ASan and
# UBSan) while pip installs below, into their own log, shown once both are done.
C_LOG=build/c-tests.log
mkdir -p build
(
    set -e
    echo "== C tests (no Python)"
    make -j2 all >/dev/null
    make test
    echo "== C tests under AddressSanitizer + UndefinedBehaviorSanitizer"
    make -j2 SANITIZE=1 all >/dev/null
    make SANITIZE=1 test
) >"$C_LOG" 2>&1 &
C_PID=$!
trap 'kill "$C_PID" 2>/dev/null || true' EXIT # a failed install stops them too
# torch is pinned: an unpinned torch pulls several GB of CUDA packages.
# Lightning and Ray are only needed for the cring.lightning and cring.ray tests
# (ray[serve] for examples/serve_ray.py).
# ruff is pinned too: tests/test_style.py checks the tree with this version.
$PIP install -q "torch==2.13.0" "mpi4py==4.1.2" "numpy" "pytest" "hypothesis" \
    "lightning==2.6.6" "ray[train,serve]==2.58.0" "ruff==0.17.6"
$PIP install -q .

C_STATUS=0
wait "$C_PID" || C_STATUS=$?
cat "$C_LOG"
if [ "$C_STATUS" -ne 0 ]; then
    echo "== C tests failed (exit status $C_STATUS)"
    exit "$C_STATUS"
fi

echo "== Python tests"
cd tests
# pytest exits 5 when it collected nothing: set -e treats that as the failure it is.
python3 -m pytest -q -p no:cacheprovider --durations=40

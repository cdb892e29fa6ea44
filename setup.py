"""Build of cring's C extension (cring._C) from csrc/.

Needs only a C compiler and the Python headers: no framework, CUDA or MPI.
Vector kernels are selected at run time by CPU feature, so no -march flags:
a wheel built here runs on any x86-64 (scripts/build_wheel.sh builds and
repairs the manylinux wheels; it uses the full C API, so one wheel per Python
version, no abi3). The version is cring.__version__ (pyproject.toml reads it).
The GPU layer (csrc/gpu) finds the CUDA runtime and NCCL with dlopen at run
time: building needs neither. The compiler flags come from build_flags.mk,
which the Makefile (C tests) reads too.
"""

import os
import re
from glob import glob
from pathlib import Path

from setuptools import Extension, setup

FLAGS_FILE = Path(__file__).resolve().parent / "build_flags.mk"


def build_flags(path: Path = FLAGS_FILE) -> dict:
    """The `NAME := words` lines of build_flags.mk as {NAME: [words]}."""
    flags = {}
    for line in path.read_text().splitlines():
        match = re.match(r"^([A-Z_]+)\s*:?=\s*(.*?)\s*$", line)
        if match:
            flags[match.group(1)] = match.group(2).split()
    return flags


FLAGS = build_flags()
LIB_LAYERS = [*FLAGS["CRING_LAYERS"], "pyext"]
sources = sorted(src for layer in LIB_LAYERS for src in glob(f"csrc/{layer}/*.c"))

ext = Extension(
    "cring._C",
    sources=sources,
    include_dirs=FLAGS["CRING_INCLUDE_DIRS"],
    extra_compile_args=[
        *FLAGS["CRING_CFLAGS"],
        *FLAGS["CRING_WARNINGS"],
        *FLAGS["CRING_SHIPPED_CFLAGS"],
    ],
    extra_link_args=["-pthread"],
    libraries=FLAGS["CRING_LIBS"],
)

# Compile the sources in parallel by default (pip install and python -m build
# give no -j); `build_ext -jN` on the command line still wins.
setup(ext_modules=[ext], options={"build_ext": {"parallel": os.cpu_count() or 1}})

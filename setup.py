"""Build of cring's C extension (cring._C) from csrc/.

Needs only a C compiler and the Python headers: no framework, CUDA or MPI.
Vector kernels are selected at run time by CPU feature, so no -march flags.
The GPU layer (csrc/gpu) finds the CUDA runtime and NCCL with dlopen at run
time: building needs neither.
"""

from glob import glob

from setuptools import Extension, setup

LIB_LAYERS = ["common", "bootstrap", "transport", "reduce", "algo", "core", "engine", "gpu",
              "pyext"]
sources = sorted(src for layer in LIB_LAYERS for src in glob(f"csrc/{layer}/*.c"))

ext = Extension(
    "cring._C",
    sources=sources,
    include_dirs=["csrc/include", "csrc"],
    define_macros=[("_GNU_SOURCE", "1")],
    extra_compile_args=["-std=c11", "-O3", "-fvisibility=hidden", "-pthread",
                        "-Wno-unused-parameter"],
    extra_link_args=["-pthread"],
    libraries=["rt", "m", "dl"],
)

setup(ext_modules=[ext])

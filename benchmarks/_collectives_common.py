"""What the parts of benchmarks/collectives.py share: sizes, the libraries and
collectives measured, size parsing and formatting, and the machine's
description. No measuring and no processes here."""

from __future__ import annotations

import argparse
import os
import platform
from pathlib import Path

HERE = Path(__file__).resolve().parent / "collectives.py"
RESULTS = HERE.parent / "results"
LIBRARIES = ("cring-shm", "cring-tcp", "gloo", "mpi", "cring-torch", "deepspeed")
PEERS = ("gloo", "mpi", "deepspeed")
# allreduce-bf16: bfloat16 sum on torch tensors, only the torch libraries below
COLLECTIVES = ("allreduce", "broadcast", "allgather", "allreduce-bf16")
# issue 20's DeepSpeed comparison: cring.torch and deepspeed.comm's shared-memory
# allreduce on the same torch tensors; these two measure allreduce (float32 and
# bfloat16) only
TORCH_LIBRARIES = ("cring-torch", "deepspeed")
# the ratios a table shows: (cring library, peer)
RATIO_PAIRS = (
    ("cring-shm", "gloo"),
    ("cring-shm", "mpi"),
    ("cring-tcp", "gloo"),
    ("cring-tcp", "mpi"),
    ("cring-torch", "deepspeed"),
)
SHORT = {
    "cring-shm": "shm",
    "cring-tcp": "tcp",
    "gloo": "gloo",
    "mpi": "mpi",
    "cring-torch": "c-torch",
    "deepspeed": "ds",
}
DEEPSPEED_INSTALL = "to compare, install it as docs/performance.md says"
WORLD = 2
KiB, MiB = 1 << 10, 1 << 20
# 8 B, then powers of 4 from 16 B to 256 MiB (1 KiB, 1 MiB and 64 MiB among them)
DEFAULT_SIZES = [8] + [4**k for k in range(2, 15)]
QUICK_SIZES = [8, KiB, MiB, 64 * MiB]
TARGET_REP_S = 0.005  # small sizes: back-to-back calls per repetition, about this long
MAX_CALLS_PER_REP = 20000
# set by an outer cringrun; the libraries' own launchers set their own
LAUNCHER_VARS = (
    "CRING_RANK",
    "CRING_SIZE",
    "CRING_LOCAL_RANK",
    "CRING_LOCAL_SIZE",
    "CRING_ADDR",
    "CRING_PORT",
    "CRING_SECRET",
    "CRING_JOB_ID",
    "CRING_STORE_EXTERNAL",
)
ROTATE_FROM_BYTES = MiB  # rotate buffers once a call touches this much (L2 is 2 MiB here)


def supports(library: str, collective: str) -> bool:
    """Whether `library` measures `collective` (the torch libraries only the
    allreduces; bfloat16 only on them)."""
    if library in TORCH_LIBRARIES:
        return collective.startswith("allreduce")
    return collective != "allreduce-bf16"


def dtype_of(collective: str) -> tuple:
    """(dtype name, bytes per element) of a collective's buffers."""
    return ("bfloat16", 2) if collective.endswith("-bf16") else ("float32", 4)


def busbw_factor(collective: str, n: int) -> float:
    """nccl-tests' bus bandwidth factor: algbw * factor is comparable to the
    hardware's bandwidth whatever the algorithm."""
    kind = collective.split("-")[0]
    return {"allreduce": 2 * (n - 1) / n, "allgather": (n - 1) / n, "broadcast": 1.0}[kind]


def parse_size(text: str) -> int:
    units = {
        "": 1,
        "B": 1,
        "K": KiB,
        "KB": KiB,
        "KIB": KiB,
        "M": MiB,
        "MB": MiB,
        "MIB": MiB,
        "G": 1 << 30,
        "GB": 1 << 30,
        "GIB": 1 << 30,
    }
    t = text.strip().upper()
    digits = t.rstrip("KMGIB")
    if not digits or t[len(digits) :] not in units:
        raise argparse.ArgumentTypeError(
            f"size {text!r}: expected a byte count like 8, 4K, 1M, 64M"
        )
    value = int(float(digits) * units[t[len(digits) :]])
    if value < 4 * WORLD:
        raise argparse.ArgumentTypeError(f"size {text!r}: at least {4 * WORLD} bytes")
    return value


def fmt_size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", KiB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def llc_bytes() -> int:
    """Size of the largest CPU cache (sysfs), 64 MiB if unknown."""
    best = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        scale = {"K": KiB, "M": MiB, "G": 1 << 30}.get(text[-1:], 1)
        best = max(best, int(text.rstrip("KMG")) * scale)
    return best or 64 * MiB


def machine() -> dict:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "nproc": os.cpu_count(),
        "cpu": model or platform.processor(),
        "llc_bytes": llc_bytes(),
        "python": platform.python_version(),
    }

"""One rank of the CPU-only sweep (tests/test_gpu_sweep.py): the whole
dtype x collective x shape sweep of tests/gpu/sweep.py on FakeCudaTensor
inputs against the test doubles (CRING_NCCL_LIBRARY=libfake_nccl.so,
CRING_CUDART_LIBRARY=libfake_cudart.so; "device memory" is host memory),
compared with the same calls on NumPy arrays. Prints one JSON line:
{"rank", "size", "cases", "failures", "nccl"} (nccl: cring._gpu.nccl_info())."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from sweep import sweep  # noqa: E402

import cring  # noqa: E402
from cring import _gpu  # noqa: E402

from fake_cuda import FakeCudaTensor  # noqa: E402

VERBOSE = bool(os.environ.get("CRING_SWEEP_VERBOSE"))


def main() -> None:
    cring.init()
    cases, failures = sweep(
        FakeCudaTensor,
        lambda t: np.array(t.array, copy=True),
        log=lambda line, verbose: (
            (not verbose or VERBOSE) and print(line, file=sys.stderr, flush=True)
        ),
    )
    report = {
        "rank": cring.rank(),
        "size": cring.size(),
        "cases": cases,
        "failures": failures[:50],
        "nccl": _gpu.nccl_info(),
        "stats": _gpu.stats(),
    }
    cring.shutdown()
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()

"""One rank of tests/test_gpu_results.py: out-of-place results of fake CUDA
tensors (FakeCudaTensor, an Array-API producer, and fake_cupy.ndarray, a
CuPy-like one) through the NCCL path against the test doubles, whose
cudaFree and cudaFreeAsync overwrite freed memory. Only the NumPy views of the
results are kept (as a user keeps a CuPy array and drops what made it): every
result must own its memory, and give it back stream-ordered (cudaFreeAsync,
never a device-wide cudaFree). Writes <outdir>/rank<R>.json. argv: outdir."""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

import fake_cupy  # noqa: E402

import cring  # noqa: E402
from cring import _gpu  # noqa: E402

from fake_cuda import FakeCudaTensor as F  # noqa: E402

KEEP = 40
DTYPES = ["uint8", "int8", "int32", "int64", "float32", "float64", "bool"]


def values(k: int, rank: int, shape: tuple, dtype: str) -> np.ndarray:
    n = int(np.prod(shape))
    return ((np.arange(n) * (rank + 1) + k) % 97).reshape(shape).astype(dtype)


def frees(call: str) -> int:
    """This process's calls of the fake runtime's `call` ("free": cudaFree,
    "freeasync": cudaFreeAsync) so far."""
    path = os.environ.get("CRING_FAKE_CUDA_LOG")
    if not path:
        return -1
    pid = f"pid={os.getpid()}"
    with open(path) as f:
        return sum(1 for line in f if line.split()[:2] == [pid, call])


def main() -> None:
    outdir = Path(sys.argv[1])
    cring.init()
    r, p = cring.rank(), cring.size()
    kept: list = []  # (what, numpy view of the result, expected)

    for k in range(KEEP):
        dtype = DTYPES[k % len(DTYPES)]
        kind = k % 5
        name = f"keep{k}"
        if kind == 0:  # allgather, even
            shape = (17, 3) if k % 2 else (8,)
            res = cring.allgather(F(values(k, r, shape, dtype)), name=name)
            exp = np.concatenate([values(k, q, shape, dtype) for q in range(p)])
        elif kind == 1:  # allgather, uneven first dimensions
            res = cring.allgather(F(values(k, r, (r + 2, 5), dtype)), name=name)
            exp = np.concatenate([values(k, q, (q + 2, 5), dtype) for q in range(p)])
        elif kind == 2:  # reducescatter of 7 rows
            dtype = "float64" if dtype == "bool" else dtype
            res = cring.reducescatter(F(values(k, r, (7, 3), dtype)), op=cring.Sum, name=name)
            total = sum(values(k, q, (7, 3), dtype) for q in range(p)).astype(dtype)
            rows = [7 // p + (q < 7 % p) for q in range(p)]
            exp = total[sum(rows[:r]) : sum(rows[: r + 1])]
        elif kind == 3:  # out-of-place allreduce
            dtype = "float64" if dtype == "bool" else dtype
            res = cring.allreduce(F(values(k, r, (17,), dtype)), op=cring.Max, name=name)
            exp = np.max([values(k, q, (17,), dtype) for q in range(p)], axis=0)
        else:  # out-of-place broadcast from the last rank
            res = cring.broadcast(F(values(k, r, (9,), dtype)), root_rank=p - 1, name=name)
            exp = values(k, p - 1, (9,), dtype)
        assert isinstance(res, F), type(res)
        kept.append((f"{name} kind {kind} {dtype}", res.array, exp))
        del res
        # later collectives and allocations between this result and its check
        later = cring.allgather(F(np.full(8 + k, r, np.uint8)), name=f"later{k}")
        junk = [bytearray(b"\x5a" * 64) for _ in range(8)]  # host allocations too
        del later, junk
        gc.collect()

    bad = [
        f"{what}: got {got.ravel()[:6].tolist()}, expected {exp.ravel()[:6].tolist()}"
        for what, got, exp in kept
        if got.shape != exp.shape or got.dtype != exp.dtype or not np.array_equal(got, exp)
    ]
    frees_before = frees("freeasync")
    del kept
    gc.collect()
    frees_released = frees("freeasync") - frees_before  # the kept allgather results' memory

    # a CuPy-like producer (module-level empty/from_dlpack) gets its own kind
    c = fake_cupy.asarray(values(1, r, (r + 1, 4), "float32"))
    e = fake_cupy.asarray(values(3, r, (5,), "float64"))
    summed = cring.allreduce(e, op=cring.Sum, name="cupy.allreduce")
    cupy_kinds = {
        "allgather": type(cring.allgather(c, name="cupy.allgather")).__module__,
        "allreduce": type(summed).__module__,
        "broadcast": type(cring.broadcast(e, root_rank=0, name="cupy.broadcast")).__module__,
    }
    if not np.array_equal(summed.array, sum(values(3, q, (5,), "float64") for q in range(p))):
        bad.append("cupy allreduce")
    gathered = cring.allgather(c, name="cupy.allgather2")
    exp = np.concatenate([values(1, q, (q + 1, 4), "float32") for q in range(p)])
    if not np.array_equal(gathered.array, exp):
        bad.append(f"cupy allgather: {gathered.array.ravel()[:6]} vs {exp.ravel()[:6]}")
    even = fake_cupy.asarray(values(2, r, (6, 2), "int32"))
    rs = cring.reducescatter(even, op=cring.Sum, name="cupy.reducescatter")
    cupy_kinds["reducescatter"] = type(rs).__module__
    total = sum(values(2, q, (6, 2), "int32") for q in range(p))
    rows = [6 // p + (q < 6 % p) for q in range(p)]
    if not np.array_equal(rs.array, total[sum(rows[:r]) : sum(rows[: r + 1])]):
        bad.append("cupy reducescatter")

    stats = _gpu.stats()
    device_wide_frees = frees("free")
    cring.shutdown()
    with open(outdir / f"rank{r}.json", "w") as f:
        json.dump(
            {
                "rank": r,
                "size": p,
                "bad": bad,
                "checked": KEEP,
                "frees_released": frees_released,
                "device_wide_frees": device_wide_frees,
                "cupy_kinds": cupy_kinds,
                "stats": stats,
            },
            f,
        )


if __name__ == "__main__":
    main()

"""One rank of the CPU-only GPU-path test: run under cringrun with the test
doubles (CRING_NCCL_LIBRARY=libfake_nccl.so, CRING_CUDART_LIBRARY=
libfake_cudart.so), on FakeCudaTensor inputs ("device memory" is host memory).
Checks every collective's values against NumPy and writes
<outdir>/rank<R>.json for tests/test_gpu_loader.py, which also reads the
doubles' logs. argv: outdir. CRING_GPU_OPERATIONS picks the path."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

import cring  # noqa: E402
from cring import _gpu  # noqa: E402

from fake_cuda import FakeCudaTensor as F  # noqa: E402


def close(a: np.ndarray, b: np.ndarray, what: str) -> None:
    a = np.array(a, copy=True)  # what the host read, once
    if a.shape != b.shape or not np.allclose(a, b):
        raise AssertionError(f"{what}: got {a!r}, expected {b!r}")


def main() -> None:
    outdir = Path(sys.argv[1])
    cring.init()
    r, p = cring.rank(), cring.size()
    mode = os.environ.get("CRING_GPU_OPERATIONS", "nccl")
    base = np.arange(10, dtype=np.float32)

    # in place, Sum; then out of place, Average in float64 (input untouched)
    x = F(base + r)
    assert cring.allreduce_(x, op=cring.Sum, name="sum") is x
    close(x.array, sum(base + q for q in range(p)), "allreduce_ sum")
    d = F(np.linspace(0, 1, 7) * (r + 1))
    y = cring.allreduce(d, name="avg")
    assert isinstance(y, F) and y is not d
    close(y.array, np.linspace(0, 1, 7) * sum(q + 1 for q in range(p)) / p, "allreduce average")
    close(d.array, np.linspace(0, 1, 7) * (r + 1), "input of out-of-place allreduce")

    # integers: Average divides toward zero; Max
    i = F(np.array([-7, 5, 3], dtype=np.int32) * (r + 1))
    cring.allreduce_(i, name="int_avg")
    total = np.array([-7, 5, 3]) * sum(q + 1 for q in range(p))
    close(i.array, np.trunc(total / p).astype(np.int32), "int32 average")
    m = F(np.array([r, -r, 2], dtype=np.int64))
    cring.allreduce_(m, op=cring.Max, name="max")
    close(m.array, np.array([p - 1, 0, 2]), "int64 max")

    # a group: zero, one and 1001 elements, one fused NCCL group
    g = [
        F(np.zeros(0, np.float32)),
        F(np.full(1, r + 1.0, np.float32)),
        F(np.arange(1001, dtype=np.float32) * (r + 1)),
    ]
    out = cring.grouped_allreduce_(g, op=cring.Sum, name="group")
    assert out == g
    s = sum(q + 1 for q in range(p))
    close(g[1].array, np.full(1, float(s), np.float32), "group[1]")
    close(g[2].array, np.arange(1001, dtype=np.float32) * s, "group[2]")

    # scaling factors
    sc = F(np.ones(5, np.float32) * (r + 1))
    cring.allreduce_(sc, op=cring.Sum, prescale_factor=0.5, postscale_factor=3.0, name="scaled")
    close(sc.array, np.ones(5) * 1.5 * s, "pre/post-scaled sum")

    # broadcast: in place from the last rank, out of place from rank 0
    b = F(np.full((2, 3), r, np.float64))
    cring.broadcast_(b, root_rank=p - 1, name="bcast_")
    close(b.array, np.full((2, 3), p - 1.0), "broadcast_")
    b2 = cring.broadcast(F(np.full(4, 10 + r, np.int32)), root_rank=0, name="bcast")
    close(b2.array, np.full(4, 10, np.int32), "broadcast")

    # allgather with uneven first dimensions; a 0-d tensor gathers as one row
    ga = cring.allgather(F(np.full((r + 1, 3), r, np.int64)), name="gather")
    close(ga.array, np.concatenate([np.full((q + 1, 3), q) for q in range(p)]), "allgather")
    g0 = cring.allgather(F(np.array(r * 2.0, np.float32)), name="gather0d")
    close(g0.array, np.arange(p, dtype=np.float32) * 2, "allgather of 0-d")

    # reducescatter: 7 rows over p ranks
    rs = cring.reducescatter(
        F(np.arange(14, dtype=np.float32).reshape(7, 2) * (r + 1)), op=cring.Sum, name="rs"
    )
    rows = [7 // p + (1 if q < 7 % p else 0) for q in range(p)]
    start = sum(rows[:r])
    full = np.arange(14, dtype=np.float32).reshape(7, 2) * s
    close(rs.array, full[start : start + rows[r]], "reducescatter")

    # async: the handle returns the tensor itself
    a = F(np.ones(3, np.float32))
    h = cring.allreduce_async_(a, op=cring.Sum, name="async")
    assert cring.synchronize(h) is a
    close(a.array, np.full(3, float(p)), "async allreduce_")

    # the caller's stream reaches __dlpack__ and the NCCL call / copies; the
    # result is ordered on that stream, so the host reads it there
    st = F(np.ones(4, np.float32), label="streamed")
    with _gpu.use_stream(0x1234 + r):
        cring.allreduce_(st, op=cring.Sum, name="streamed")
        close(st.array, np.full(4, float(p)), "streamed allreduce")
    seen = [s_ for label, s_ in F.streams_seen if label == "streamed"]
    assert seen and all(v == 0x1234 + r for v in seen), seen

    mismatch, any_order = None, 0
    if mode == "nccl" and p > 1:
        # ranks disagree on the shape: MismatchError everywhere, then all is well
        try:
            cring.allreduce_(F(np.ones(4 + r, np.float32)), name="mismatch")
        except cring.MismatchError as e:
            mismatch = str(e)
        # a CUDA tensor on rank 0, a CPU array on the others, under one name
        try:
            cring.allreduce_(
                F(np.ones(3, np.float32)) if r == 0 else np.ones(3, np.float32),
                name="mixed_devices",
            )
        except cring.MismatchError as e:
            mismatch += " | " + str(e)
        after = F(np.ones(2, np.float32))
        cring.allreduce_(after, op=cring.Sum, name="after_mismatch")
        close(after.array, np.full(2, float(p)), "allreduce after a mismatch")
        # any submission order: the engine negotiates CUDA requests by name
        # (the Python path before it needed every rank to issue the same order)
        names = [f"order{k}" for k in range(6)]
        xs = {n: F(np.full(3, float(k + r), np.float32)) for k, n in enumerate(names)}
        order = names if r % 2 == 0 else names[::-1]
        handles = {n: cring.allreduce_async_(xs[n], op=cring.Sum, name=n) for n in order}
        for k, n in enumerate(names):
            assert cring.synchronize(handles[n]) is xs[n]
            close(xs[n].array, np.full(3, float(k * p + p * (p - 1) // 2)), n)
        any_order = len(names)

    stats = _gpu.stats()
    cring.shutdown()
    with open(outdir / f"rank{r}.json", "w") as f:
        json.dump(
            {
                "rank": r,
                "size": p,
                "stats": stats,
                "mismatch": mismatch,
                "any_order": any_order,
                "nccl": _gpu.nccl_info(),
                "default_streams": [s_ for label, s_ in F.streams_seen if label is None][:3],
            },
            f,
        )


if __name__ == "__main__":
    main()

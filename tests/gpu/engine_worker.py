"""One rank of tests/test_gpu_engine.py: CUDA collectives through the engine's
non-blocking NCCL path against the test doubles (CRING_NCCL_LIBRARY=
libfake_nccl.so, CRING_CUDART_LIBRARY=libfake_cudart.so) on FakeCudaTensor
inputs. Started directly with CRING_RANK/CRING_SIZE/CRING_ADDR/CRING_PORT (not
by cringrun, which would stop the survivors of a killed rank itself). Prints
one JSON line. argv: mode ("late", "fuse", "mixed" or "kill").
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

import cring  # noqa: E402
from cring import _gpu  # noqa: E402

from fake_cuda import FakeCudaTensor as F  # noqa: E402


def late(r: int, p: int, out: dict) -> None:
    """Rank 1 submits 2 s after the others: their submission returns at once.
    (The libraries are loaded first, as any CUDA program has by then.)"""
    assert cring.nccl_available() and cring.cuda_available()
    cring.barrier()
    x = F(np.arange(8, dtype=np.float32) + r)
    if r == 1:
        time.sleep(2.0)
    t0 = time.perf_counter()
    h = cring.allreduce_async_(x, op=cring.Sum, name="late")
    out["submit_s"] = time.perf_counter() - t0
    res = cring.synchronize(h)
    out["sync_s"] = time.perf_counter() - t0
    expect = sum(np.arange(8, dtype=np.float32) + q for q in range(p))
    out["late_ok"] = res is x and bool(np.array_equal(x.array, expect))
    y = F(np.ones(3, np.float32))
    cring.synchronize(cring.allreduce_async_(y, op=cring.Sum, name="blocked"), block_host=True)
    out["blocked_ok"] = bool(np.array_equal(y.array, np.full(3, float(p), np.float32)))


def fuse(r: int, p: int, out: dict) -> None:
    """100 small tensors, asynchronously, in a different order on odd ranks."""
    cring.barrier()
    n = 100
    xs = [F(np.arange(k % 7 + 1, dtype=np.float32) + r + k) for k in range(n)]
    order = range(n) if r % 2 == 0 else reversed(range(n))
    before = _gpu.stats()
    handles = {k: cring.allreduce_async_(xs[k], op=cring.Sum, name=f"small{k}") for k in order}
    exact = True
    for k in range(n):
        exact &= cring.synchronize(handles[k]) is xs[k]
        expect = sum(np.arange(k % 7 + 1, dtype=np.float32) + q + k for q in range(p))
        exact &= bool(np.array_equal(xs[k].array, expect))
    after = _gpu.stats()
    out["exact"] = exact
    out["nccl_calls"] = after["nccl_calls"] - before["nccl_calls"]
    out["stream_waits"] = after["stream_waits"] - before["stream_waits"]
    out["fused_copies"] = after["fused_copies"] - before["fused_copies"]


def mixed(r: int, p: int, out: dict) -> None:
    """60 tensors in one burst, every third of 1 MiB and the others small, as
    a backward pass interleaves them."""
    cring.barrier()
    big = (1 << 20) // 4
    xs = [F(np.full(big if k % 3 == 0 else 16, float(r + k), np.float32)) for k in range(60)]
    before = _gpu.stats()["nccl_calls"]
    handles = [cring.allreduce_async_(x, op=cring.Sum, name=f"mixed{k}") for k, x in enumerate(xs)]
    exact = True
    for k, h in enumerate(handles):
        exact &= cring.synchronize(h) is xs[k]
        want = np.full(xs[k].array.shape, sum(float(q + k) for q in range(p)), np.float32)
        exact &= bool(np.array_equal(xs[k].array, want))
    out["nccl_calls"] = _gpu.stats()["nccl_calls"] - before
    out["exact"] = exact


def kill(r: int, p: int, out: dict) -> None:
    """The last rank dies (SIGKILL) once the communicator exists; the others'
    next CUDA allreduce raises PeerFailureError."""
    warm = F(np.ones(4, np.float32))
    cring.allreduce_(warm, op=cring.Sum, name="warm")
    cring.barrier()
    if r == p - 1:  # once every rank is surely out of the barrier
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(1.0)
    t0 = time.perf_counter()
    try:
        h = cring.allreduce_async_(F(np.ones(4, np.float32)), name="after_kill")
        cring.synchronize(h)
        out["raised"] = None
    except cring.CRingError as e:
        out["raised"] = type(e).__name__
        out["message"] = str(e)
    out["after_s"] = time.perf_counter() - t0


def main() -> None:
    mode = sys.argv[1]
    cring.init()
    r, p = cring.rank(), cring.size()
    out: dict = {"rank": r, "size": p, "pid": os.getpid(), "mode": mode}
    {"late": late, "fuse": fuse, "mixed": mixed, "kill": kill}[mode](r, p, out)
    cring.shutdown()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()

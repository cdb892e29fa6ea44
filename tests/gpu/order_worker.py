"""One rank of tests/test_gpu_ordering.py: what cring's CUDA path must keep in
order when the device runs work late (the test doubles' fake GPU) and a
caching allocator hands freed memory out again at once (tests/gpu/fake_cuda.py
and fake_torch_cuda.py). In each mode cring's own stream is first made busy
for 0.3 s, as a GPU still running earlier kernels is, so its work on a
tensor runs well after the host has moved on; a tensor whose memory cring
lets go too early is then handed to the next allocation, written with 7s
(or a framework kernel's bytes), and overwritten by cring's late work: wrong
values. Started directly with CRING_RANK/CRING_SIZE/CRING_ADDR/CRING_PORT.
Prints one JSON line {"rank", "size", "bad": [...], ...}. argv: mode:

  room          a torch CUDA allgather inside use_stream(S) (the C fast path):
                its result must not be memory torch's current stream T still
                writes (a block T freed, with a T kernel pending on it)
  third_stream  a tensor allocated on a side stream C, reduced on the legacy
                stream, then freed (synchronized, or its handle dropped): C's
                next allocation must not get its memory while cring's stream
                still works on it
  failed_batch  a grouped allreduce that fails after its first tensor's NCCL
                call was queued (the second is larger than the fake NCCL
                takes): the first tensor's memory must not be handed out
                again before that call has run
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

import cring  # noqa: E402
from cring import _gpu  # noqa: E402

import fake_cuda  # noqa: E402
from fake_cuda import FakeCudaTensor as F  # noqa: E402

BUSY_US = 300_000  # how long cring's stream is kept busy before the work under test


def summary(a: np.ndarray) -> str:
    values, counts = np.unique(a, return_counts=True)
    return ", ".join(f"{v!r} x{c}" for v, c in zip(values.tolist()[:4], counts.tolist()[:4]))


def warm_up() -> int:
    """A first collective (the communicator, cring's stream); cring's stream."""
    cring.allreduce_(F(np.ones(4, np.float32)), op=cring.Sum, name="warm")
    stream = fake_cuda.created_stream(0)
    assert stream, "cring's stream was not created"
    return stream


def room(r: int, p: int, out: dict) -> None:
    import fake_torch_cuda
    import torch

    fake_torch_cuda.install()
    cuda = fake_torch_cuda.cuda
    t, s = fake_torch_cuda.current_stream(), 0x5150 + r
    x = cuda(torch.arange(6, dtype=torch.float32).reshape(3, 2) + 10 * r)
    parts = [torch.arange(6, dtype=torch.float32).reshape(3, 2) + 10 * q for q in range(p)]
    want = torch.cat(parts)
    cring.allgather(x, name="warm")
    for k in range(3):
        tmp = fake_torch_cuda.empty((3 * p, 2), torch.float32)  # the size of the result
        fake_cuda.kernel(t, tmp.data_ptr(), 0x55, tmp.numel() * 4, BUSY_US)  # T still writes it
        del tmp  # freed at once: torch's next allocation on T may take it
        with _gpu.use_stream(s):
            y = cring.allgather(x, name=f"room{k}")
        fake_cuda.drain(s)  # the result is ordered on S
        if not torch.equal(y, want):  # torch reads it on T
            out["bad"].append(f"room{k}: {summary(y.numpy())}")


def third_stream(r: int, p: int, out: dict) -> None:
    ours = warm_up()
    side, n = 0x7000 + r, 4096
    for variant in ("synchronized", "dropped"):
        with _gpu.use_stream(side):
            a = F(np.full(n, r + 1.0, np.float32))  # allocated on the side stream
        cring.barrier()
        fake_cuda.busy(ours, BUSY_US)
        h = cring.allreduce_async_(a, op=cring.Sum, name=f"third.{variant}")  # legacy stream
        if variant == "synchronized":
            cring.synchronize(h)
            del h
        else:
            del h  # dropped in flight: cring keeps what it needs
            cring.barrier()  # the allreduce ran (was queued) before this
            cring.barrier()  # and a sweep of dropped handles ran since
        del a
        gc.collect()
        with _gpu.use_stream(side):
            b = F(np.full(n, 7.0, np.float32))  # the side stream's next allocation
        fake_cuda.drain(ours)  # cring's stream has run everything queued
        with _gpu.use_stream(side):
            got = np.array(b.array, copy=True)
        if not (got == 7.0).all():
            out["bad"].append(f"{variant}: {summary(got)}")


def failed_batch(r: int, p: int, out: dict) -> None:
    ours = warm_up()
    small = F(np.full(256, r + 1.0, np.float32))
    big = F(np.zeros(32768, np.float32))  # 128 KiB: more than CRING_FAKE_NCCL_SLOT_BYTES
    fake_cuda.busy(ours, BUSY_US)
    try:
        cring.grouped_allreduce_([small, big], op=cring.Sum, name="fails")
        out["raised"] = None
    except (cring.CRingError, ValueError) as e:  # NCCL's invalid argument: ValueError
        out["raised"] = type(e).__name__
        out["message"] = str(e)
    del small, big
    gc.collect()
    b = F(np.full(256, 7.0, np.float32))  # the legacy stream's next allocation
    fake_cuda.drain(ours)
    got = np.array(b.array, copy=True)
    if not (got == 7.0).all():
        out["bad"].append(f"after the failed batch: {summary(got)}")
    after = F(np.ones(3, np.float32))  # the communicator still works
    cring.allreduce_(after, op=cring.Sum, name="after")
    out["after"] = after.array.tolist()


def main() -> None:
    mode = sys.argv[1]
    cring.init()
    r, p = cring.rank(), cring.size()
    out: dict = {"rank": r, "size": p, "pid": os.getpid(), "mode": mode, "bad": []}
    {"room": room, "third_stream": third_stream, "failed_batch": failed_batch}[mode](r, p, out)
    cring.shutdown()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()

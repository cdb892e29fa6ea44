"""Worker for tests/test_handles.py (2 ranks): handles dropped while their
collective is in flight, and waits that a signal interrupts.

    handles.py <out_dir> dropped <allreduce|allgather|broadcast>
    handles.py <out_dir> sigint

Each rank writes <out_dir>/rank<R>.json: {"problems": [...], ...}.
"""

import gc
import json
import os
import signal
import sys
import threading
import time

import numpy as np
import torch

import cring.torch as hvd

out_dir, scenario = sys.argv[1], sys.argv[2]
hvd.init()
rank = hvd.rank()
problems: list = []
result: dict = {}


def dropped(kind: str) -> None:
    """Rank 0 submits "x" and drops the handle at once, then waits in a
    barrier; rank 1 submits "x" only after that barrier. Dropping must not
    wait for "x" (which needs rank 1), and the engine must keep rank 0's
    tensor alive until "x" has run."""
    if rank == 0:
        t = torch.full((2,), 1.0)
        if kind == "allreduce":
            hvd.allreduce_async(t, name="x", op=hvd.Sum)
        elif kind == "allgather":
            hvd.allgather_async(torch.zeros(2), name="x")
        else:
            hvd.broadcast_async(torch.full((2,), 7.0), 0, name="x")
        del t
        gc.collect()
        hvd.barrier()
    else:
        hvd.barrier()
        if kind == "allreduce":
            got = hvd.synchronize(hvd.allreduce_async(torch.full((2,), 2.0), name="x", op=hvd.Sum))
            want = [3.0, 3.0]
        elif kind == "allgather":
            got = hvd.synchronize(hvd.allgather_async(torch.ones(3), name="x"))
            want = [0.0, 0.0, 1.0, 1.0, 1.0]
        else:
            got = hvd.synchronize(hvd.broadcast_async(torch.zeros(2), 0, name="x"))
            want = [7.0, 7.0]
        if got.tolist() != want:
            problems.append(f"{kind}: rank 1 got {got.tolist()}, expected {want}")
    hvd.barrier()  # "x" has run everywhere; rank 0's dropped views are swept
    again = hvd.allreduce(torch.full((2,), float(rank)), name="after", op=hvd.Sum)
    if again.tolist() != [1.0, 1.0]:
        problems.append(f"after the dropped {kind}: got {again.tolist()}")


def interrupted(label: str, wait) -> None:
    """Rank 0 blocks in `wait` on a collective rank 1 never submits; a SIGINT
    one second later must raise KeyboardInterrupt at once."""
    sent = []
    timer = threading.Timer(
        1.0, lambda: (sent.append(time.monotonic()), os.kill(os.getpid(), signal.SIGINT))
    )
    timer.start()
    try:
        wait()
        problems.append(f"{label}: returned although rank 1 never submitted")
    except KeyboardInterrupt:
        result[label] = time.monotonic() - sent[0]
    timer.join()


def sigint() -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if rank == 0:
        t = torch.ones(2)
        interrupted("synchronize", lambda: hvd.synchronize(hvd.allreduce_async(t, name="never.1")))
        interrupted("allreduce_ numpy", lambda: hvd.allreduce_(np.ones(2), name="never.2"))
        interrupted("allreduce_ torch", lambda: hvd.allreduce_(torch.ones(2), name="never.3"))
        interrupted("allgather", lambda: hvd.allgather(torch.ones(2), name="never.4"))
        hvd.barrier()  # tell rank 1 to go on
    else:
        hvd.barrier()  # arrives only after rank 0's interrupts
    # both ranks still work after an interrupted wait
    got = hvd.allreduce(torch.full((2,), float(rank)), name="after", op=hvd.Sum)
    if got.tolist() != [1.0, 1.0]:
        problems.append(f"after the interrupts: got {got.tolist()}")


if scenario == "dropped":
    dropped(sys.argv[3])
else:
    sigint()
hvd.shutdown()
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump({"problems": problems, **result}, f)

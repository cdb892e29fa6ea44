"""Worker: a rank that is late, or never comes.

Usage: engine_stall.py warn LATE_SECONDS
    Every rank but rank 1 submits 'late_tensor' at once; rank 1 submits it
    LATE_SECONDS later (run with CRING_STALL_CHECK_SECONDS below that). Done
    twice: the second time the name is in the response cache. Each rank
    prints "rank R: late_tensor pass P ok" once the result is right.

Usage: engine_stall.py shutdown SLEEP_SECONDS
    Rank 0 submits 'never_tensor', which rank 1 never submits (rank 1 sleeps
    SLEEP_SECONDS, then tries another op). Run with
    CRING_STALL_SHUTDOWN_SECONDS: rank 0 prints
    "rank 0: <ErrorType> after S s: <message>", every rank then checks the
    broken communicator refuses new work, shuts down, initialises again and
    runs one allreduce. Exits 0 when all of that behaved as described.
"""

import sys
import time

import numpy as np

import cring


def warn(late_s):
    cring.init()
    rank, size = cring.rank(), cring.size()
    ok = True
    for rep in range(2):
        # start together, so that only rank 1's lateness separates the ranks
        cring.allreduce(np.zeros(1), name=f"start.{rep}")
        x = np.full(6, rank + 1 + rep, dtype=np.float32)
        if rank == 1:
            time.sleep(late_s)  # the slow rank, not synchronisation
        t0 = time.monotonic()
        out = cring.synchronize(cring.allreduce_async(x, op=cring.Sum, name="late_tensor"))
        ref = np.full(6, sum(range(1, size + 1)) + size * rep, dtype=np.float32)
        if np.array_equal(out, ref):
            print(
                f"rank {rank}: late_tensor pass {rep} ok after {time.monotonic() - t0:.1f} s",
                flush=True,
            )
        else:
            print(f"rank {rank}: late_tensor pass {rep} wrong: {out} != {ref}", flush=True)
            ok = False
    cring.shutdown()
    sys.exit(0 if ok else 1)


def shutdown(sleep_s):
    cring.init()
    rank, size = cring.rank(), cring.size()
    ok = True
    if rank == 1:
        time.sleep(sleep_s)  # the rank that never submits 'never_tensor'
        try:
            cring.allreduce(np.ones(2), name="after_stall")
            print("rank 1: allreduce after the stall did not raise", flush=True)
            ok = False
        except cring.CRingError as e:
            print(f"rank 1: {type(e).__name__}: {e}", flush=True)
    else:
        t0 = time.monotonic()
        h = cring.allreduce_async(np.ones(3, dtype=np.float32), name="never_tensor")
        try:
            cring.synchronize(h)
            print(f"rank {rank}: never_tensor completed", flush=True)
            ok = False
        except cring.CRingError as e:
            print(
                f"rank {rank}: {type(e).__name__} after {time.monotonic() - t0:.1f} s: {e}",
                flush=True,
            )
        # the communicator is broken: new work is refused at once
        t0 = time.monotonic()
        try:
            cring.allreduce(np.ones(2), name="after_stall")
            print(f"rank {rank}: allreduce after the stall did not raise", flush=True)
            ok = False
        except cring.CRingError as e:
            print(
                f"rank {rank}: refused after {time.monotonic() - t0:.1f} s: "
                f"{type(e).__name__}: {e}",
                flush=True,
            )
    # shutdown() and init() again make a working communicator
    cring.shutdown()
    cring.init()
    total = cring.allreduce(np.full(2, rank, dtype=np.int32), op=cring.Sum, name="reinit")
    if total.tolist() == [sum(range(size))] * 2:
        print(f"rank {rank}: works after re-init", flush=True)
    else:
        print(f"rank {rank}: wrong result after re-init: {total}", flush=True)
        ok = False
    cring.shutdown()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    {"warn": warn, "shutdown": shutdown}[sys.argv[1]](float(sys.argv[2]))

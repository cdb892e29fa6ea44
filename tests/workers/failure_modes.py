"""Worker for tests/test_failure.py: a stream of large allreduces (plus a few
asynchronous ones in flight) until a peer fails; the test kills (SIGKILL) or
freezes (SIGSTOP) one rank from outside, at a random moment, so the failure
lands in the middle of a collective.

Usage: failure_modes.py OUT_DIR ELEMENTS [--reinit PORT SURVIVORS]

Every rank writes OUT_DIR/ready<R> after its first allreduce. A survivor
prints one line 'SURVIVOR <rank> raised <Type> after <s>s: <message>', checks
that its in-flight asynchronous handles finish or raise (none hangs) and that
the next call raises, shuts down and exits 0. With --reinit, survivors then join a new job
of the survivors only (SURVIVORS: their old ranks, comma-separated; the
rendezvous at 127.0.0.1:PORT is served by the lowest survivor) and check a
Sum allreduce: the process is reusable after a failure.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

import cring

out_dir, elements = Path(sys.argv[1]), int(sys.argv[2])
reinit_port = int(sys.argv[sys.argv.index("--reinit") + 1]) if "--reinit" in sys.argv else None

cring.init()
rank, size = cring.rank(), cring.size()
big = np.ones(elements, np.float32)
small = [np.full(1000, rank, np.float64) for _ in range(4)]

for i in range(1_000_000):
    handles = []
    t0 = time.monotonic()
    try:
        handles = [
            cring.allreduce_async(small[k], op=cring.Sum, name=f"async.{i}.{k}")
            for k in range(len(small))
        ]
        cring.allreduce_(big, op=cring.Average, name=f"big.{i}")
        for h in handles:
            assert cring.synchronize(h)[0] == sum(range(size))
    except cring.CRingError as e:
        took = time.monotonic() - t0
        print(f"SURVIVOR {rank} raised {type(e).__name__} after {took:.2f}s: {e}", flush=True)
        failed_handles = 0
        for h in handles:
            try:
                cring.synchronize(h)
            except cring.CRingError:
                failed_handles += 1
        # each one finished (before the failure) or raises; none hangs
        print(
            f"SURVIVOR {rank} in-flight handles: {len(handles)}, raised: {failed_handles}",
            flush=True,
        )
        try:
            cring.allreduce_(big, name="after")
            print(f"SURVIVOR {rank} next call returned (wrong)", flush=True)
            sys.exit(3)
        except cring.CRingError as e2:
            print(f"SURVIVOR {rank} next call raised {type(e2).__name__}: {e2}", flush=True)
        cring.shutdown()
        assert not cring.is_initialized()
        if reinit_port is not None:
            survivors = [int(r) for r in sys.argv[sys.argv.index("--reinit") + 2].split(",")]
            new_rank = survivors.index(rank)
            cring.init(rank=new_rank, size=len(survivors), addr="127.0.0.1", port=reinit_port)
            x = np.full(10, rank, np.int64)
            cring.allreduce_(x, op=cring.Sum)
            assert (x == sum(survivors)).all(), x
            print(
                f"SURVIVOR {rank} re-initialised as rank {new_rank} of {len(survivors)} "
                f"over {cring.transport()}: allreduce ok",
                flush=True,
            )
            cring.shutdown()
        sys.exit(0)
    if i == 0:
        (out_dir / f"ready{rank}").write_text("ok")
print(f"rank {rank} never saw a failure", flush=True)
sys.exit(1)

"""Worker for tests/test_failure.py: a peer that is alive but never submits a
name, and a peer that leaves cleanly, as the others see them (issue 15,
item 7).

Usage: absent_peer.py MODE OUT_DIR

  timeout: rank 1 passes a non-contiguous torch tensor to
           cring.torch.allreduce_ (ValueError: it never submits 'x'); rank 0's
           allreduce of 'x' must raise cring.TimeoutError naming 'x' and rank
           1 within CRING_TIMEOUT_SECONDS + 2 s. Rank 1 waits for rank 0's
           verdict (a file in OUT_DIR, not a sleep), then both ranks run
           another allreduce, which must succeed: the engine stays usable.
  left:    rank 1 calls cring.shutdown() and exits; rank 0's pending
           allreduce of 'x' must raise PeerFailureError saying rank 1 left.

Rank 0 prints 'RESULT <Type> <seconds>: <message>'; every rank prints
'DONE <rank>' and exits 0 when its part went as described.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

import cring
import cring.torch as hvd

mode, out_dir = sys.argv[1], Path(sys.argv[2])
cring.init()
rank = cring.rank()
x = torch.ones(8)
hvd.allreduce_(x, name="warm-up")  # both ranks are up and connected

if mode == "timeout":
    if rank == 1:
        try:
            hvd.allreduce_(torch.ones(4, 4)[:, ::2], name="x")
            sys.exit("rank 1: a non-contiguous tensor was accepted")
        except ValueError:
            pass
        deadline = time.monotonic() + 60
        while not (out_dir / "verdict0").exists():  # rank 0's allreduce has failed
            if time.monotonic() > deadline:
                sys.exit("rank 1: rank 0 never reported its verdict")
            time.sleep(0.05)
    else:
        t0 = time.monotonic()
        try:
            hvd.allreduce_(torch.ones(8), name="x")
            sys.exit("rank 0: the allreduce of 'x' completed without rank 1")
        except cring.TimeoutError as e:
            print(f"RESULT {type(e).__name__} {time.monotonic() - t0:.2f}: {e}", flush=True)
        (out_dir / "verdict0").write_text("done")
    y = torch.full((4,), float(rank))
    hvd.allreduce_(y, op=hvd.Sum, name="after")
    assert y.tolist() == [1.0] * 4, y
    cring.shutdown()
elif mode == "left":
    if rank == 1:
        cring.shutdown()
    else:
        t0 = time.monotonic()
        try:
            hvd.allreduce_(torch.ones(8), name="x")
            sys.exit("rank 0: the allreduce of 'x' completed without rank 1")
        except cring.PeerFailureError as e:
            print(f"RESULT {type(e).__name__} {time.monotonic() - t0:.2f}: {e}", flush=True)
        cring.shutdown()
print(f"DONE {rank}", flush=True)

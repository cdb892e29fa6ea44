"""Worker: rank 1 kills itself (SIGKILL) in the middle of a stream of
allreduces; every survivor must raise PeerFailureError (or TimeoutError)
promptly instead of hanging. Survivors print 'SURVIVOR <rank> raised <Type>
after <seconds>' and exit 0."""

import os
import signal
import sys
import time

import numpy as np

import cring

cring.init()
rank, size = cring.rank(), cring.size()
victim = 1
x = np.ones(int(sys.argv[1]) if len(sys.argv) > 1 else 1000, np.float32)
for i in range(200):
    if rank == victim and i == 50:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        t0 = time.monotonic()
        cring.allreduce_(x, op=cring.Average, name=f"step.{i}")
    except (cring.PeerFailureError, cring.TimeoutError) as e:
        print(
            f"SURVIVOR {rank} raised {type(e).__name__} after {time.monotonic() - t0:.2f}s: {e}",
            flush=True,
        )
        try:  # the engine refuses further work instead of hanging
            cring.allreduce_(x, name="after")
        except cring.CRingError as e2:
            print(f"SURVIVOR {rank} next call raised {type(e2).__name__}", flush=True)
        cring.shutdown()
        sys.exit(0)
print(f"rank {rank} never saw the failure", flush=True)
sys.exit(1)

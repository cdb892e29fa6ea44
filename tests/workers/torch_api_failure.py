"""Worker: a communication failure surfaces as hvd.HorovodInternalError, and
the Horovod recovery (shutdown(), init()) works.

Every rank submits a name that no other rank submits ('only.<rank>'), so
every collective stalls; run with CRING_STALL_SHUTDOWN_SECONDS, the stall
fails them all with cring.TimeoutError, which cring.torch raises as
HorovodInternalError (also a cring.TimeoutError, with the original as
__cause__). New work on the broken communicator is refused with a
HorovodInternalError too. After shutdown() and init() an allreduce works.
Each rank prints "rank R: <what happened>" lines; exits 1 on a failure.
"""

import sys

import torch

import cring
import cring.torch as hvd

hvd.init()
rank, size = hvd.rank(), hvd.size()
ok = True


def report(line, good):
    global ok
    ok = ok and good
    print(f"rank {rank}: {line}", flush=True)


handle = hvd.allreduce_async(torch.ones(3), name=f"only.{rank}")
try:
    hvd.synchronize(handle)
    report("the stalled allreduce completed", False)
except hvd.HorovodInternalError as e:
    report(
        f"HorovodInternalError {type(e).__name__} timeout={isinstance(e, cring.TimeoutError)} "
        f"cause={type(e.__cause__).__name__}: {e}",
        isinstance(e, cring.TimeoutError)
        and isinstance(e.__cause__, cring.TimeoutError)
        and f"only.{rank}" in str(e),
    )

try:
    hvd.allreduce(torch.ones(2), name="after_stall")
    report("allreduce on the broken communicator did not raise", False)
except hvd.HorovodInternalError as e:
    report(
        f"refused: HorovodInternalError cause={type(e.__cause__).__name__}",
        isinstance(e.__cause__, cring.CRingError),
    )

hvd.shutdown()
hvd.init()
total = hvd.allreduce(torch.full((2,), float(rank)), op=hvd.Sum, name="reinit")
report(f"works after re-init: {total.tolist()}", total.tolist() == [float(sum(range(size)))] * 2)
hvd.shutdown()
sys.exit(0 if ok else 1)

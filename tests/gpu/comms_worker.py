"""One rank of tests/test_gpu_comms.py: NCCL communicators that belong to the
engine that made them (the global set's, each process set's), against the
test doubles on FakeCudaTensor inputs. Started directly with CRING_RANK/
CRING_SIZE/CRING_ADDR/CRING_PORT; prints one JSON line. Every value read on
the host is read after synchronize(block_host=True), so the checks hold on a
GPU that runs work late. argv: mode ("set", "subset" or "gate"), then the
mode's own.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

import cring  # noqa: E402
from cring import _gpu  # noqa: E402

from fake_cuda import FakeCudaTensor as F  # noqa: E402


def summed(x: F, name: str, **kw) -> np.ndarray:
    """allreduce_async_ (Sum) of x, waited for on the host too."""
    cring.synchronize(cring.allreduce_async_(x, op=cring.Sum, name=name, **kw), block_host=True)
    return x.array


def global_steps(r: int, p: int, n: int, tag: str) -> tuple[bool, float]:
    """n CUDA allreduces on the global set: (all exact, seconds taken)."""
    t0 = time.perf_counter()
    exact = True
    for k in range(n):
        got = summed(F(np.arange(5, dtype=np.float32) + r + k), f"{tag}{k}")
        want = sum(np.arange(5, dtype=np.float32) + q + k for q in range(p))
        exact &= bool(np.array_equal(got, want))
    return exact, time.perf_counter() - t0


def set_collectives(ps: cring.ProcessSet, root: int, out: dict) -> None:
    """Every collective of CUDA tensors on a set this rank is in (broadcast
    from global rank `root`): their values."""
    r, p = ps.rank(), ps.size()
    out["set_allreduce"] = summed(F(np.full(6, r + 1, np.float32)), "s.ar", process_set=ps).tolist()
    b = F(np.full(3, 10.0 * r, np.float64))
    cring.synchronize(
        cring.broadcast_async_(b, root_rank=root, name="s.bc", process_set=ps),
        block_host=True,
    )
    out["set_broadcast"] = b.array.tolist()
    h = cring.allgather_async(F(np.full((r + 1, 2), r, np.int32)), name="s.ag", process_set=ps)
    out["set_allgather"] = cring.synchronize(h, block_host=True).array.tolist()
    h = cring.reducescatter_async(
        F(np.arange(4 * p, dtype=np.float32).reshape(2 * p, 2)),
        op=cring.Sum,
        name="s.rs",
        process_set=ps,
    )
    out["set_reducescatter"] = cring.synchronize(h, block_host=True).array.tolist()
    h = cring.alltoall_async(F(np.full((p, 1), r, np.int64)), name="s.a2a", process_set=ps)
    y, received = cring.synchronize(h, block_host=True)
    out["set_alltoall"] = [y.array.ravel().tolist(), list(received)]


def one_rank_set(r: int, p: int, out: dict) -> None:
    """Set {0} of 2 ranks: rank 0 runs every collective of CUDA tensors on it
    (through NCCL, on the set's own communicator), every rank removes it, then
    20 CUDA allreduces on the global set."""
    summed(F(np.ones(4, np.float32)), "warm")
    before = _gpu.stats()
    ps = cring.add_process_set([0])
    if ps.included():
        set_collectives(ps, 0, out)
    during = _gpu.stats()
    cring.remove_process_set(ps)
    after = _gpu.stats()
    out["exact"], out["seconds"] = global_steps(r, p, 20, "after")
    out["staged"] = during["staged_bytes"] - before["staged_bytes"]
    out["made"] = during["communicators"] - before["communicators"]
    out["live"] = [before["live_communicators"], during["live_communicators"]]
    out["live_after"] = after["live_communicators"]
    out["nccl_calls"] = during["nccl_calls"] - before["nccl_calls"]


def strict_subset(r: int, p: int, out: dict) -> None:
    """Set {0, 1} of 3 ranks: the members run the set's CUDA allreduces between
    global ones while rank 2 runs only the global ones; then the set is
    removed and 20 global CUDA allreduces follow."""
    summed(F(np.ones(4, np.float32)), "warm")
    ps = cring.add_process_set([0, 1])
    staged = _gpu.stats()["staged_bytes"]
    if ps.included():
        set_collectives(ps, 1, out)
    exact = True
    for k in range(5):
        if ps.included():
            got = summed(F(np.full(3, r + k, np.float32)), f"set{k}", process_set=ps)
            exact &= bool(np.array_equal(got, np.full(3, 1 + 2 * k, np.float32)))
        got = summed(F(np.full(3, r * k, np.float32)), f"both{k}")
        exact &= bool(np.array_equal(got, np.full(3, k * p * (p - 1) / 2, np.float32)))
    out["during"] = exact
    out["live_during"] = _gpu.stats()["live_communicators"]
    out["staged"] = _gpu.stats()["staged_bytes"] - staged
    cring.remove_process_set(ps)
    out["live_after"] = _gpu.stats()["live_communicators"]
    out["exact"], out["seconds"] = global_steps(r, p, 20, "after")


def gated(r: int, p: int, out: dict) -> None:
    """The engine is held inside ncclCommInitRank (cuda:1's communicator, by the
    fake's CRING_FAKE_NCCL_INIT_GATE) while this thread synchronizes a handle
    that completed on cuda:0 and another thread keeps counting: synchronize
    returns and the counter goes on while the set-up is still held."""
    gate = os.environ["CRING_FAKE_NCCL_INIT_GATE"]  # this rank's (main)
    log = os.environ["CRING_FAKE_NCCL_LOG"]
    me = f"pid={os.getpid()}"

    def inits(word: str) -> int:
        with open(log) as f:
            return sum(1 for line in f if line.split()[:2] == [me, word])

    summed(F(np.ones(4, np.float32)), "warm")  # cuda:0's communicator (not gated)
    y = F(np.full(4, r, np.float32))
    h1 = cring.allreduce_async_(y, op=cring.Sum, name="y")
    while not cring.poll(h1):  # the engine thread runs it (polling, not waiting)
        time.sleep(0.001)
    z = F(np.full(4, r + 1, np.float32), device=1)
    h2 = cring.allreduce_async_(z, op=cring.Sum, name="z")  # cuda:1: a new communicator
    deadline = time.monotonic() + 30
    while inits("initstart") == 0:
        assert time.monotonic() < deadline, "the engine never started cuda:1's set-up"
        time.sleep(0.005)
    count, stop = [0], threading.Event()

    def counter() -> None:
        while not stop.is_set():
            count[0] += 1
            time.sleep(0.0005)

    thread = threading.Thread(target=counter, daemon=True)  # a failure below must not hang
    thread.start()
    # checks cuda:0's communicator first; must not wait for the engine
    cring.synchronize(h1, block_host=True)
    seen = count[0]
    deadline = time.monotonic() + 30
    while count[0] < seen + 50 and time.monotonic() < deadline:
        time.sleep(0.001)
    out["counted"] = count[0] - seen
    out["held"] = inits("init") == 1 and inits("initfail") == 0  # cuda:1 still in set-up
    out["y"] = y.array.tolist()  # h1 was done before cuda:1's set-up began
    Path(gate).touch()
    cring.synchronize(h2, block_host=True)
    stop.set()
    thread.join()
    out["z"] = z.array.tolist()
    out["live"] = _gpu.stats()["live_communicators"]


def main() -> None:
    mode = sys.argv[1]
    if mode == "gate":  # each rank its own gate, set before any thread of cring runs
        os.environ["CRING_FAKE_NCCL_INIT_GATE"] = f"{sys.argv[2]}.{os.environ['CRING_RANK']}"
    cring.init()
    r, p = cring.rank(), cring.size()
    out: dict = {"rank": r, "size": p, "mode": mode}
    {"set": one_rank_set, "subset": strict_subset, "gate": gated}[mode](r, p, out)
    cring.shutdown()
    out["live_at_exit"] = _gpu.stats()["live_communicators"]
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()

"""Ordering and lifetime with real CUDA and torch's real caching allocator
(issue 33, item 4): one rank of the first step of tests/gpu/device_check.sh,
which runs it under `cring.run -np 2` on the one GPU through host staging
(CRING_GPU_OPERATIONS=host: NCCL refuses two ranks on one device), plain and
under TORCH_CUDA_SANITIZER=1, and at world size 1 through NCCL (where the
gradient buckets live). With --fake it runs the same checks on this machine
against the test doubles (csrc/tests/fake_*.c) and torch dressed as a CUDA
build (tests/gpu/fake_torch_cuda.py), as tests/test_gpu_ordering.py does.

Checks, each PASS/FAIL with its detail, every value compared exactly:
  side_streams          a producer on a side stream (slowed down first) and
                        collectives inside torch.cuda.stream(side): results
                        right once the default stream waits for the side one
  freed_after_sync      tensors allocated on a third stream, reduced on the
                        default stream, freed right after synchronize(); the
                        third stream's next allocations (torch may hand them
                        the same blocks at once) are filled with 7s and must
                        stay 7s
  process_sets          a set (every rank but the last) added, used on CUDA,
                        removed, between global CUDA calls; then 20 global
                        allreduces, exact, < 10 s
  bucket_with_traffic   (NCCL path only) after steps that teach cring a
                        gradient bucket, half of it submitted while another
                        thread runs 2 s of CPU allreduces: the held half
                        completes while that traffic flows
Writes <out>/rank<R>.json ([{"check", "ok", "detail", "seconds"}]) and prints
one line per check. argv: --out DIR [--fake] [--checks a,b,...].
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).parent))

RESULTS: list = []


def check(name: str, fn: Callable[[], Any]) -> None:
    t0 = time.perf_counter()
    try:
        detail, ok = fn(), True
    except Exception as error:  # noqa: BLE001  (a failed check is reported; the next runs)
        detail, ok = f"{type(error).__name__}: {error}\n{traceback.format_exc()[-1500:]}", False
    RESULTS.append({"check": name, "ok": ok, "detail": detail, "seconds": time.perf_counter() - t0})
    print(f"{'PASS' if ok else 'FAIL'} {name}: {str(detail)[:300]}", flush=True)


def expect(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(what)


class RealCuda:
    """torch on a GPU: its streams, its caching allocator, torch.cuda._sleep."""

    def __init__(self, torch: Any):
        self.torch = torch
        self.dev = torch.device("cuda", 0)
        torch.cuda.set_device(self.dev)

    def new_stream(self) -> Any:
        return self.torch.cuda.Stream(self.dev)

    def on(self, s: Any) -> Any:
        return self.torch.cuda.stream(s)

    def current(self) -> Any:
        return self.torch.cuda.current_stream(self.dev)

    def full(self, n: int, value: float) -> Any:
        return self.torch.full((n,), value, dtype=self.torch.float32, device=self.dev)

    def slow(self, s: Any, ms: int) -> None:
        """s is busy for about ms milliseconds (a kernel that spins)."""
        with self.torch.cuda.stream(s):
            self.torch.cuda._sleep(int(ms * 1.5e6))  # ~1.5 GHz clocks

    def wait(self, waiter: Any, waited: Any) -> None:
        waiter.wait_stream(waited)

    def sync(self) -> None:
        self.torch.cuda.synchronize()


class FakeCuda:
    """The same on the test doubles: torch dressed as a CUDA build, streams as
    numbers, the stand-in caching allocator, slow "kernels" of the fake GPU."""

    def __init__(self, torch: Any):
        import fake_torch_cuda

        import fake_cuda

        fake_torch_cuda.install()
        self.torch, self.fc, self.ft = torch, fake_cuda, fake_torch_cuda
        self.streams = {fake_torch_cuda.current_stream()}
        self.next = 0x9000

    def new_stream(self) -> int:
        self.next += 1
        self.streams.add(self.next)
        return self.next

    def on(self, s: int) -> Any:
        return self.ft.stream(s)

    def current(self) -> int:
        return self.ft.current_stream()

    def full(self, n: int, value: float) -> Any:
        t = self.ft.empty((n,), self.torch.float32)
        t.fill_(value)
        return t

    def slow(self, s: int, ms: int) -> None:
        self.fc.busy(s, ms * 1000)

    def wait(self, waiter: int, waited: int) -> None:
        self.fc.order(waiter, waited)

    def sync(self) -> None:
        for s in list(self.streams) + [self.fc.created_stream(0)]:
            if s:
                self.fc.drain(s)


def side_streams(cu: Any, cring: Any) -> str:
    r, p = cring.rank(), cring.size()
    side = cu.new_stream()
    want = float(sum(q + 1 for q in range(p)))
    with cu.on(side):
        cu.slow(side, 50)  # the producer is late on its stream
        x = cu.full(4096, r + 1.0)
        y = cring.allreduce(x, op=cring.Sum, name="order.side.out")
        cring.allreduce_(x, op=cring.Sum, name="order.side.in")
        g = cring.allgather(cu.full(8, float(r)), name="order.side.gather")
    cu.wait(cu.current(), side)
    expect(bool((x == want).all()), f"in place: {x[:4].tolist()} instead of {want}")
    expect(bool((y == want).all()), f"out of place: {y[:4].tolist()} instead of {want}")
    gw = [float(q) for q in range(p) for _ in range(8)]
    expect(g.tolist() == gw, f"allgather: {g.tolist()[:10]}")
    return f"{p} ranks, exact"


def freed_after_sync(cu: Any, cring: Any) -> str:
    r, p = cring.rank(), cring.size()
    third = cu.new_stream()
    bad, rounds = [], 20
    for k in range(rounds):
        n = 1024 * (1 + k % 4)
        with cu.on(third):
            a = cu.full(n, r + 1.0)
        cu.wait(cu.current(), third)  # the default stream may use it now
        if k % 2:
            cring.synchronize(cring.allreduce_async_(a, op=cring.Sum, name=f"order.freed.{k}"))
        else:
            cring.allreduce_(a, op=cring.Sum, name=f"order.freed.{k}")
        del a  # right after synchronize: torch may hand its block out again
        with cu.on(third):
            b = cu.full(n, 7.0)  # the third stream's next allocation
        cu.sync()
        if not bool((b == 7.0).all()):
            bad.append(f"round {k}: {sorted(set(b.tolist()))[:4]}")
    expect(not bad, "; ".join(bad))
    return f"{rounds} rounds, {p} ranks: every later allocation kept its 7s"


def process_sets(cu: Any, cring: Any) -> str:
    r, p = cring.rank(), cring.size()
    expect(p >= 2, "needs 2 ranks or more (a set other than the global one)")
    x = cu.full(16, r + 1.0)
    cring.allreduce_(x, op=cring.Sum, name="order.ps.before")
    members = list(range(p - 1))  # every rank but the last (the global set has them all)
    ps = cring.add_process_set(members)
    y = cu.full(16, 2.0 * (r + 1))
    if r in members:
        cring.allreduce_(y, op=cring.Sum, name="order.ps.inside", process_set=ps)
    z = cu.full(16, 1.0)
    cring.allreduce_(z, op=cring.Sum, name="order.ps.between")
    cring.remove_process_set(ps)
    t0 = time.perf_counter()
    outs = []
    for k in range(20):
        w = cu.full(16, float(k + r))
        cring.allreduce_(w, op=cring.Sum, name=f"order.ps.after.{k}")
        outs.append(w)
    cu.sync()
    elapsed = time.perf_counter() - t0
    s = float(sum(q + 1 for q in range(p)))
    in_set = float(sum(2 * (q + 1) for q in members)) if r in members else 2.0 * (r + 1)
    expect(bool((x == s).all()) and bool((z == p).all()), "the global calls around the set")
    expect(bool((y == in_set).all()), f"inside the set {members}: {y[:2].tolist()}")
    for k, w in enumerate(outs):
        want = float(sum(k + q for q in range(p)))
        expect(bool((w == want).all()), f"global allreduce {k} after the set: {w[:2].tolist()}")
    expect(elapsed < 10, f"20 global allreduces took {elapsed:.1f} s")
    return f"20 global allreduces after removing the set in {elapsed:.2f} s"


def bucket_with_traffic(cu: Any, cring: Any) -> str:
    import numpy as np

    p = cring.size()
    names = [f"order.bucket.{i}" for i in range(8)]
    grads = [cu.full(1 << 14, 1.0) for _ in names]
    for _ in range(3):  # steps: cring learns the bucket
        hs = [cring.allreduce_async_(g, op=cring.Sum, name=n) for g, n in zip(grads, names)]
        for h in hs:
            cring.synchronize(h)
    stop = threading.Event()

    def traffic() -> None:
        """CPU allreduces for 2 s; each carries whether its rank wants to go
        on (the Min of them), so every rank runs the same ones."""
        deadline = time.perf_counter() + 2.0
        k = 0
        while True:
            more = np.array([1.0 if time.perf_counter() < deadline else 0.0], np.float32)
            cring.allreduce_(more, op=cring.Min, name=f"order.traffic.{k}")
            k += 1
            if more[0] == 0.0:
                break
        stop.set()

    cring.barrier()
    thread = threading.Thread(target=traffic)
    thread.start()
    time.sleep(0.1)
    half = [cring.allreduce_async_(g, op=cring.Sum, name=n) for g, n in zip(grads[:4], names[:4])]
    t0 = time.perf_counter()
    while not all(cring.poll(h) for h in half) and not stop.is_set():
        time.sleep(0.01)
    during = all(cring.poll(h) for h in half)
    waited = time.perf_counter() - t0
    thread.join()
    for h in half:
        cring.synchronize(h)
    rest = [cring.allreduce_async_(g, op=cring.Sum, name=n) for g, n in zip(grads[4:], names[4:])]
    for h in rest:
        cring.synchronize(h)
    expect(during, f"the held half of the bucket was still held after {waited:.1f} s of traffic")
    return f"the held half completed after {waited * 1e3:.0f} ms with traffic flowing ({p} ranks)"


CHECKS = {
    "side_streams": side_streams,
    "freed_after_sync": freed_after_sync,
    "process_sets": process_sets,
    "bucket_with_traffic": bucket_with_traffic,
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--fake", action="store_true", help="the test doubles, not a GPU")
    ap.add_argument("--checks", default=",".join(CHECKS))
    args = ap.parse_args()
    import torch

    cu = FakeCuda(torch) if args.fake else RealCuda(torch)
    import cring

    cring.init()
    r = cring.rank()
    host = os.environ.get("CRING_GPU_OPERATIONS", "").lower() == "host"
    for name in args.checks.split(","):
        if name == "bucket_with_traffic" and host:
            continue  # host-staged CUDA tensors are CPU requests to the engine: no buckets
        check(name, lambda fn=CHECKS[name]: fn(cu, cring))
    cring.shutdown()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{r}.json").write_text(json.dumps(RESULTS, indent=1))
    return 0 if all(x["ok"] for x in RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main())

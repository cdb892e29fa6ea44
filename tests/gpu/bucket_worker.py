"""One rank of tests/test_gpu_buckets.py: gradient buckets of the CUDA path
(csrc/engine/bucket.c) against the test doubles (CRING_NCCL_LIBRARY=
libfake_nccl.so, CRING_CUDART_LIBRARY=libfake_cudart.so) on FakeCudaTensor
gradients. Started directly with CRING_RANK/CRING_SIZE/CRING_ADDR/CRING_PORT.
Prints one JSON line. argv: mode, then its arguments:

  replay MODEL STEPS  DistributedOptimizer's calls for MODEL's gradients
                      (tests/gpu/model_grads.py): an allreduce_async_ of each
                      gradient in backward order, paced like a backward pass,
                      then a synchronize of each in that order; NCCL calls and
                      exactness per step
  lone                after steps of a small model: lone allreduce_async_ +
                      synchronize calls (of each planned name in turn, whose
                      bucket-mates never come; of one name again and again;
                      of new names; of a name right after a step): per
                      phase, what the engine held, its idle releases, the
                      NCCL calls, the times (benchmarks/buckets.py reports
                      them); a step missing one name, waited on; a step
                      missing one name, only polled
  kill                the last rank dies after submitting half of a bucket:
                      the others' held half fails with the peer's failure
  traffic             after steps of a small model, half of its bucket
                      submitted and only polled while another thread runs
                      CPU allreduces (async, polled) for at least 2 s: does
                      the held half complete while that traffic still flows?
  driver_leaves       trials: half of a bucket submitted, then another call
                      synchronized at once (its driver leaves right after
                      the round that held the half): does the half, only
                      polled, complete?
  unnamed             200 unnamed allreduce_async calls on CUDA tensors, each
                      synchronized before the next (the second hundred
                      polled until done first): each call's wait, and how
                      many requests the engine held for a bucket
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

import model_grads  # noqa: E402

import cring  # noqa: E402
from cring import _gpu  # noqa: E402

from fake_cuda import FakeCudaTensor as F  # noqa: E402

# A backward pass's pace: a gradient of b bytes is ready b / (bytes of all
# gradients) * BACKWARD_S after the one before. On a GPU a backward pass is
# tens of ms and an NCCL launch microseconds; here the test doubles' calls on
# 100 MB take tens to hundreds of ms, so the pass is stretched to keep many
# negotiation rounds (and so many launches, without buckets) inside it.
BACKWARD_S = 1.0


def nccl_calls() -> int:
    return int(_gpu.stats()["nccl_calls"])


def held_for_buckets() -> int:
    """Requests this rank's engine has held for their gradient bucket since init."""
    return int(cring.engine_stats()["bucket_held"])


def idle_releases() -> int:
    """Releases of everything held by the idle rule on this rank since init."""
    return int(cring.engine_stats()["bucket_idle_releases"])


def template(k: int, n: int) -> np.ndarray:
    """Gradient k's values before the rank's offset: exact sums in float32."""
    return (np.arange(n, dtype=np.int64) % 251 + k % 13).astype(np.float32)


def backward(grads: list, names: list, skip: int = -1, pace_s: float = 0.0) -> list:
    """Submit every gradient (but `skip`) as backward produces them, over pace_s."""
    handles = []
    t_next = time.perf_counter()
    rate = sum(x.array.nbytes for x in grads) / pace_s if pace_s else float("inf")
    for k, (x, name) in enumerate(zip(grads, names)):
        t_next += x.array.nbytes / rate
        wait = t_next - time.perf_counter()
        if wait > 5e-4:
            time.sleep(wait)
        if k == skip:
            continue
        handles.append((k, cring.allreduce_async_(x, op=cring.Sum, name=name)))
    return handles


def replay(r: int, p: int, out: dict, model: str, steps: int) -> None:
    shapes = model_grads.MODELS[model]()
    names = [f"grad.{name}" for name, _ in shapes]
    templates = [template(k, int(np.prod(s))).reshape(s) for k, (_, s) in enumerate(shapes)]
    grads = [F(np.empty_like(t)) for t in templates]
    out["tensors"] = len(grads)
    out["bytes"] = sum(t.nbytes for t in templates)
    out["calls"], out["exact"] = [], True
    cring.barrier()
    for s in range(steps):
        for x, t in zip(grads, templates):
            np.add(t, np.float32(r + s), out=x.array)
        before = nccl_calls()
        handles = backward(grads, names, pace_s=BACKWARD_S)
        for k, h in handles:  # DistributedOptimizer.synchronize: in submission order
            assert cring.synchronize(h) is grads[k]
        out["calls"].append(nccl_calls() - before)
        offset = np.float32(p * s + p * (p - 1) // 2)
        for x, t in zip(grads, templates):
            want = t * np.float32(p) + offset
            if not np.array_equal(x.array, want):
                out["exact"] = False
        cring.barrier()


def lone(r: int, p: int, out: dict) -> None:
    """A small model of 24 gradients (one bucket: 24 names, 100 KB); then
    calls that must not wait for the rest of their bucket."""
    n, size = 24, 1000
    names = [f"small{k}" for k in range(n)]
    templates = [template(k, size) for k in range(n)]
    grads = [F(np.empty_like(t)) for t in templates]
    exact = True

    def step(s: int, skip: int = -1, poll: bool = False) -> float:
        nonlocal exact
        for x, t in zip(grads, templates):
            np.add(t, np.float32(r + s), out=x.array)
        t0 = time.perf_counter()
        handles = backward(grads, names, skip)
        if poll:  # nobody waits: the held bucket must still go, by itself
            deadline = time.perf_counter() + 20.0
            while not all(cring.poll(h) for _, h in handles) and time.perf_counter() < deadline:
                time.sleep(0.001)
        for _, h in handles:
            cring.synchronize(h)
        dt = time.perf_counter() - t0
        for k, _ in handles:
            want = templates[k] * np.float32(p) + np.float32(p * s + p * (p - 1) // 2)
            exact &= bool(np.array_equal(grads[k].array, want))
        return dt

    def single(name: str, value: float) -> float:
        nonlocal exact
        x = F(np.full(16, value + r, np.float32))
        t0 = time.perf_counter()
        cring.synchronize(cring.allreduce_async_(x, op=cring.Sum, name=name))
        dt = time.perf_counter() - t0
        exact &= bool(np.array_equal(x.array, np.full(16, p * value + p * (p - 1) / 2)))
        return dt

    cring.barrier()
    for s in range(3):  # the plan: one bucket of all 24 names
        step(s)

    def phase(label: str, calls: list) -> None:
        """Time each lone call; count what the engine held for a bucket,
        its idle releases, and the NCCL calls made."""
        held, idle, launched = held_for_buckets(), idle_releases(), nccl_calls()
        times = [single(name, value) for name, value in calls]
        out[f"{label}_held"] = held_for_buckets() - held
        out[f"{label}_idle_releases"] = idle_releases() - idle
        out[f"{label}_calls"] = nccl_calls() - launched
        out[f"{label}_median_s"] = statistics.median(times)
        out[f"{label}_max_s"] = max(times)

    cring.barrier()
    # each name of the bucket alone, one after another: 23 names missing each time
    phase("planned", [(name, float(i)) for i, name in enumerate(names)])
    cring.barrier()
    phase("again", [("lone", float(i)) for i in range(60)])
    cring.barrier()
    phase("fresh", [(f"fresh{i}", float(i)) for i in range(60)])
    for s in range(3):
        step(20 + s)
    after = {"held": 0, "idle_releases": 0, "calls": 0, "times": []}
    for i in range(12):  # a step, then one of its names alone
        step(30 + i)
        phase("one", [(names[i], float(i))])
        for k in ("held", "idle_releases", "calls"):
            after[k] += out.pop(f"one_{k}")
        after["times"].append(out.pop("one_median_s"))
        out.pop("one_max_s")
    for k in ("held", "idle_releases", "calls"):
        out[f"after_step_{k}"] = after[k]
    out["after_step_median_s"] = statistics.median(after["times"])
    out["after_step_max_s"] = max(after["times"])
    for s in range(3):
        step(50 + s)
    cring.barrier()
    out["skip_waited_s"] = step(60, skip=n - 1)  # the bucket's last name never comes
    for s in range(3):
        step(70 + s)
    cring.barrier()
    idle = idle_releases()
    out["skip_polled_s"] = step(80, skip=n // 2, poll=True)
    out["skip_polled_idle_releases"] = idle_releases() - idle
    out["exact"] = exact


def kill(r: int, p: int, out: dict) -> None:
    """After a plan of one bucket of 24 names, the last rank submits half of a
    step and dies (SIGKILL): the others' held half must fail, not hang."""
    n = 24
    names = [f"small{k}" for k in range(n)]
    grads = [F(np.ones(1000, np.float32)) for _ in range(n)]
    cring.barrier()
    for _ in range(3):
        for h in [cring.allreduce_async_(x, op=cring.Sum, name=m) for x, m in zip(grads, names)]:
            cring.synchronize(h)
    cring.barrier()
    if r == p - 1:
        for x, m in zip(grads[: n // 2], names[: n // 2]):
            cring.allreduce_async_(x, op=cring.Sum, name=m)
        time.sleep(0.1)  # the others hold that half by now (the idle release: 0.2 s)
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.perf_counter()
    handles = [cring.allreduce_async_(x, op=cring.Sum, name=m) for x, m in zip(grads, names)]
    try:
        for h in handles:
            cring.synchronize(h)
        out["raised"] = None
    except cring.CRingError as e:
        out["raised"] = type(e).__name__
        out["message"] = str(e)[:300]
    out["after_s"] = time.perf_counter() - t0


def learn_small_model(r: int, n: int = 24, prefix: str = "small") -> tuple[list, list]:
    """Three steps of a small model (24 gradients of 4 KB: one bucket), each
    waited on, so the next step has a plan; returns (names, gradients)."""
    names = [f"{prefix}{k}" for k in range(n)]
    grads = [F(np.full(1000, float(k + r), np.float32)) for k in range(n)]
    cring.barrier()
    for _ in range(3):
        handles = [cring.allreduce_async_(x, op=cring.Sum, name=m) for x, m in zip(grads, names)]
        for h in handles:
            cring.synchronize(h)
    cring.barrier()
    return names, grads


def traffic(r: int, p: int, out: dict) -> None:
    """Half of a planned bucket is submitted and only polled while another
    thread keeps CPU allreduces flowing (each polled until done, no thread
    waiting on a handle). The held half must complete while that traffic
    flows: the hold depends on the step's gradients, not on other work. The
    traffic stops, on every rank at the same call, once every rank's half
    completed (and at least 2 s passed), or after TRAFFIC_LIMIT_S."""
    TRAFFIC_MIN_S, TRAFFIC_LIMIT_S = 2.0, 30.0
    n = 24
    names, grads = learn_small_model(r, n)
    held_before = held_for_buckets()
    state = {"held_done": False, "calls": 0, "calls_while_held": 0}
    started = threading.Event()

    def cpu_traffic() -> None:
        t0 = time.perf_counter()
        while True:
            elapsed = time.perf_counter() - t0
            done_here = state["held_done"]
            flags = np.array(
                [done_here, elapsed >= TRAFFIC_MIN_S, elapsed >= TRAFFIC_LIMIT_S], np.float64
            )
            h = cring.allreduce_async(flags, op=cring.Sum, name="cpu.traffic")
            while not cring.poll(h):
                time.sleep(0.0005)
            total = cring.synchronize(h)
            state["calls"] += 1
            state["calls_while_held"] += not done_here
            started.set()
            if (total[0] == p and total[1] > 0) or total[2] > 0:
                return

    worker = threading.Thread(target=cpu_traffic)
    worker.start()
    started.wait(60.0)  # the traffic flows before the half is submitted
    half = range(n // 2)
    for k in half:
        grads[k].array[:] = k + r
    handles = [cring.allreduce_async_(grads[k], op=cring.Sum, name=names[k]) for k in half]
    t0 = time.perf_counter()
    while not all(cring.poll(h) for h in handles) and worker.is_alive():
        time.sleep(0.001)
    state["held_done"] = all(cring.poll(h) for h in handles)
    out["held_s"] = time.perf_counter() - t0
    out["completed_during_traffic"] = state["held_done"]
    worker.join(120.0)
    out["traffic_stopped"] = not worker.is_alive()
    for h in handles:  # after the traffic, whatever happened before; the
        cring.synchronize(h, block_host=True)  # host reads the result next
    out["exact"] = all(
        np.array_equal(grads[k].array, np.full(1000, p * k + p * (p - 1) / 2, np.float32))
        for k in half
    )
    out["held"] = held_for_buckets() - held_before
    out["cpu_calls"] = state["calls"]
    out["cpu_calls_while_held"] = state["calls_while_held"]


def driver_leaves(r: int, p: int, out: dict) -> None:
    """Trials, each with a model of its own: half of its bucket submitted
    asynchronously, then another call (on the CPU) synchronized at once, so
    this thread drives the round in which the half is held and then leaves.
    The half, only polled, must still go: something must run the rounds
    that release it."""
    TRIALS, POLL_LIMIT_S = 10, 10.0
    held_before = held_for_buckets()
    completed, exact = [], True
    for trial in range(TRIALS):
        names, grads = learn_small_model(r, prefix=f"t{trial}.g")
        half = range(len(names) // 2)
        for k in half:
            grads[k].array[:] = k + r
        handles = [cring.allreduce_async_(grads[k], op=cring.Sum, name=names[k]) for k in half]
        x = np.ones(4, np.float32)
        cring.synchronize(cring.allreduce_async(x, op=cring.Sum, name=f"cpu.{trial}"))
        t0 = time.perf_counter()
        while not all(cring.poll(h) for h in handles) and time.perf_counter() - t0 < POLL_LIMIT_S:
            time.sleep(0.001)
        completed.append(all(cring.poll(h) for h in handles))
        for h in handles:  # whatever happened: a waiter releases it (and the
            cring.synchronize(h, block_host=True)  # host reads the result next)
        for k in half:
            exact &= bool(np.array_equal(grads[k].array, np.full(1000, p * k + p * (p - 1) / 2)))
    out["completed"] = completed
    out["held"] = held_for_buckets() - held_before
    out["exact"] = exact


def unnamed(r: int, p: int, out: dict) -> None:
    """200 unnamed allreduce_async calls on CUDA tensors, each synchronized
    before the next (the second hundred polled until done first): their
    generated names come round again every few dozen calls, and must never
    make them wait for company like gradients. Then the same calls with new
    names each (never in a plan), for benchmarks/buckets.py's baseline."""

    def calls(names: list) -> list:
        nonlocal exact
        waits = []
        for i, name in enumerate(names):
            x = F(np.full(16, float(i + r), np.float32))
            t0 = time.perf_counter()
            h = cring.allreduce_async(x, op=cring.Sum, name=name)
            if i >= len(names) // 2:  # polled until done: nobody waits, so a
                while not cring.poll(h):  # held one would stay for the idle release
                    time.sleep(0.0002)
            y = cring.synchronize(h)
            waits.append(time.perf_counter() - t0)
            cring.synchronize(h, block_host=True)  # the device is done: the host reads it
            want = np.full(16, p * i + p * (p - 1) / 2, np.float32)
            exact &= bool(np.array_equal(y.array, want))
        return waits

    exact = True
    held_before = held_for_buckets()
    cring.barrier()
    waits = calls([None] * 200)
    out["held"] = held_for_buckets() - held_before
    out["max_wait_s"] = max(waits)
    out["median_wait_s"] = statistics.median(waits)
    out["slowest_call"] = waits.index(max(waits))
    named = calls([f"once{i}" for i in range(200)])
    out["named_median_wait_s"] = statistics.median(named)
    out["named_max_wait_s"] = max(named)
    out["exact"] = exact


def main() -> None:
    mode = sys.argv[1]
    cring.init()
    r, p = cring.rank(), cring.size()
    out: dict = {"rank": r, "size": p, "pid": os.getpid(), "mode": mode}
    if mode == "replay":
        replay(r, p, out, sys.argv[2], int(sys.argv[3]))
    elif mode == "kill":
        kill(r, p, out)
    elif mode == "traffic":
        traffic(r, p, out)
    elif mode == "unnamed":
        unnamed(r, p, out)
    elif mode == "driver_leaves":
        driver_leaves(r, p, out)
    else:
        lone(r, p, out)
    cring.shutdown()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()

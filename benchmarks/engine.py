"""Engine benchmark: what negotiation and tensor fusion buy.

Two ranks, in one run:
  * 500 tensors of 4 KiB submitted with allreduce_async_ and then
    synchronized (the engine fuses what is ready together),
  * the same 500 tensors as 500 synchronous cring.allreduce_ calls,
  * the same 500 tensors out of place (issue 29): submitted with
    allreduce_async (a new tensor each) and synchronized, against 500
    synchronous cring.allreduce calls,
  * the same 500 tensors as 500 torch.distributed gloo all_reduce calls,
  * a lone synchronous 8-byte allreduce: through the engine (submit + wait),
    as the direct C call (cring_allreduce: agreement + algorithm) and as the
    bare algorithm, each timed in a C loop by benchmarks/engine_bench.c (built
    here against build/libcring.a; run `make` first), plus the Python-level
    call. The shipped module has no benchmark hooks, so the old "direct call
    from Python" row is gone: compare the Python call with the C engine row.

Prints a table, writes benchmarks/results/engine.csv. Run it as
    python benchmarks/engine.py          (it starts its two ranks itself)
    CRING_TRANSPORT=tcp python benchmarks/engine.py     (the same over TCP)
Issue 20's targets: the fused batch >= 1.5x faster than the synchronous loop
over shared memory and >= 20x over TCP; submission well under 2 us a tensor.
Issue 29's: out of place, the fused batch >= 1.3x faster than the synchronous
loop over shared memory and >= 10x over TCP.
"""

from __future__ import annotations

import argparse
import csv
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


ROOT = Path(__file__).resolve().parent.parent
C_BENCH = ROOT / "build" / "bench" / "engine_bench"


def c_lone(iters: int = 20000) -> dict:
    """Build and run benchmarks/engine_bench.c: {"raw fresh": s, ...}; {} when
    build/libcring.a is missing (run `make`)."""
    lib = ROOT / "build" / "libcring.a"
    if not lib.exists():
        print("benchmarks/engine.py: no build/libcring.a (run make): C rows skipped")
        return {}
    C_BENCH.parent.mkdir(parents=True, exist_ok=True)
    subprocess.check_call(
        [
            "cc",
            "-O2",
            "-std=c11",
            "-D_GNU_SOURCE",
            "-I",
            str(ROOT / "csrc/include"),
            "-I",
            str(ROOT / "csrc"),
            str(ROOT / "benchmarks/engine_bench.c"),
            str(lib),
            "-o",
            str(C_BENCH),
            "-pthread",
            "-lrt",
            "-lm",
            "-ldl",
        ]
    )
    out = subprocess.run(
        [str(C_BENCH), str(iters)], check=True, capture_output=True, text=True, timeout=600
    ).stdout
    result = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[0] == "lone":
            result[f"{parts[1]} {parts[2]}"] = float(parts[3])
    return result


def launch(args: argparse.Namespace) -> int:
    cmd = [
        sys.executable,
        "-m",
        "cring.run",
        "-np",
        "2",
        sys.executable,
        __file__,
        "--worker",
        "--tensors",
        str(args.tensors),
        "--bytes",
        str(args.bytes),
        "--repeats",
        str(args.repeats),
        "--c-lone",
        json.dumps(c_lone()),
    ]
    return subprocess.call(cmd, timeout=900)


def timed(fn, repeats: int, barrier) -> float:
    """Median wall time of fn over `repeats` runs after two warm-ups."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_lone(cring, np) -> dict:
    """A lone synchronous 8-byte float32 sum allreduce from Python, through
    the engine (the C rows come from engine_bench.c)."""
    x8 = np.zeros(2, np.float32)

    def python_engine() -> None:
        for _ in range(2000):
            cring.allreduce_(x8, op=cring.Sum, name="lone")

    return {"python": timed(python_engine, 5, cring.barrier) / 2000}


def worker(args: argparse.Namespace) -> None:
    import numpy as np

    import cring

    cring.init()
    rank, size = cring.rank(), cring.size()
    n, elems = args.tensors, args.bytes // 4
    bufs = [np.full(elems, rank, np.float32) for _ in range(n)]

    submit_times: list[float] = []

    def fused() -> None:
        t0 = time.perf_counter()
        handles = [
            cring.allreduce_async_(b, op=cring.Average, name=f"grad.{i}")
            for i, b in enumerate(bufs)
        ]
        submit_times.append(time.perf_counter() - t0)
        for h in handles:
            cring.synchronize(h)

    def sync_loop() -> None:
        for i, b in enumerate(bufs):
            cring.allreduce_(b, op=cring.Average, name=f"grad.{i}")

    outs: list = []
    submit_out_times: list[float] = []

    def fused_out() -> None:
        t0 = time.perf_counter()
        handles = [
            cring.allreduce_async(b, op=cring.Average, name=f"grad.{i}") for i, b in enumerate(bufs)
        ]
        submit_out_times.append(time.perf_counter() - t0)
        outs[:] = [cring.synchronize(h) for h in handles]

    def sync_loop_out() -> None:
        outs[:] = [
            cring.allreduce(b, op=cring.Average, name=f"grad.{i}") for i, b in enumerate(bufs)
        ]

    # first, as a user with nothing else going on would see it
    lone_cold = measure_lone(cring, np)

    rows = []
    before = cring.engine_stats()
    t_fused = timed(fused, args.repeats, cring.barrier)
    after = cring.engine_stats()
    runs = args.repeats + 2
    collectives_per_run = (after["collectives"] - before["collectives"] - runs) / runs
    expected = (size - 1) / 2
    assert all(np.allclose(b, expected) for b in bufs), "wrong fused results"
    t_submit = statistics.median(submit_times)
    t_sync = timed(sync_loop, args.repeats, cring.barrier)
    before = cring.engine_stats()
    t_fused_out = timed(fused_out, args.repeats, cring.barrier)
    after = cring.engine_stats()
    collectives_out = (after["collectives"] - before["collectives"] - runs) / runs
    assert all(np.allclose(o, expected) for o in outs), "wrong out-of-place fused results"
    t_sync_out = timed(sync_loop_out, args.repeats, cring.barrier)
    assert all(np.allclose(o, expected) for o in outs), "wrong out-of-place sync results"

    # again, with the 500 names above in the response cache (before gloo:
    # torch's threads can linger afterwards)
    lone_warm = measure_lone(cring, np)

    # gloo in the same processes; rank 0 picks the port and tells the others
    import torch
    import torch.distributed as dist

    port = np.zeros(1, np.int64)
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port[0] = s.getsockname()[1]
    cring.broadcast_(port, 0)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{int(port[0])}", rank=rank, world_size=size
    )
    tbufs = [torch.full((elems,), float(rank)) for _ in range(n)]

    def gloo_loop() -> None:
        for t in tbufs:
            dist.all_reduce(t)

    t_gloo = timed(gloo_loop, args.repeats, dist.barrier)
    dist.destroy_process_group()

    rows.append(("fused async, %d x %d B" % (n, args.bytes), t_fused, collectives_per_run))
    rows.append(("sync loop, %d x %d B" % (n, args.bytes), t_sync, None))
    rows.append(("out: fused async, %d x %d B" % (n, args.bytes), t_fused_out, collectives_out))
    rows.append(("out: sync loop, %d x %d B" % (n, args.bytes), t_sync_out, None))
    rows.append(("gloo loop, %d x %d B" % (n, args.bytes), t_gloo, None))

    if rank == 0:
        print(
            f"\ncring engine benchmark: {size} ranks over {cring.transport()}, "
            f"median of {args.repeats} runs\n"
        )
        print(f"{'case':32s} {'time':>12s} {'vs gloo':>9s} {'collectives':>12s}")
        for name, t, colls in rows:
            c = f"{colls:.1f}" if colls is not None else ""
            print(f"{name:32s} {t * 1e3:9.3f} ms {t_gloo / t:8.1f}x {c:>12s}")
        print(f"\nfused vs gloo loop: {t_gloo / t_fused:.1f}x faster (target >= 10x)")
        target = 20.0 if cring.transport() == "tcp" else 1.5
        print(
            f"fused vs sync loop: {t_sync / t_fused:.2f}x faster (issue 20: >= {target:g}x "
            f"over {cring.transport()}); submission {t_submit / n * 1e6:.2f} us a tensor\n"
        )
        target = 10.0 if cring.transport() == "tcp" else 1.3
        print(
            f"out of place, fused vs sync loop: {t_sync_out / t_fused_out:.2f}x faster "
            f"(issue 29: >= {target:g}x over {cring.transport()}); submission "
            f"{statistics.median(submit_out_times) / n * 1e6:.2f} us a tensor\n"
        )
        c = json.loads(args.c_lone)
        for tag, lone in (("fresh", lone_cold), ("warm", lone_warm)):
            for mode in ("raw", "direct", "engine"):
                if f"{mode} {tag}" in c:
                    lone[mode] = c[f"{mode} {tag}"]
        print(f"{'lone 8-byte allreduce':32s} {'fresh':>10s} {'500 cached':>12s}")
        for mode, label in (
            ("raw", "algorithm alone (C)"),
            ("direct", "cring_allreduce (C, agreement)"),
            ("engine", "engine submit+wait (C)"),
            ("python", "cring.allreduce_ (Python)"),
        ):
            if mode in lone_cold and mode in lone_warm:
                print(
                    f"{label:32s} {lone_cold[mode] * 1e6:7.2f} us {lone_warm[mode] * 1e6:9.2f} us"
                )
        for tag, lone in (("fresh", lone_cold), ("500 names cached", lone_warm)):
            if "engine" in lone:
                print(
                    f"{tag}: engine / direct call in C {lone['engine'] / lone['direct']:.2f}x "
                    f"(target <= 2x); Python call / C engine "
                    f"{lone['python'] / lone['engine']:.2f}x"
                )
        RESULTS.mkdir(exist_ok=True)
        with open(RESULTS / "engine.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["case", "seconds"])
            for name, t, _ in rows:
                w.writerow([name, f"{t:.6g}"])
            for tag, lone in (("fresh", lone_cold), ("warm", lone_warm)):
                for mode, t in lone.items():
                    w.writerow([f"lone 8 B allreduce ({tag}): {mode}", f"{t:.6g}"])
    cring.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tensors", type=int, default=500)
    parser.add_argument("--bytes", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--c-lone", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())

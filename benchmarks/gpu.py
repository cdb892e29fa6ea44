"""GPU benchmark: cring on CUDA tensors against torch.distributed, on one
machine with one or more NVIDIA GPUs (needs a CUDA build of torch).

Cases, each timed as the median over repeats of a loop of calls followed by
torch.cuda.synchronize():
  * nccl, world size 1 (this process): cring.allreduce_ through NCCL vs
    torch.distributed's NCCL backend, message sizes 4 KiB .. 256 MiB, plus a
    loop of 500 allreduces of 4 KiB (per-call overhead);
  * host, world size 2 on one GPU (CRING_GPU_OPERATIONS=host): cring staged
    through pinned memory and shared memory vs torch.distributed gloo on the
    same CUDA tensors (gloo stages through the host too);
  * nccl, world size 2, one GPU each (only with 2+ GPUs): cring vs
    torch.distributed NCCL; cring's per-call argument agreement shows in the
    4 KiB loop.
Bandwidth is algorithm bandwidth (bytes per rank / time). Prints tables and
writes benchmarks/results/gpu.csv. Run it as
    python benchmarks/gpu.py               (it starts its ranks itself)
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20]
HOST_SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed(torch, fn, repeats: int, barrier) -> float:
    """Median seconds of fn() + device synchronisation, after two warm-ups."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def iterations(nbytes: int) -> int:
    return max(3, min(200, (256 << 20) // max(nbytes, 1) // 4))


def measure(mode: str, repeats: int, sizes: list) -> list:
    """Run in every rank: cring, then torch.distributed on the same tensors."""
    import numpy as np
    import torch
    import torch.distributed as dist

    import cring

    cring.init()
    rank, size = cring.rank(), cring.size()
    dev = torch.device("cuda", 0 if mode == "host" else cring.local_rank())
    torch.cuda.set_device(dev)
    rows = []
    bufs = {n: torch.ones(n // 4, device=dev) for n in sizes}
    small = [torch.ones(1024, device=dev) for _ in range(500)]

    def cring_loop(n: int):
        def run() -> None:
            for _ in range(iterations(n)):
                cring.allreduce_(bufs[n], op=cring.Sum, name=f"bench.{n}")

        return run

    def cring_small() -> None:
        for i, t in enumerate(small):
            cring.allreduce_(t, op=cring.Sum, name=f"small.{i}")

    for n in sizes:
        rows.append(
            [
                "cring",
                mode,
                size,
                n,
                timed(torch, cring_loop(n), repeats, cring.barrier) / iterations(n),
            ]
        )
    rows.append(
        ["cring", mode, size, "500 x 4 KiB", timed(torch, cring_small, repeats, cring.barrier)]
    )

    port = np.zeros(1, np.int64)
    if rank == 0:
        port[0] = free_port()
    cring.broadcast_(port, 0, name="bench.port")
    backend = "gloo" if mode == "host" else "nccl"
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{int(port[0])}",
        rank=rank,
        world_size=size,
        device_id=None if mode == "host" else dev,
    )

    def torch_loop(n: int):
        def run() -> None:
            for _ in range(iterations(n)):
                dist.all_reduce(bufs[n])

        return run

    def torch_small() -> None:
        for t in small:
            dist.all_reduce(t)

    for n in sizes:
        rows.append(
            [
                f"torch.distributed {backend}",
                mode,
                size,
                n,
                timed(torch, torch_loop(n), repeats, dist.barrier) / iterations(n),
            ]
        )
    rows.append(
        [
            f"torch.distributed {backend}",
            mode,
            size,
            "500 x 4 KiB",
            timed(torch, torch_small, repeats, dist.barrier),
        ]
    )
    dist.destroy_process_group()
    cring.shutdown()
    return rows if rank == 0 else []


def launch(mode: str, np_: int, repeats: int, out: Path) -> list:
    env = dict(os.environ)
    if mode == "host":
        env["CRING_GPU_OPERATIONS"] = "host"
    else:
        env.pop("CRING_GPU_OPERATIONS", None)
    cmd = [
        sys.executable,
        "-m",
        "cring.run",
        "-np",
        str(np_),
        sys.executable,
        __file__,
        "--worker",
        mode,
        "--repeats",
        str(repeats),
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, env=env, timeout=1800)
    if proc.returncode != 0 or not out.exists():
        print(f"{mode} on {np_} ranks failed (exit {proc.returncode})")
        return []
    return json.loads(out.read_text())


def report(rows: list) -> None:
    print(
        f"\n{'who':28s} {'path':6s} {'ranks':>5s} {'message':>12s} {'time':>12s} "
        f"{'algbw':>11s} {'cring vs torch':>15s}"
    )
    by_key = {(r[1], r[2], r[3], r[0].startswith("cring")): r[4] for r in rows}
    for who, mode, ranks, n, t in rows:
        label = (
            n if isinstance(n, str) else (f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB")
        )
        bw = "" if isinstance(n, str) else f"{n / t / 1e9:8.2f} GB/s"
        ratio = ""
        if who.startswith("cring"):
            other = by_key.get((mode, ranks, n, False))
            if other:
                ratio = f"{other / t:.2f}x"
        shown = f"{t * 1e3:9.3f} ms" if t >= 1e-3 else f"{t * 1e6:9.1f} us"
        print(f"{who:28s} {mode:6s} {ranks:5d} {label:>12s} {shown:>12s} {bw:>11s} {ratio:>15s}")
    print("(cring vs torch > 1 means cring is faster)")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worker", choices=("nccl", "host"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    if args.worker:
        rows = measure(args.worker, args.repeats, HOST_SIZES if args.worker == "host" else SIZES)
        if rows:
            Path(args.out).write_text(json.dumps(rows))
        return 0
    import torch

    if not torch.cuda.is_available():
        print("torch sees no CUDA device: this benchmark needs a GPU")
        return 2
    RESULTS.mkdir(exist_ok=True)
    tmp = RESULTS / "gpu_tmp"
    tmp.mkdir(exist_ok=True)
    print(
        f"{torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}, torch "
        f"{torch.__version__} (CUDA {torch.version.cuda})"
    )
    rows = launch("nccl", 1, args.repeats, tmp / "nccl1.json")
    rows += launch("host", 2, args.repeats, tmp / "host2.json")
    if torch.cuda.device_count() >= 2:
        rows += launch("nccl", 2, args.repeats, tmp / "nccl2.json")
    report(rows)
    with open(RESULTS / "gpu.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["who", "path", "ranks", "bytes", "seconds"])
        w.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

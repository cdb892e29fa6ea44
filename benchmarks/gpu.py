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
    torch.distributed NCCL;
  * per call (issue 16), world size 1, 4 KiB, a loop of 2,000 calls:
    cring.allreduce_, cring.torch.allreduce_ and cring.allreduce_async_ +
    synchronize against torch.distributed.all_reduce (NCCL); the goal is
    <= 1.0x torch's time (stretch 0.5x);
  * allgather per call (issue 26), world size 1, 4 KiB .. 64 MiB: a loop of
    cring.allgather of a torch CUDA tensor (its result from torch's caching
    allocator, lent to the engine) against torch.distributed's
    all_gather_into_tensor into a torch.empty made each call (the same work:
    a new result per call); the goal is <= 1.0x torch's time;
  * training steps (issue 16), world size 1, bf16 autocast, batch 64:
    ResNet-50 and ViT-B/16 (torchvision's, or comparable models written
    here when torchvision is missing) with no communication, DDP (NCCL),
    cring.torch.DistributedOptimizer (which at world size 1 does not
    communicate) and "hooks" (DistributedOptimizer's calls made anyway, so
    the fused NCCL path runs in the step); the step time of each and the NCCL
    collectives cring launched per step (from cring's GPU counters; the goal
    is <= ceil(gradient bytes / fusion threshold) + 2).
Bandwidth is algorithm bandwidth (bytes per rank / time). Prints tables and
writes benchmarks/results/gpu.csv (and gpu_steps.csv). Run it as
    python benchmarks/gpu.py               (it starts its ranks itself)
    python benchmarks/gpu.py --only steps  (just the per-call and step parts)
    python benchmarks/gpu.py --only allgather  (just the allgather per-call table)
"""

from __future__ import annotations

import argparse
import csv
import functools
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
ALLGATHER_SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]


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


# ---- per-call cost and training steps, world size 1 (issue 16) ---------------------------------


def per_call(torch, calls: int = 2000) -> list:
    """Seconds per call of a 4 KiB in-place allreduce, loop + one device sync."""
    import torch.distributed as dist

    import cring
    import cring.torch as hvd

    x = torch.ones(1024, device="cuda")

    def loop(fn) -> float:
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            best = min(best, (time.perf_counter() - t0) / calls)
        return best

    rows = [
        ["cring.allreduce_", loop(lambda: cring.allreduce_(x, op=cring.Sum, name="percall"))],
        ["cring.torch.allreduce_", loop(lambda: hvd.allreduce_(x, op=hvd.Sum, name="percall"))],
        [
            "cring.allreduce_async_+synchronize",
            loop(
                lambda: cring.synchronize(cring.allreduce_async_(x, op=cring.Sum, name="percall"))
            ),
        ],
        ["torch.distributed.all_reduce", loop(lambda: dist.all_reduce(x))],
    ]
    return rows


def allgather_calls(nbytes: int) -> int:
    """Calls per timed loop: many for small messages, a few for 64 MiB."""
    return max(20, min(2000, (256 << 20) // max(nbytes, 1)))


def allgather_per_call(torch, sizes: list = ALLGATHER_SIZES) -> list:
    """Rows (who, bytes, seconds per call) of an allgather at world size 1:
    cring.allgather against all_gather_into_tensor into a new torch.empty,
    each a loop + one device sync, best of 5."""
    import torch.distributed as dist

    import cring

    def loop(fn, calls: int) -> float:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            best = min(best, (time.perf_counter() - t0) / calls)
        return best

    def cring_call(x) -> None:
        cring.allgather(x, name="ag")

    def torch_call(x) -> None:
        out = torch.empty(dist.get_world_size() * x.numel(), device="cuda")
        dist.all_gather_into_tensor(out, x)

    rows = []
    for nbytes in sizes:
        x = torch.ones(nbytes // 4, device="cuda")
        calls = allgather_calls(nbytes)
        rows.append(["cring.allgather", nbytes, loop(functools.partial(cring_call, x), calls)])
        rows.append(
            [
                "torch.distributed.all_gather_into_tensor",
                nbytes,
                loop(functools.partial(torch_call, x), calls),
            ]
        )
    return rows


def allgather_report(rows: list) -> list:
    """Print the allgather table; returns (bytes, cring s, torch s, ratio)."""
    by = {(who.startswith("cring"), n): t for who, n, t in rows}
    table = []
    print(f"\n{'allgather per call, world size 1':34s} {'cring':>11s} {'torch':>11s} {'ratio':>7s}")
    for n in sorted({n for _, n, _ in rows}):
        mine, theirs = by.get((True, n)), by.get((False, n))
        if mine is None or theirs is None:
            continue
        label = f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"
        table.append((n, mine, theirs, mine / theirs))
        print(f"{label:34s} {mine * 1e6:8.1f} us {theirs * 1e6:8.1f} us {mine / theirs:6.2f}x")
    print("(ratio = cring / torch; goal <= 1.0x)")
    return table


def models(torch):
    """(name, constructor) of ResNet-50 and ViT-B/16: torchvision's when it
    imports, else models of the same shape of work written here."""
    try:
        import torchvision

        return [
            ("resnet50", lambda: torchvision.models.resnet50()),
            ("vit_b_16", lambda: torchvision.models.vit_b_16()),
        ]
    except ImportError:
        pass
    nn = torch.nn

    class Bottleneck(nn.Module):
        def __init__(self, cin, mid, stride):
            super().__init__()
            cout = mid * 4
            self.body = nn.Sequential(
                nn.Conv2d(cin, mid, 1, bias=False),
                nn.BatchNorm2d(mid),
                nn.ReLU(inplace=True),
                nn.Conv2d(mid, mid, 3, stride, 1, bias=False),
                nn.BatchNorm2d(mid),
                nn.ReLU(inplace=True),
                nn.Conv2d(mid, cout, 1, bias=False),
                nn.BatchNorm2d(cout),
            )
            self.skip = (
                nn.Identity()
                if stride == 1 and cin == cout
                else nn.Sequential(
                    nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
                )
            )

        def forward(self, x):
            return torch.relu(self.body(x) + self.skip(x))

    def resnet50():
        layers = [
            nn.Conv2d(3, 64, 7, 2, 3, bias=False),
            nn.BatchNorm2d(64),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, 2, 1),
        ]
        cin = 64
        for mid, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            for b in range(blocks):
                layers.append(Bottleneck(cin, mid, stride if b == 0 else 1))
                cin = mid * 4
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2048, 1000)]
        return nn.Sequential(*layers)

    class ViT(nn.Module):
        def __init__(self):
            super().__init__()
            self.patch = nn.Conv2d(3, 768, 16, 16)
            self.cls = nn.Parameter(torch.zeros(1, 1, 768))
            self.pos = nn.Parameter(torch.zeros(1, 197, 768))
            layer = nn.TransformerEncoderLayer(
                768, 12, 3072, activation="gelu", batch_first=True, norm_first=True
            )
            self.encoder = nn.TransformerEncoder(layer, 12)
            self.head = nn.Linear(768, 1000)

        def forward(self, x):
            x = self.patch(x).flatten(2).transpose(1, 2)
            x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos
            return self.head(self.encoder(x)[:, 0])

    return [("resnet50 (inline)", resnet50), ("vit_b_16 (inline)", ViT)]


def train_step(torch, model, opt, x, y) -> None:
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()


class HookReducer:
    """What DistributedOptimizer does (an allreduce_async_ of each gradient
    from its post-accumulate hook, all synchronized before the step), but
    engaged at world size 1 too, where DistributedOptimizer rightly skips
    communication: so one GPU still measures the fused NCCL path's cost in a
    step (events, fusion buffer, cring's stream) and its launches."""

    def __init__(self, model, opt) -> None:
        import cring.torch as hvd

        self.hvd, self.opt, self.handles = hvd, opt, []
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(
                    lambda q, name=name: self.handles.append(
                        hvd.allreduce_async_(q.grad, name=f"hooks.{name}", op=hvd.Average)
                    )
                )

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for h in self.handles:
            self.hvd.synchronize(h)
        self.handles.clear()
        self.opt.step()


def steps(torch, n_steps: int = 30, batch: int = 64) -> list:
    """Step time of each model without communication, with DDP (NCCL) and
    with cring.torch.DistributedOptimizer; cring's NCCL launches per step."""
    import cring.torch as hvd
    from cring import _gpu

    rows = []
    dev = torch.device("cuda", 0)
    for name, make in models(torch):
        x = torch.randn(batch, 3, 224, 224, device=dev)
        y = torch.randint(0, 1000, (batch,), device=dev)
        grad_bytes = None
        for how in ("none", "ddp", "cring", "hooks"):
            torch.manual_seed(0)
            model = make().to(dev)
            grad_bytes = sum(p.numel() * 4 for p in model.parameters())
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            if how == "ddp":
                model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0])
            elif how == "cring":
                opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
            elif how == "hooks":
                opt = HookReducer(model, opt)

            for _ in range(5):
                train_step(torch, model, opt, x, y)
            torch.cuda.synchronize()
            calls0 = _gpu.stats()["nccl_calls"]
            t0 = time.perf_counter()
            for _ in range(n_steps):
                train_step(torch, model, opt, x, y)
            torch.cuda.synchronize()
            seconds = (time.perf_counter() - t0) / n_steps
            launches = (
                (_gpu.stats()["nccl_calls"] - calls0) / n_steps if how in ("cring", "hooks") else ""
            )
            rows.append([name, how, seconds, launches, grad_bytes])
            del model, opt
            torch.cuda.empty_cache()
    threshold = int(os.environ.get("CRING_FUSION_THRESHOLD", 64 << 20))
    for row in rows:
        row.append(-(-row[4] // threshold) + 2)  # the launch goal
    return rows


def issue16(torch, only: str = "") -> None:
    import torch.distributed as dist

    import cring

    os.environ.pop("CRING_GPU_OPERATIONS", None)
    torch.cuda.set_device(0)
    cring.init(rank=0, size=1)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        device_id=torch.device("cuda", 0),
    )
    gathers = allgather_per_call(torch)
    allgather_report(gathers)
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / "gpu_allgather.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["who", "bytes", "seconds"])
        w.writerows(gathers)
    if only == "allgather":
        dist.destroy_process_group()
        cring.shutdown()
        return
    calls = per_call(torch)
    ref = calls[-1][1]
    print(f"\n{'per call, 4 KiB, world size 1':40s} {'time':>10s} {'vs torch':>9s}")
    for who, t in calls:
        print(f"{who:40s} {t * 1e6:8.1f} us {t / ref:8.2f}x")
    print("(goal: cring <= 1.0x torch.distributed; stretch 0.5x)")
    rows = steps(torch)
    print(
        f"\n{'model':20s} {'with':6s} {'step':>10s} {'vs none':>8s} {'NCCL/step':>10s} {'goal':>5s}"
    )
    none = {r[0]: r[2] for r in rows if r[1] == "none"}
    for name, how, t, launches, _bytes, goal in rows:
        shown = f"{launches:.1f}" if launches != "" else ""
        print(
            f"{name:20s} {how:6s} {t * 1e3:7.2f} ms {t / none[name]:7.3f}x {shown:>10s} "
            f"{goal if how in ('cring', 'hooks') else '':>5}"
        )
    print(
        "(goals: cring <= DDP's step time and within 1.03x of none; NCCL/step <= goal; at "
        "world size 1 DistributedOptimizer does not communicate, 'hooks' makes the same "
        "calls it makes with more ranks)"
    )
    dist.destroy_process_group()
    cring.shutdown()
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / "gpu_steps.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            ["case", "with", "seconds", "nccl_launches_per_step", "gradient_bytes", "launch_goal"]
        )
        w.writerows([["per call 4 KiB", who, t, "", "", ""] for who, t in calls] + rows)


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
    parser.add_argument(
        "--only",
        choices=("sizes", "steps", "allgather"),
        help="only the message-size tables, only the per-call and step parts, or only "
        "the allgather per-call table",
    )
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
    if args.only != "sizes":
        issue16(torch, args.only or "")
    if args.only in ("steps", "allgather"):
        return 0
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

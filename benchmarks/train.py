"""Training benchmark: steps/s of a communication-heavy model with cring's
DistributedOptimizer against torch DistributedDataParallel over gloo, two
ranks, in one run (the same processes, the same model, data and optimizer).

The model is a wide MLP (~21M float32 parameters, 84 MB of gradients) with a
tiny batch, so that communication dominates a step. Also measured:
  * a local step with no communication at all (plain optimizer),
  * a DDP step inside no_sync() (DDP's own step without its allreduce),
from which the share of a DDP step spent communicating is
1 - t(no_sync) / t(DDP), and the part of a cring step not hidden behind
compute is 1 - t(local) / t(cring).

Rounds alternate between the cases so that drift on a shared machine hits
all of them alike; each figure is the median over rounds. At the end the
two distributed models, trained on the same batches, must agree.

The sharded run (same job, --part zero): the same MLP with cring's
DistributedOptimizer unsharded, with shard_state=1 (ZeRO stage 1: optimizer
state sharded) and shard_state=2 (gradients too), and torch's
ZeroRedundancyOptimizer behind DDP over gloo, rounds alternating; the four
models train on the same batches and must agree at the end.

The scaling run (same job): a compute-bound model (a small CNN on 32x32
images, 0.24M parameters, batch 32 per rank), one thread per rank. Rounds
alternate between
  * 1 rank x 1 thread: rank 0 trains alone with a plain optimizer while
    rank 1 waits in a cring barrier (asleep),
  * 2 ranks x 1 thread: both train with cring's DistributedOptimizer,
  * 2 ranks x 1 thread with no communication (each its own model), which
    shows what two busy cores cost by themselves,
and the throughput ratio is (2 x batch / t_pair) / (batch / t_solo); data
parallelism on two cores can at best double it.

The comm run also times cring with gradient_as_bucket_view=True (gradients
as views into shared-memory buckets reduced in place; docs/performance.md).

Targets: cring / DDP steps/s >= 1.3 (issue 7); cring with
gradient_as_bucket_view / DDP steps/s >= 2.0 and scaling ratio >= 1.9 (issue
20; it was 1.8). The bucket-view target sits at the physical limit: a cring
step cannot be shorter than the local step with no communication.
Target (issue 18): shard_state=1 step time <= 1.15 x the unsharded one.

Prints tables, writes benchmarks/results/train.csv. Run it as
    python benchmarks/train.py [--quick] [--part comm|zero|scaling ...]
(it starts its two ranks itself).
"""

from __future__ import annotations

import argparse
import csv
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
COMM_TARGET = 1.3  # cring DistributedOptimizer steps/s over DDP-gloo's, at least
BUCKET_VIEW_TARGET = 2.0  # the same with gradient_as_bucket_view (issue 20), at least
SCALING_TARGET = 1.9  # 2 ranks x 1 thread over 1 rank x 1 thread throughput, at least
ZERO_TARGET = 1.15  # cring shard_state=1 step time over the unsharded one's, at most
LAUNCHER_VARS = (
    "CRING_RANK",
    "CRING_SIZE",
    "CRING_LOCAL_RANK",
    "CRING_LOCAL_SIZE",
    "CRING_ADDR",
    "CRING_PORT",
    "CRING_SECRET",
    "CRING_JOB_ID",
    "CRING_STORE_EXTERNAL",
)


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
        "--width",
        str(args.width),
        "--layers",
        str(args.layers),
        "--batch",
        str(args.batch),
        "--steps",
        str(args.steps),
        "--rounds",
        str(args.rounds),
        "--cnn-width",
        str(args.cnn_width),
        "--cnn-batch",
        str(args.cnn_batch),
        "--scaling-steps",
        str(args.scaling_steps),
        "--part",
        *args.part,
    ]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}  # an outer cringrun's
    env.setdefault("OPENBLAS_NUM_THREADS", "1")  # no idle BLAS threads on two cores
    return subprocess.call(cmd, timeout=1200, env=env)


def verdict(value: float, target: float) -> str:
    return "PASS" if value >= target else f"MISS by {target / value - 1:.0%}"


def worker(args: argparse.Namespace) -> None:
    import torch

    import cring

    torch.set_num_threads(1)  # two ranks on a two-core machine
    cring.init()
    rows: list = []  # (case, seconds per step or "", value)
    if "comm" in args.part:
        rows += comm_heavy(args)
    if "zero" in args.part:
        rows += sharded(args)
    if "scaling" in args.part:
        rows += scaling(args)
    if cring.rank() == 0:
        RESULTS.mkdir(exist_ok=True)
        with open(RESULTS / "train.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["case", "seconds_per_step", "steps_per_second"])
            w.writerows(rows)
    cring.shutdown()


DIM_IN, CLASSES = 512, 16  # the communication-heavy MLP's input and output widths


def init_gloo() -> None:
    """torch.distributed over gloo beside cring: rank 0 picks the port."""
    import numpy as np
    import torch.distributed as dist

    import cring

    port = np.zeros(1, np.int64)  # rank 0 picks gloo's port and tells the others
    if cring.rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port[0] = s.getsockname()[1]
    cring.broadcast_(port, 0, name="gloo.port")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{int(port[0])}",
        rank=cring.rank(),
        world_size=cring.size(),
    )


def make_mlp(args: argparse.Namespace) -> torch.nn.Module:  # noqa: F821
    """The communication-heavy MLP (~21M parameters by default), seeded."""
    import torch

    torch.manual_seed(0)
    layers: list = [torch.nn.Linear(DIM_IN, args.width), torch.nn.ReLU()]
    for _ in range(args.layers - 2):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(args.width, CLASSES))
    return torch.nn.Sequential(*layers)


def comm_heavy(args: argparse.Namespace) -> list:
    """cring DistributedOptimizer against DDP over gloo; returns CSV rows."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    import cring
    from cring.torch import DistributedOptimizer, broadcast_parameters

    rank, size = cring.rank(), cring.size()
    init_gloo()

    width, dim_in, classes = args.width, DIM_IN, CLASSES

    def make_model() -> torch.nn.Module:
        return make_mlp(args)

    def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    g = torch.Generator().manual_seed(1 + rank)  # each rank its own data
    batches = [
        (
            torch.randn(args.batch, dim_in, generator=g),
            torch.randint(0, classes, (args.batch,), generator=g),
        )
        for _ in range(4)
    ]

    local = make_model()
    local_opt = sgd(local)

    ours = make_model()
    broadcast_parameters(ours.state_dict(), root_rank=0)
    ours_opt = DistributedOptimizer(sgd(ours), named_parameters=ours.named_parameters())

    ours_bv = make_model()  # the same with gradients as views into shared buckets
    broadcast_parameters(ours_bv.state_dict(), root_rank=0)
    ours_bv_opt = DistributedOptimizer(
        sgd(ours_bv),
        named_parameters=[(f"bv.{n}", p) for n, p in ours_bv.named_parameters()],
        gradient_as_bucket_view=True,
    )
    bucket_view = ours_bv_opt._cring_buckets is not None  # False over TCP: the usual path

    ddp = DistributedDataParallel(make_model())
    ddp_opt = sgd(ddp)

    n_params = sum(p.numel() for p in ours.parameters())
    counter = {"local": 0, "cring": 0, "cring_bv": 0, "ddp": 0, "ddp_no_sync": 0}

    def step(model: torch.nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
        x, y = batches[i % len(batches)]
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    def run_local() -> None:
        step(local, local_opt, counter["local"])

    def run_cring() -> None:
        step(ours, ours_opt, counter["cring"])

    def run_cring_bv() -> None:
        step(ours_bv, ours_bv_opt, counter["cring_bv"])

    def run_ddp() -> None:
        step(ddp, ddp_opt, counter["ddp"])

    def run_ddp_no_sync() -> None:
        with ddp.no_sync():  # DDP's step without its allreduce (accumulates locally)
            step(ddp, ddp_opt, counter["ddp_no_sync"])

    cases = {
        "local": run_local,
        "cring": run_cring,
        "cring_bv": run_cring_bv,
        "ddp": run_ddp,
        "ddp_no_sync": run_ddp_no_sync,
    }

    def timed(name: str) -> float:
        """Seconds per step over args.steps steps, all ranks starting together."""
        fn = cases[name]
        cring.barrier()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            fn()
            counter[name] += 1
        return (time.perf_counter() - t0) / args.steps

    # the two distributed models must see the same batches in the same order: train them
    # in lockstep, warming up each case first
    for name in cases:
        for _ in range(2):
            cases[name]()
            counter[name] += 1
    samples: dict = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name in ("local", "cring", "cring_bv", "ddp", "ddp_no_sync"):
            samples[name].append(timed(name))
    t = {name: statistics.median(v) for name, v in samples.items()}

    # no_sync steps changed DDP's model locally (and differently per rank): compare the
    # cring model with a DDP replica of its own instead: one more identical run of both
    check_ours = make_model()
    broadcast_parameters(check_ours.state_dict(), root_rank=0)
    check_ours_opt = DistributedOptimizer(
        sgd(check_ours),
        named_parameters=[(f"check.{n}", p) for n, p in check_ours.named_parameters()],
    )
    check_ddp = DistributedDataParallel(make_model())
    check_ddp_opt = sgd(check_ddp)
    for i in range(3):
        step(check_ours, check_ours_opt, i)
        step(check_ddp, check_ddp_opt, i)
    a = torch.cat([p.detach().reshape(-1) for p in check_ours.parameters()])
    b = torch.cat([p.detach().reshape(-1) for p in check_ddp.module.parameters()])
    agree = float((a - b).abs().max() / b.abs().max())
    # the bucket-view model trained on the same batches as the default one
    c = torch.cat([p.detach().reshape(-1) for p in ours.parameters()])
    d = torch.cat([p.detach().reshape(-1) for p in ours_bv.parameters()])
    agree_bv = float((c - d).abs().max() / c.abs().max())
    stats = cring.engine_stats()
    dist.destroy_process_group()

    ratio = t["ddp"] / t["cring"]
    ratio_bv = t["ddp"] / t["cring_bv"]
    rows = [
        ("local step, no communication", "local"),
        ("cring DistributedOptimizer", "cring"),
        ("cring, gradient_as_bucket_view" + ("" if bucket_view else " (n/a)"), "cring_bv"),
        ("torch DDP over gloo", "ddp"),
        ("torch DDP, no_sync (no allreduce)", "ddp_no_sync"),
    ]
    csv_rows = [(label, f"{t[name]:.6g}", f"{1 / t[name]:.4g}") for label, name in rows]
    csv_rows.append(("cring/DDP steps per second ratio", "", f"{ratio:.4g}"))
    csv_rows.append(("cring bucket view/DDP steps per second ratio", "", f"{ratio_bv:.4g}"))
    csv_rows.append(("DDP communication share", "", f"{1 - t['ddp_no_sync'] / t['ddp']:.4g}"))
    if rank == 0:
        ddp_share = 1 - t["ddp_no_sync"] / t["ddp"]
        cring_exposed = 1 - t["local"] / t["cring"]
        print(
            f"\ntraining benchmark: {size} ranks over {cring.transport()} (cring) and gloo "
            f"(DDP), MLP {dim_in}-{width}x{args.layers - 1}-{classes}: "
            f"{n_params / 1e6:.1f}M float32 parameters ({n_params * 4 / 2**20:.0f} MiB of "
            f"gradients), batch {args.batch} per rank, SGD with momentum, median of "
            f"{args.rounds} rounds of {args.steps} steps\n"
        )
        print(f"{'case':38s} {'ms/step':>9s} {'steps/s':>9s}")
        for label, name in rows:
            print(f"{label:38s} {t[name] * 1e3:9.1f} {1 / t[name]:9.2f}")
        print(
            f"\ncring / DDP steps/s: {ratio:.2f}x (target >= {COMM_TARGET}: "
            f"{verdict(ratio, COMM_TARGET)})"
        )
        print(
            f"cring gradient_as_bucket_view / DDP steps/s: {ratio_bv:.2f}x (target >= "
            f"{BUCKET_VIEW_TARGET}: {verdict(ratio_bv, BUCKET_VIEW_TARGET)}; "
            f"{t['cring'] / t['cring_bv']:.2f}x the default; models agree to {agree_bv:.1e})"
        )
        print(f"DDP step spent communicating: {ddp_share:.0%} (1 - no_sync / DDP)")
        print(f"cring step not hidden behind compute: {cring_exposed:.0%} (1 - local / cring)")
        print(
            f"cring engine: {stats['tensors'] / max(stats['collectives'], 1):.1f} tensors per "
            f"collective; cring and DDP models after 3 identical steps agree to {agree:.1e}\n"
        )
    if agree > 1e-4 or agree_bv > 1e-4:
        raise SystemExit(
            f"cring and DDP training disagree: {agree:.2e}, bucket view {agree_bv:.2e}"
        )
    return csv_rows


def sharded(args: argparse.Namespace) -> list:
    """Sharded optimizer state on the communication-heavy MLP: cring's
    DistributedOptimizer unsharded, with shard_state=1 and 2, and torch's
    ZeroRedundancyOptimizer (stage 1) behind DDP over gloo; returns CSV rows."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    import cring
    from cring.torch import DistributedOptimizer, broadcast_parameters

    rank, size = cring.rank(), cring.size()
    init_gloo()

    def sgd_args() -> dict:
        return {"lr": 1e-3, "momentum": 0.9}

    g = torch.Generator().manual_seed(1 + rank)  # each rank its own data
    batches = [
        (
            torch.randn(args.batch, DIM_IN, generator=g),
            torch.randint(0, CLASSES, (args.batch,), generator=g),
        )
        for _ in range(4)
    ]

    def ours(stage: int, prefix: str) -> tuple:
        model = make_mlp(args)
        broadcast_parameters(model.state_dict(), root_rank=0)
        opt = DistributedOptimizer(
            torch.optim.SGD(model.parameters(), **sgd_args()),
            named_parameters=[(f"{prefix}.{n}", p) for n, p in model.named_parameters()],
            shard_state=stage,
        )
        return model, opt

    def torch_zero() -> tuple:
        model = DistributedDataParallel(make_mlp(args))
        opt = ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.SGD, **sgd_args()
        )
        return model, opt

    setups = {
        "cring": ours(0, "z0"),
        "stage1": ours(1, "z1"),
        "stage2": ours(2, "z2"),
        "torch_zero": torch_zero(),
    }
    counter = dict.fromkeys(setups, 0)

    def step(name: str) -> None:
        model, opt = setups[name]
        x, y = batches[counter[name] % len(batches)]
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        counter[name] += 1

    def timed(name: str) -> float:
        cring.barrier()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step(name)
        return (time.perf_counter() - t0) / args.steps

    for name in setups:  # warm-up, in lockstep so that every model sees the same batches
        for _ in range(2):
            step(name)
    samples: dict = {name: [] for name in setups}
    for _ in range(args.rounds):
        for name in setups:
            samples[name].append(timed(name))
    t = {name: statistics.median(v) for name, v in samples.items()}

    # all four trained on the same batches in the same order: they must agree
    ref = torch.cat([p.detach().reshape(-1) for p in setups["cring"][0].parameters()])
    agree = {}
    for name in ("stage1", "stage2", "torch_zero"):
        got = torch.cat([p.detach().reshape(-1) for p in setups[name][0].parameters()])
        agree[name] = float((got - ref).abs().max() / ref.abs().max())
    dist.destroy_process_group()

    labels = [
        ("cring DistributedOptimizer (unsharded)", "cring"),
        ("cring shard_state=1 (ZeRO stage 1)", "stage1"),
        ("cring shard_state=2 (ZeRO stage 2)", "stage2"),
        ("torch ZeroRedundancyOptimizer + DDP, gloo", "torch_zero"),
    ]
    ratio1, ratio2 = t["stage1"] / t["cring"], t["stage2"] / t["cring"]
    rows = [(f"zero: {label}", f"{t[name]:.6g}", f"{1 / t[name]:.4g}") for label, name in labels]
    rows += [
        ("zero: stage 1 / unsharded step time", "", f"{ratio1:.4g}"),
        ("zero: stage 2 / unsharded step time", "", f"{ratio2:.4g}"),
        (
            "zero: torch ZeroRedundancyOptimizer / cring stage 1 step time",
            "",
            f"{t['torch_zero'] / t['stage1']:.4g}",
        ),
    ]
    if rank == 0:
        n_params = sum(p.numel() for p in setups["cring"][0].parameters())
        print(
            f"\nsharded optimizer state: {size} ranks, the same MLP ({n_params / 1e6:.1f}M "
            f"parameters), batch {args.batch} per rank, SGD with momentum, median of "
            f"{args.rounds} rounds of {args.steps} steps\n"
        )
        print(f"{'case':44s} {'ms/step':>9s} {'steps/s':>9s}")
        for label, name in labels:
            print(f"{label:44s} {t[name] * 1e3:9.1f} {1 / t[name]:9.2f}")
        print(
            f"\nstage 1 / unsharded step time: {ratio1:.3f} (target <= {ZERO_TARGET}: "
            f"{'PASS' if ratio1 <= ZERO_TARGET else f'MISS by {ratio1 / ZERO_TARGET - 1:.0%}'})"
        )
        print(f"stage 2 / unsharded step time: {ratio2:.3f}")
        print(
            f"torch ZeroRedundancyOptimizer (gloo) / cring stage 1 step time: "
            f"{t['torch_zero'] / t['stage1']:.2f}"
        )
        print(
            "after the same steps, relative difference to the unsharded model: "
            + ", ".join(f"{k} {v:.1e}" for k, v in agree.items())
            + "\n"
        )
    if max(agree.values()) > 1e-4:
        raise SystemExit(f"sharded and unsharded training disagree: {agree}")
    return rows


def scaling(args: argparse.Namespace) -> list:
    """Compute-bound model: 2 ranks x 1 thread against 1 rank x 1 thread, rounds
    alternating in the same job; returns CSV rows."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    import cring
    from cring.torch import DistributedOptimizer, broadcast_parameters

    rank, size = cring.rank(), cring.size()
    w, classes = args.cnn_width, 10

    def make_model() -> torch.nn.Module:
        torch.manual_seed(0)
        nn = torch.nn
        return nn.Sequential(
            nn.Conv2d(3, w, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(w, 2 * w, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(2 * w, 4 * w, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(4 * w, 4 * w, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(4 * w, classes),
        )

    def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)

    g = torch.Generator().manual_seed(100 + rank)
    batches = [
        (
            torch.randn(args.cnn_batch, 3, 32, 32, generator=g),
            torch.randint(0, classes, (args.cnn_batch,), generator=g),
        )
        for _ in range(4)
    ]
    solo = make_model()
    solo_opt = sgd(solo)
    pair = make_model()
    broadcast_parameters(pair.state_dict(), root_rank=0)
    pair_opt = DistributedOptimizer(
        sgd(pair), named_parameters=[(f"scaling.{n}", p) for n, p in pair.named_parameters()]
    )
    both = make_model()  # each rank's own copy: two ranks computing, no communication
    both_opt = sgd(both)
    n_params = sum(p.numel() for p in pair.parameters())
    done = {"solo": 0, "pair": 0, "both": 0}

    def steps(name: str, model: torch.nn.Module, opt: torch.optim.Optimizer, n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            x, y = batches[done[name] % len(batches)]
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            done[name] += 1
        return (time.perf_counter() - t0) / n

    def solo_round(n: int) -> float:
        cring.barrier()
        t = steps("solo", solo, solo_opt, n) if rank == 0 else 0.0
        cring.barrier()  # rank 1 sleeps here while rank 0 trains alone
        return t

    def pair_round(n: int) -> float:
        cring.barrier()
        return steps("pair", pair, pair_opt, n)

    def both_round(n: int) -> float:
        cring.barrier()
        return steps("both", both, both_opt, n)

    solo_round(2)  # warm-up
    pair_round(2)
    both_round(2)
    t_solo, t_pair, t_both = [], [], []
    for _ in range(args.rounds):
        t_solo.append(solo_round(args.scaling_steps))
        t_pair.append(pair_round(args.scaling_steps))
        t_both.append(both_round(args.scaling_steps))
    times = np.array([statistics.median(t) for t in (t_solo, t_pair, t_both)])
    ts, tp, tb = (float(v) for v in cring.broadcast(times, 0, name="scaling.times"))  # rank 0's
    thr_solo, thr_pair = args.cnn_batch / ts, size * args.cnn_batch / tp
    ratio = thr_pair / thr_solo

    # every rank must hold the same weights after the data-parallel steps
    flat = torch.cat([p.detach().reshape(-1) for p in pair.parameters()]).numpy().copy()
    ref = cring.broadcast(flat, 0, name="scaling.check")
    diff = float(abs(flat - ref).max())
    if diff > 1e-6:
        raise SystemExit(f"rank {rank}: replicas differ after data-parallel training by {diff:.2e}")

    if rank == 0:
        print(
            f"\nscaling benchmark: compute-bound CNN (4 conv layers, width {w}, "
            f"{n_params / 1e6:.2f}M parameters), batch {args.cnn_batch} per rank, 1 thread per "
            f"rank, cring over {cring.transport()}, median of {args.rounds} alternating rounds of "
            f"{args.scaling_steps} steps\n"
        )
        print(f"{'case':38s} {'ms/step':>9s} {'samples/s':>10s}")
        print(f"{'1 rank x 1 thread (plain optimizer)':38s} {ts * 1e3:9.1f} {thr_solo:10.1f}")
        print(f"{'2 ranks x 1 thread (DistributedOpt.)':38s} {tp * 1e3:9.1f} {thr_pair:10.1f}")
        print(
            f"{'2 ranks x 1 thread, no communication':38s} {tb * 1e3:9.1f} "
            f"{size * args.cnn_batch / tb:10.1f}"
        )
        print(
            f"\nthroughput 2 ranks / 1 rank: {ratio:.2f}x (target >= {SCALING_TARGET}: "
            f"{verdict(ratio, SCALING_TARGET)}); replicas identical (max diff {diff:.1e})"
        )
        print(
            f"2 ranks without communication reach {2 * ts / tb:.2f}x of 1 rank; communication "
            f"keeps {tb / tp:.2f} of that\n"
        )
    return [
        ("scaling: 1 rank x 1 thread, compute-bound CNN", f"{ts:.6g}", f"{1 / ts:.4g}"),
        ("scaling: 2 ranks x 1 thread, compute-bound CNN", f"{tp:.6g}", f"{1 / tp:.4g}"),
        ("scaling: 2 ranks x 1 thread, no communication", f"{tb:.6g}", f"{1 / tb:.4g}"),
        ("scaling: throughput ratio 2 ranks / 1 rank", "", f"{ratio:.4g}"),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--width", type=int, default=2240)
    parser.add_argument("--layers", type=int, default=6, help="Linear layers")
    parser.add_argument("--batch", type=int, default=8, help="per-rank batch size")
    parser.add_argument("--steps", type=int, default=5, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument(
        "--part",
        nargs="+",
        choices=("comm", "zero", "scaling"),
        default=["comm", "zero", "scaling"],
        help="comm: cring vs DDP-gloo steps/s; zero: sharded optimizer state "
        "(shard_state=1, 2) vs unsharded and vs torch's "
        "ZeroRedundancyOptimizer over gloo; scaling: 2 ranks vs 1 rank",
    )
    parser.add_argument("--cnn-width", type=int, default=32, help="scaling run: CNN width")
    parser.add_argument("--cnn-batch", type=int, default=32, help="scaling run: per-rank batch")
    parser.add_argument(
        "--scaling-steps", type=int, default=4, help="scaling run: steps per timed round"
    )
    parser.add_argument("--quick", action="store_true", help="3 rounds of 3 steps each")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.scaling_steps = 3, 3, 3
    if args.worker:
        worker(args)
        return 0
    if os.environ.get("CRING_RANK", "0") != "0":
        return 0  # under cringrun: rank 0 launches the benchmark's own two ranks
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())

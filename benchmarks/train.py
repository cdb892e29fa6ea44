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

Prints a table, writes benchmarks/results/train.csv. Run it as
    python benchmarks/train.py          (it starts its two ranks itself)
"""

from __future__ import annotations

import argparse
import csv
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def launch(args: argparse.Namespace) -> int:
    cmd = [sys.executable, "-m", "cring.run", "-np", "2", sys.executable, __file__, "--worker",
           "--width", str(args.width), "--layers", str(args.layers), "--batch", str(args.batch),
           "--steps", str(args.steps), "--rounds", str(args.rounds)]
    return subprocess.call(cmd, timeout=1200)


def worker(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    import cring
    from cring.torch import DistributedOptimizer, broadcast_parameters

    torch.set_num_threads(1)  # two ranks on a two-core machine
    cring.init()
    rank, size = cring.rank(), cring.size()

    port = np.zeros(1, np.int64)  # rank 0 picks gloo's port and tells the others
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port[0] = s.getsockname()[1]
    cring.broadcast_(port, 0, name="gloo.port")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{int(port[0])}", rank=rank,
                            world_size=size)

    width, dim_in, classes = args.width, 512, 16

    def make_model() -> torch.nn.Module:
        torch.manual_seed(0)
        layers: list = [torch.nn.Linear(dim_in, width), torch.nn.ReLU()]
        for _ in range(args.layers - 2):
            layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
        layers.append(torch.nn.Linear(width, classes))
        return torch.nn.Sequential(*layers)

    def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    g = torch.Generator().manual_seed(1 + rank)  # each rank its own data
    batches = [(torch.randn(args.batch, dim_in, generator=g),
                torch.randint(0, classes, (args.batch,), generator=g)) for _ in range(4)]

    local = make_model()
    local_opt = sgd(local)

    ours = make_model()
    broadcast_parameters(ours.state_dict(), root_rank=0)
    ours_opt = DistributedOptimizer(sgd(ours), named_parameters=ours.named_parameters())

    ddp = DistributedDataParallel(make_model())
    ddp_opt = sgd(ddp)

    n_params = sum(p.numel() for p in ours.parameters())
    counter = {"local": 0, "cring": 0, "ddp": 0, "ddp_no_sync": 0}

    def step(model: torch.nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
        x, y = batches[i % len(batches)]
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    def run_local() -> None:
        step(local, local_opt, counter["local"])

    def run_cring() -> None:
        step(ours, ours_opt, counter["cring"])

    def run_ddp() -> None:
        step(ddp, ddp_opt, counter["ddp"])

    def run_ddp_no_sync() -> None:
        with ddp.no_sync():  # DDP's step without its allreduce (accumulates locally)
            step(ddp, ddp_opt, counter["ddp_no_sync"])

    cases = {"local": run_local, "cring": run_cring, "ddp": run_ddp, "ddp_no_sync": run_ddp_no_sync}

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
        for name in ("local", "cring", "ddp", "ddp_no_sync"):
            samples[name].append(timed(name))
    t = {name: statistics.median(v) for name, v in samples.items()}

    # no_sync steps changed DDP's model locally (and differently per rank): compare the
    # cring model with a DDP replica of its own instead: one more identical run of both
    check_ours = make_model()
    broadcast_parameters(check_ours.state_dict(), root_rank=0)
    check_ours_opt = DistributedOptimizer(sgd(check_ours),
                                          named_parameters=[(f"check.{n}", p) for n, p in
                                                            check_ours.named_parameters()])
    check_ddp = DistributedDataParallel(make_model())
    check_ddp_opt = sgd(check_ddp)
    for i in range(3):
        step(check_ours, check_ours_opt, i)
        step(check_ddp, check_ddp_opt, i)
    a = torch.cat([p.detach().reshape(-1) for p in check_ours.parameters()])
    b = torch.cat([p.detach().reshape(-1) for p in check_ddp.module.parameters()])
    agree = float((a - b).abs().max() / b.abs().max())
    stats = cring.engine_stats()
    dist.destroy_process_group()

    if rank == 0:
        ddp_share = 1 - t["ddp_no_sync"] / t["ddp"]
        cring_exposed = 1 - t["local"] / t["cring"]
        print(f"\ntraining benchmark: {size} ranks over {cring.transport()} (cring) and gloo "
              f"(DDP), MLP {dim_in}-{width}x{args.layers - 1}-{classes}: "
              f"{n_params / 1e6:.1f}M float32 parameters ({n_params * 4 / 2**20:.0f} MiB of "
              f"gradients), batch {args.batch} per rank, SGD with momentum, median of "
              f"{args.rounds} rounds of {args.steps} steps\n")
        print(f"{'case':38s} {'ms/step':>9s} {'steps/s':>9s}")
        rows = [("local step, no communication", "local"),
                ("cring DistributedOptimizer", "cring"),
                ("torch DDP over gloo", "ddp"),
                ("torch DDP, no_sync (no allreduce)", "ddp_no_sync")]
        for label, name in rows:
            print(f"{label:38s} {t[name] * 1e3:9.1f} {1 / t[name]:9.2f}")
        print(f"\ncring / DDP steps/s: {t['ddp'] / t['cring']:.2f}x")
        print(f"DDP step spent communicating: {ddp_share:.0%} (1 - no_sync / DDP)")
        print(f"cring step not hidden behind compute: {cring_exposed:.0%} (1 - local / cring)")
        print(f"cring engine: {stats['tensors'] / max(stats['collectives'], 1):.1f} tensors per "
              f"collective; cring and DDP models after 3 identical steps agree to {agree:.1e}\n")
        RESULTS.mkdir(exist_ok=True)
        with open(RESULTS / "train.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["case", "seconds_per_step", "steps_per_second"])
            for label, name in rows:
                w.writerow([label, f"{t[name]:.6g}", f"{1 / t[name]:.4g}"])
            w.writerow(["cring/DDP steps per second ratio", "", f"{t['ddp'] / t['cring']:.4g}"])
            w.writerow(["DDP communication share", "", f"{ddp_share:.4g}"])
    cring.shutdown()
    if agree > 1e-4:
        raise SystemExit(f"cring and DDP training disagree: relative difference {agree:.2e}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--width", type=int, default=2240)
    parser.add_argument("--layers", type=int, default=6, help="Linear layers")
    parser.add_argument("--batch", type=int, default=8, help="per-rank batch size")
    parser.add_argument("--steps", type=int, default=5, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())

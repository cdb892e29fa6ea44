"""Autotune benchmark: training steps/s with the knobs CRING_AUTOTUNE settles
on against the knobs the job started with, two ranks, in one run.

Two models, each trained with cring's DistributedOptimizer (SGD with
momentum, batch 8 per rank, one thread per rank):
  * "train.py MLP": benchmarks/train.py's communication-heavy MLP
    (512-2240x5-16, ~21M float32 parameters in 12 tensors, most of them
    large enough to run unfused anyway);
  * "deep MLP": 64 narrow layers (512-128x63-16, 128 tensors of at most
    256 KiB), where fusion decides how many collectives a step costs.
Each starts from two knob settings: the defaults (64 MiB, 1 ms) and a poor
one, CRING_FUSION_THRESHOLD=1024 (nothing fuses).

First each (model, start) trains under CRING_AUTOTUNE=1 until the tuner has
settled on every rank; the knobs it chose, the steps and seconds it took are
recorded. Then timed rounds alternate between every (model, start) with the
starting knobs and with the tuned knobs given explicitly (a fresh init each,
CRING_AUTOTUNE off), so drift on a shared machine hits all alike; each
figure is the median over rounds.

Prints a table, writes benchmarks/results/autotune.csv. Run it as
    python benchmarks/autotune.py [--quick]
(it starts its two ranks itself).
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
DIM_IN, CLASSES, BATCH = 512, 16, 8
MODELS = {"train.py MLP": (2240, 6), "deep MLP": (128, 64)}  # width, Linear layers
STARTS = {"default": {}, "threshold 1 KiB": {"CRING_FUSION_THRESHOLD": "1024"}}
KNOB_VARS = ("CRING_AUTOTUNE", "CRING_FUSION_THRESHOLD", "CRING_CYCLE_TIME")
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
    cmd = [sys.executable, "-m", "cring.run", "-np", "2", sys.executable, __file__, "--worker"]
    cmd += ["--steps", str(args.steps), "--rounds", str(args.rounds)]
    cmd += ["--sample-seconds", str(args.sample_seconds)]
    cmd += ["--steps-per-sample", str(args.steps_per_sample)]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS + KNOB_VARS}
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    return subprocess.call(cmd, timeout=1800, env=env)


def make_model(width: int, layers: int):
    import torch

    torch.manual_seed(0)
    mods: list = [torch.nn.Linear(DIM_IN, width), torch.nn.ReLU()]
    for _ in range(layers - 2):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    mods.append(torch.nn.Linear(width, CLASSES))
    return torch.nn.Sequential(*mods)


class Job:
    """One init of cring with the given knobs, one model and its optimizer."""

    def __init__(self, model: str, knobs: dict):
        import torch

        import cring
        from cring.torch import DistributedOptimizer, broadcast_parameters

        for k in KNOB_VARS:
            os.environ.pop(k, None)
        os.environ.update(knobs)
        cring.init()
        self.net = make_model(*MODELS[model])
        broadcast_parameters(self.net.state_dict(), root_rank=0)
        opt = torch.optim.SGD(self.net.parameters(), lr=1e-3, momentum=0.9)
        self.opt = DistributedOptimizer(opt, named_parameters=self.net.named_parameters())
        g = torch.Generator().manual_seed(1 + cring.rank())
        self.batches = [
            (
                torch.randn(BATCH, DIM_IN, generator=g),
                torch.randint(0, CLASSES, (BATCH,), generator=g),
            )
            for _ in range(4)
        ]
        self.i = 0

    def step(self) -> None:
        import torch.nn.functional as F

        x, y = self.batches[self.i % len(self.batches)]
        self.i += 1
        self.opt.zero_grad()
        F.cross_entropy(self.net(x), y).backward()
        self.opt.step()

    def close(self) -> None:
        import cring

        cring.shutdown()


def all_ranks(flag: bool) -> bool:
    import numpy as np

    import cring

    return bool(cring.allreduce(np.array([int(flag)], np.int32), op=cring.Min, name="all")[0])


def tune(model: str, start: dict, args: argparse.Namespace) -> dict:
    """Train under CRING_AUTOTUNE until it settles; what it chose and took."""
    import cring

    knobs = dict(start, CRING_AUTOTUNE="1")
    os.environ["CRING_AUTOTUNE_SAMPLE_SECONDS"] = str(args.sample_seconds)
    os.environ["CRING_AUTOTUNE_STEPS_PER_SAMPLE"] = str(args.steps_per_sample)
    job = Job(model, knobs)
    t0, steps = time.perf_counter(), 0
    while True:
        job.step()
        steps += 1
        if all_ranks(cring.engine_knobs()["autotune"] == "settled") or steps >= 20000:
            break
    seconds = time.perf_counter() - t0
    k = cring.engine_knobs()
    job.close()
    return {
        "settled": k["autotune"] == "settled",
        "steps": steps,
        "seconds": seconds,
        "CRING_FUSION_THRESHOLD": str(k["fusion_threshold_bytes"]),
        "CRING_CYCLE_TIME": f"{k['cycle_time_ms']:g}",
    }


def timed(model: str, knobs: dict, steps: int) -> float:
    """Seconds per step with these knobs, all ranks starting together."""
    import cring

    job = Job(model, knobs)
    for _ in range(3):
        job.step()
    cring.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        job.step()
    t = (time.perf_counter() - t0) / steps
    job.close()
    return t


def knob_text(knobs: dict) -> str:
    t = int(knobs.get("CRING_FUSION_THRESHOLD", 64 << 20))
    size = f"{t >> 20} MiB" if t >= 1 << 20 else f"{t >> 10} KiB" if t >= 1024 else f"{t} B"
    return f"{size}, {float(knobs.get('CRING_CYCLE_TIME', 1)):g} ms"


def worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    tuned: dict = {}
    for model in MODELS:
        for start, knobs in STARTS.items():
            tuned[model, start] = t = tune(model, knobs, args)
            if os.environ.get("CRING_RANK", "0") == "0":
                print(f"tuned {model}, {start}: {t}", flush=True)
    os.environ.pop("CRING_AUTOTUNE_SAMPLE_SECONDS", None)
    os.environ.pop("CRING_AUTOTUNE_STEPS_PER_SAMPLE", None)
    samples: dict = {}
    for _ in range(args.rounds):
        for (model, start), t in tuned.items():
            chosen = {k: t[k] for k in ("CRING_FUSION_THRESHOLD", "CRING_CYCLE_TIME")}
            for label, knobs in (("start", STARTS[start]), ("tuned", chosen)):
                samples.setdefault((model, start, label), []).append(
                    timed(model, knobs, args.steps)
                )
    med = {key: statistics.median(v) for key, v in samples.items()}
    if os.environ.get("CRING_RANK", "0") != "0":
        return
    head = (
        f"{'model':13s} {'start':16s} {'start knobs':>15s} {'tuned knobs':>15s} "
        f"{'tuning':>12s} {'start ms':>9s} {'tuned ms':>9s} {'speed-up':>8s}"
    )
    print(
        f"\nautotune benchmark: 2 ranks, batch {BATCH}, median of {args.rounds} rounds of "
        f"{args.steps} steps; tuning windows of >= {args.sample_seconds:g} s and >= "
        f"{args.steps_per_sample} steps\n\n{head}"
    )
    rows = []
    for (model, start), t in tuned.items():
        a, b = med[model, start, "start"], med[model, start, "tuned"]
        chosen = {k: t[k] for k in ("CRING_FUSION_THRESHOLD", "CRING_CYCLE_TIME")}
        took = f"{t['seconds']:.0f} s/{t['steps']}" if t["settled"] else "not settled"
        same = knob_text(STARTS[start]) == knob_text(chosen)
        print(
            f"{model:13s} {start:16s} {knob_text(STARTS[start]):>15s} {knob_text(chosen):>15s} "
            f"{took:>12s} {a * 1e3:9.2f} {b * 1e3:9.2f} {a / b:7.2f}x"
            + ("  (same knobs: the difference is noise)" if same else "")
        )
        rows.append(
            (
                model,
                start,
                knob_text(STARTS[start]),
                knob_text(chosen),
                t["settled"],
                f"{t['seconds']:.3g}",
                t["steps"],
                f"{a:.6g}",
                f"{b:.6g}",
                f"{a / b:.4g}",
            )
        )
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / "autotune.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            [
                "model",
                "start",
                "start_knobs",
                "tuned_knobs",
                "settled",
                "tuning_seconds",
                "tuning_steps",
                "start_seconds_per_step",
                "tuned_seconds_per_step",
                "speedup",
            ]
        )
        w.writerows(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=10, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--sample-seconds", type=float, default=0.5, help="CRING_AUTOTUNE_SAMPLE_SECONDS"
    )
    parser.add_argument(
        "--steps-per-sample", type=int, default=3, help="CRING_AUTOTUNE_STEPS_PER_SAMPLE"
    )
    parser.add_argument("--quick", action="store_true", help="3 rounds of 5 steps, 0.2 s windows")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rounds, args.sample_seconds, args.steps_per_sample = 5, 3, 0.2, 1
    if args.worker:
        worker(args)
    else:
        sys.exit(launch(args))


if __name__ == "__main__":
    main()

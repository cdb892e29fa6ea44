"""Gradient-bucket latency benchmark (issue 33): what the bucket planner
(csrc/engine/bucket_plan.c) costs a call that must not wait for a bucket,
and how long a held bucket waits when its other names never come. Two ranks
against the test doubles (build/tests/libfake_nccl.so and libfake_cudart.so,
built by `make`; FakeCudaTensor tensors, tests/gpu/fake_cuda.py), through
tests/gpu/bucket_worker.py, so no GPU is needed; what it measures is the
engine's host side (negotiation, the planner, the hold), not NCCL.

Cases (each a run of two fresh ranks; repeated, medians over repeats):
  * lone, with a 200 ms cycle (CRING_CYCLE_TIME=200): after three steps of
    a model of 24 gradients (one bucket), allreduce_async_ + synchronize of
    each planned name alone ("planned": 23 bucket-mates never come), of
    one name again and again ("again"), of new names ("fresh": never in a
    plan, the baseline), of a name right after a step ("after step");
  * out of place: 200 unnamed allreduce_async calls, each synchronized
    (the second hundred polled until done first), against the same calls
    with new names each (never in a plan: the baseline);
  * traffic: half of the bucket submitted and only polled while another
    thread runs CPU allreduces: how long the half waits (the idle rule:
    about 200 ms, whatever the traffic; before issue 33 it waited as long
    as the traffic ran).
A call of a planned name costs what a fresh one does, an unnamed call what a
newly named one does (ratios about 1: neither is held); a held one would
cost a cycle or the idle release, 200 ms.
Prints a table and writes benchmarks/results/buckets.csv. Run it as
    python benchmarks/buckets.py [--repeats N]
(`make` first; about a minute on a busy 2-core machine).
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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
GPU_TESTS = ROOT / "tests" / "gpu"
FAKES = ROOT / "build" / "tests"
TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(mode: str, **extra: str) -> list[dict]:
    """bucket_worker.py `mode` on two ranks; each rank's JSON line."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("CRING_", "HOROVOD_", "OMPI_", "PMI", "SLURM_"))
    }
    env.update(
        PYTHONPATH=os.pathsep.join(p for p in (str(GPU_TESTS), env.get("PYTHONPATH")) if p),
        CRING_TIMEOUT_SECONDS="60",
        CRING_NCCL_LIBRARY=str(FAKES / "libfake_nccl.so"),
        CRING_CUDART_LIBRARY=str(FAKES / "libfake_cudart.so"),
        CRING_FAKE_NCCL_TIMEOUT_S="20",
        CRING_FAKE_NCCL_SLOT_BYTES=str(64 << 20),
        CRING_ADDR="127.0.0.1",
        CRING_PORT=str(free_port()),
        CRING_SIZE="2",
        **extra,
    )
    procs = [
        subprocess.Popen(
            [sys.executable, str(GPU_TESTS / "bucket_worker.py"), mode],
            env=dict(env, CRING_RANK=str(r)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=TIMEOUT_S)
        if p.returncode != 0:
            sys.exit(f"bucket_worker.py {mode} failed ({p.returncode}):\n{stderr[-3000:]}")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    for lib in ("libfake_nccl.so", "libfake_cudart.so"):
        if not (FAKES / lib).exists():
            sys.exit(f"{FAKES / lib} is missing: run `make` first")
    rows: dict[str, dict[str, list]] = {}

    def add(case: str, median_s: float, max_s: float, held: int) -> None:
        row = rows.setdefault(case, {"median": [], "max": [], "held": []})
        row["median"].append(median_s)
        row["max"].append(max_s)
        row["held"].append(held)

    def named_of(r: dict) -> tuple:
        return r["named_median_wait_s"], r["named_max_wait_s"], 0

    for _ in range(args.repeats):
        for r in run("lone", CRING_CYCLE_TIME="200"):
            for phase, label in (
                ("fresh", "lone: fresh name (baseline)"),
                ("planned", "lone: planned name, bucket never fills"),
                ("again", "lone: one name again and again"),
                ("after_step", "lone: a name right after a step"),
            ):
                add(label, r[f"{phase}_median_s"], r[f"{phase}_max_s"], r[f"{phase}_held"])
        for r in run("unnamed"):
            add("out of place: new names (baseline)", *named_of(r))
            add("out of place: unnamed", r["median_wait_s"], r["max_wait_s"], r["held"])
        for r in run("traffic"):
            add("half a bucket, CPU traffic, polled", r["held_s"], r["held_s"], r["held"])

    baselines = {
        "lone": statistics.median(rows["lone: fresh name (baseline)"]["median"]),
        "out of place": statistics.median(rows["out of place: new names (baseline)"]["median"]),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    header = ["case", "median_ms", "max_ms", "vs_baseline", "held_per_rank_run"]
    table = []
    for case, row in rows.items():
        median = statistics.median(row["median"])
        baseline = next((v for k, v in baselines.items() if case.startswith(k)), None)
        table.append(
            [
                case,
                f"{median * 1e3:.3f}",
                f"{max(row['max']) * 1e3:.3f}",
                f"{median / baseline:.2f}" if baseline else "-",
                f"{statistics.median(row['held']):g}",
            ]
        )
    with open(RESULTS / "buckets.csv", "w", newline="") as f:
        csv.writer(f).writerows([header, *table])
    widths = [max(len(str(x[i])) for x in [header, *table]) for i in range(len(header))]
    for line in [header, *table]:
        print("  ".join(str(x).ljust(w) for x, w in zip(line, widths)))
    print(f"({args.repeats} runs of 2 ranks; medians over ranks and runs, max of maxima)")


if __name__ == "__main__":
    main()

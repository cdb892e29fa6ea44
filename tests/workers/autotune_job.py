"""Worker: a job under CRING_AUTOTUNE. Each step allreduces TENSORS small
named float32 arrays asynchronously (as gradients), checks every result
against the exact sum, and records the knobs engine_knobs() shows. The ranks
stop together once tuning has settled on every rank (an allreduce of the
flag), then run SETTLED_STEPS more to show the knobs no longer change.

Usage: autotune_job.py OUTDIR. Writes OUTDIR/rank<R>.json: the steps run,
the knobs after settling, the distinct knob values seen, and whether any
result was wrong.
"""

import json
import os
import sys

import numpy as np

import cring

TENSORS, COUNT, MAX_STEPS, SETTLED_STEPS = 24, 300, 100000, 50


def knobs() -> list:
    s = cring.engine_knobs()
    return [s["fusion_threshold_bytes"], s["cycle_time_ms"], s["autotune"]]


def step(k: int, rank: int, size: int) -> int:
    """One step; returns the number of wrong results."""
    inputs = [np.arange(COUNT, dtype=np.float32) + i + rank + k % 5 for i in range(TENSORS)]
    handles = [cring.allreduce_async(x, op=cring.Sum, name=f"g{i}") for i, x in enumerate(inputs)]
    wrong = 0
    for i, h in enumerate(handles):
        want = size * (np.arange(COUNT, dtype=np.float32) + i + k % 5) + size * (size - 1) / 2
        wrong += int(not np.array_equal(cring.synchronize(h), want))
    return wrong


def main() -> None:
    outdir = sys.argv[1]
    cring.init()
    rank, size = cring.rank(), cring.size()
    start = knobs()
    seen, wrong, k = {tuple(start)}, 0, 0
    flag = np.zeros(1, np.int32)
    while k < MAX_STEPS:
        wrong += step(k, rank, size)
        k += 1
        seen.add(tuple(knobs()))
        flag[0] = cring.engine_knobs()["autotune"] == "settled"
        if cring.allreduce(flag, op=cring.Min, name="settled")[0]:
            break
    after = knobs()
    for j in range(SETTLED_STEPS):
        wrong += step(k + j, rank, size)
    result = {
        "start": start,
        "steps": k,
        "settled": after,
        "final": knobs(),
        "seen": sorted(list(t) for t in seen),
        "wrong": wrong,
    }
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    print(f"rank {rank} knobs {after}", flush=True)
    cring.shutdown()


if __name__ == "__main__":
    main()

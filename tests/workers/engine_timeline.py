"""Worker: timelines in Horovod's layout. Run with CRING_TIMELINE=OUTDIR/trace.json.

- Rank 0 writes OUTDIR/trace.json itself (no per-rank suffix); after each of
  a few named ops, and after a batch of async ones, rank 0 reads it back with
  json.load while the job runs and finds the op's row ("allreduce.tl.grad").
- start_timeline(OUTDIR/py.json) returns that path on rank 0 and None on the
  others; stop_timeline() stops it; ops after the stop must not appear in it.
- start_timeline(OUTDIR/cycles.json, mark_cycles=True) adds CYCLE_START markers.
- start_timeline(OUTDIR/all.json, all_ranks=True) writes all.<R>.json per rank.

Usage: engine_timeline.py OUTDIR. Writes OUTDIR/rank<R>.json; exits 1 on a failure.
"""

import json
import sys

import numpy as np

import cring

from engine_common import Checks


def load(path):
    with open(path) as f:
        return json.load(f)


def rows(events):
    """The per-tensor rows' labels (Horovod: a process_name per tensor)."""
    return {e["args"]["name"] for e in events if e.get("name") == "process_name" and e["pid"]}


def main():
    outdir = sys.argv[1]
    cring.init()
    rank, size = cring.rank(), cring.size()
    checks = Checks(outdir, rank, size)
    env_path = f"{outdir}/trace.json"

    def after_each_op():
        ops = [
            (
                "allreduce.tl.grad",
                lambda: cring.allreduce(np.ones(1000, np.float32), name="tl.grad"),
            ),
            ("broadcast.tl.bcast", lambda: cring.broadcast(np.arange(5), 0, name="tl.bcast")),
            (
                "allgather.tl.gather",
                lambda: cring.allgather(np.ones((rank + 1, 2)), name="tl.gather"),
            ),
            (
                "reducescatter.tl.scatter",
                lambda: cring.reducescatter(np.ones((4, 2)), name="tl.scatter"),
            ),
        ]
        for row, op in ops:
            op()
            if rank != 0:
                continue
            events = load(env_path)  # raises on invalid JSON
            if row not in rows(events):
                return f"after {row}: no row named {row!r} in {env_path}"
        return None

    checks.check("CRING_TIMELINE file valid after each op", after_each_op)

    def fused_batch():
        handles = [
            cring.allreduce_async(np.full(64, k, np.float32), name=f"tl.small.{k}")
            for k in range(40)
        ]
        for h in handles:
            cring.synchronize(h)
        if rank != 0:
            return None
        missing = {f"allreduce.tl.small.{k}" for k in range(40)} - rows(load(env_path))
        if missing:
            return f"no row for {sorted(missing)[:3]}..."
        return None

    checks.check("CRING_TIMELINE file valid after a batch of async ops", fused_batch)

    def from_python():
        path = cring.start_timeline(f"{outdir}/py.json")
        expected = f"{outdir}/py.json" if rank == 0 else None
        if path != expected:
            return f"start_timeline returned {path!r}, expected {expected!r}"
        cring.allreduce(np.ones(10, np.float32), name="py.after_start")
        if rank == 0 and "allreduce.py.after_start" not in rows(load(path)):
            return "py.after_start missing from the Python-started timeline"
        cring.stop_timeline()
        cring.allreduce(np.ones(10, np.float32), name="py.after_stop")
        if rank == 0 and "allreduce.py.after_stop" in rows(load(path)):
            return "an op after stop_timeline() was written to the timeline"
        return None

    checks.check("start_timeline / stop_timeline", from_python)

    def cycles_and_all_ranks():
        cring.start_timeline(f"{outdir}/cycles.json", mark_cycles=True)
        for k in range(3):
            cring.allreduce(np.ones(10, np.float32), name=f"cyc.{k}")
        cring.stop_timeline()
        path = cring.start_timeline(f"{outdir}/all.json", all_ranks=True)
        if path != f"{outdir}/all.{rank}.json":
            return f"all_ranks=True gave {path!r}"
        cring.allreduce(np.ones(10, np.float32), name="all.ranks")
        cring.stop_timeline()
        return None

    checks.check("mark_cycles and all_ranks", cycles_and_all_ranks)
    cring.shutdown()
    checks.finish()


if __name__ == "__main__":
    main()

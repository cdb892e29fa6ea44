"""Worker: timelines. Run with CRING_TIMELINE=OUTDIR/trace.json.

- After each of a few named ops, and after a batch of async ones, this
  rank's OUTDIR/trace.<R>.json is read back with json.load while the job
  runs (the file is closed after every event, not only at shutdown).
- start_timeline(OUTDIR/py.json) switches to OUTDIR/py.<R>.json (returned),
  stop_timeline() stops it; ops after the stop must not appear in it.

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


def names_in(events, kind):
    if kind == "thread_name":
        return {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    return {e["name"] for e in events if e.get("ph") == "X"}


def main():
    outdir = sys.argv[1]
    cring.init()
    rank, size = cring.rank(), cring.size()
    checks = Checks(outdir, rank, size)
    env_path = f"{outdir}/trace.{rank}.json" if size > 1 else f"{outdir}/trace.json"

    def after_each_op():
        ops = [
            ("tl.grad", lambda: cring.allreduce(np.ones(1000, np.float32), name="tl.grad")),
            ("tl.bcast", lambda: cring.broadcast(np.arange(5), 0, name="tl.bcast")),
            ("tl.gather", lambda: cring.allgather(np.ones((rank + 1, 2)), name="tl.gather")),
            ("tl.scatter", lambda: cring.reducescatter(np.ones((4, 2)), name="tl.scatter")),
        ]
        for name, op in ops:
            op()
            events = load(env_path)  # raises on invalid JSON
            if name not in names_in(events, "thread_name"):
                return f"after {name}: no track named {name!r} in {env_path}"
        return None

    checks.check("CRING_TIMELINE file valid after each op", after_each_op)

    def fused_batch():
        handles = [
            cring.allreduce_async(np.full(64, k, np.float32), name=f"tl.small.{k}")
            for k in range(40)
        ]
        for h in handles:
            cring.synchronize(h)
        events = load(env_path)
        missing = {f"tl.small.{k}" for k in range(40)} - names_in(events, "thread_name")
        if missing:
            return f"no track for {sorted(missing)[:3]}..."
        return None

    checks.check("CRING_TIMELINE file valid after a batch of async ops", fused_batch)

    def from_python():
        path = cring.start_timeline(f"{outdir}/py.json")
        expected = f"{outdir}/py.{rank}.json" if size > 1 else f"{outdir}/py.json"
        if path != expected:
            return f"start_timeline returned {path!r}, expected {expected!r}"
        cring.allreduce(np.ones(10, np.float32), name="py.after_start")
        if "py.after_start" not in names_in(load(path), "thread_name"):
            return "py.after_start missing from the Python-started timeline"
        cring.stop_timeline()
        cring.allreduce(np.ones(10, np.float32), name="py.after_stop")
        events = load(path)
        if "py.after_stop" in names_in(events, "thread_name"):
            return "an op after stop_timeline() was written to the timeline"
        checks.info["py_path"] = path
        return None

    checks.check("start_timeline / stop_timeline", from_python)
    cring.shutdown()
    checks.finish()


if __name__ == "__main__":
    main()

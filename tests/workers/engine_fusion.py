"""Worker: how many collectives do 1000 small async allreduces cost?

Two ways of submitting 1000 tensors of 16 float32 each, then synchronizing
them all: in a tight loop (twice), and paced (three times), GAP_US
microseconds apart, as gradients arrive during a backward pass with the CPU
mostly idle. Each result is checked against NumPy; the growth of
engine_stats()["collectives"] per batch goes into the result file as
"collectives": {"tight.0": n, ..., "paced.2": n}.

Usage: engine_fusion.py OUTDIR GAP_US. Writes OUTDIR/rank<R>.json; exits 1 on
a wrong value.
"""

import sys
import time

import numpy as np

import cring

from engine_common import Checks, compare

N, COUNT = 1000, 16


def main():
    outdir, gap_s = sys.argv[1], float(sys.argv[2]) * 1e-6
    cring.init()
    rank, size = cring.rank(), cring.size()
    checks = Checks(outdir, rank, size)
    checks.info["collectives"] = {}

    def batch(label, gap):
        def run():
            cring.barrier()  # start together: the batches do not overlap
            before = cring.engine_stats()["collectives"]
            inputs = [np.arange(COUNT, dtype=np.float32) + k + rank for k in range(N)]
            handles = []
            for k, x in enumerate(inputs):
                handles.append(cring.allreduce_async(x, op=cring.Sum, name=f"{label}.{k}"))
                if gap:
                    time.sleep(gap)  # stands in for computing the next gradient
            outs = [cring.synchronize(h) for h in handles]
            grew = cring.engine_stats()["collectives"] - before
            checks.info["collectives"][label] = grew
            print(f"{label}: 1000 small allreduces ran as {grew} collectives", flush=True)
            for k, out in enumerate(outs):
                ref = (np.arange(COUNT, dtype=np.float32) + k) * size + sum(range(size))
                problem = compare(out, ref.astype(np.float32))
                if problem:
                    return f"{label}.{k}: {problem}"
            return None

        checks.check(f"{label}: 1000 small allreduces", run)

    batch("tight.0", 0.0)
    batch("tight.1", 0.0)
    for rep in range(3):
        batch(f"paced.{rep}", gap_s)
    cring.shutdown()
    checks.finish()


if __name__ == "__main__":
    main()

"""Worker: how many collectives do 1000 small async allreduces cost?

Two ways of submitting 1000 tensors of 16 float32 each, then synchronizing
them all: in a tight loop (twice), and paced (three times), GAP_US
microseconds apart, as gradients arrive during a backward pass with the CPU
mostly idle. Each result is checked against NumPy; the growth of
engine_stats()["collectives"] per batch goes into the result file as
"collectives": {"tight.0": n, ..., "paced.2": n}. Then one burst of 60
tensors, every third large ("mixed").

Usage: engine_fusion.py OUTDIR GAP_US. Writes OUTDIR/rank<R>.json; exits 1 on
a wrong value.
"""

import sys
import time

import numpy as np

import cring

from engine_common import Checks, compare

N, COUNT = 1000, 16
BIG = (1 << 20) // 4  # float32 elements of a tensor that runs alone


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

    def mixed():
        """60 tensors, every third of 1 MiB (which runs alone, in place) and
        the others small, as a backward pass interleaves them: the small ones
        still share collectives instead of each run between two large ones
        becoming its own."""
        cring.barrier()
        before = cring.engine_stats()["collectives"]
        inputs = [
            np.full(BIG if k % 3 == 0 else COUNT, k + rank, dtype=np.float32) for k in range(60)
        ]
        handles = [
            cring.allreduce_async(x, op=cring.Sum, name=f"mixed.{k}") for k, x in enumerate(inputs)
        ]
        outs = [cring.synchronize(h) for h in handles]
        checks.info["collectives"]["mixed"] = cring.engine_stats()["collectives"] - before
        for k, out in enumerate(outs):
            ref = np.full(len(inputs[k]), k * size + sum(range(size)), dtype=np.float32)
            problem = compare(out, ref)
            if problem:
                return f"mixed.{k}: {problem}"
        return None

    checks.check("mixed: 20 large and 40 small allreduces", mixed)
    cring.shutdown()
    checks.finish()


if __name__ == "__main__":
    main()

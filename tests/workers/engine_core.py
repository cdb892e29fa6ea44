"""Worker: the engine's main correctness paths on this job's ranks.

- 50 named async allreduces submitted in a different order on each rank
  (2 ranks: the last rank reverses; more: a random permutation seeded by
  rank), twice with the same names (the second pass goes through the
  response cache), every result against NumPy;
- 1000 small async allreduces: all right (how many collectives they ran as
  goes into the result file and is printed; engine_fusion.py checks it);
- broadcast, allgather, reducescatter and allreduce in one async batch,
  submitted in a different order on each rank.

Usage: engine_core.py OUTDIR. Writes OUTDIR/rank<R>.json; exits 1 on a failure.
"""

import sys

import numpy as np

import cring

from engine_common import Checks, compare

N_NAMED = 50
COUNTS = [0, 1, 7, 33, 1000, 65_537, 300_001]
DTYPES = [np.float32, np.float64, np.int32, np.int64, np.float16]
OPS = [("sum", cring.Sum), ("min", cring.Min), ("max", cring.Max)]


def submission_order(n, rank, size, salt):
    if size == 2:
        return list(range(n))[::-1] if rank == size - 1 else list(range(n))
    return [int(i) for i in np.random.default_rng([rank, salt]).permutation(n)]


def named_values(i, rank, rep):
    count = COUNTS[i % len(COUNTS)]
    dtype = DTYPES[i % len(DTYPES)]
    rng = np.random.default_rng([i, rank, rep])
    return rng.integers(-20, 21, count).astype(dtype)


def reduce_ref(opname, arrays):
    stack = np.stack(arrays)
    ref = {"sum": stack.sum(0), "min": stack.min(0), "max": stack.max(0)}[opname]
    return ref.astype(arrays[0].dtype)


def main():
    cring.init()
    rank, size = cring.rank(), cring.size()
    checks = Checks(sys.argv[1], rank, size)
    checks.info["transport"] = cring.transport()

    # 1. Named allreduces in a different order on every rank, twice.
    for rep in range(2):

        def named_out_of_order(rep=rep):
            order = submission_order(N_NAMED, rank, size, rep)
            inputs = {i: named_values(i, rank, rep) for i in range(N_NAMED)}
            handles = {}
            for i in order:
                opname, op = OPS[i % len(OPS)]
                if i % 2:
                    handles[i] = cring.allreduce_async_(inputs[i], op=op, name=f"named.{i}")
                else:
                    handles[i] = cring.allreduce_async(inputs[i], op=op, name=f"named.{i}")
            problems = []
            for i in range(N_NAMED):  # synchronize in name order, not submission order
                out = cring.synchronize(handles[i])
                if i % 2 and out is not inputs[i]:
                    problems.append(f"named.{i}: in-place result is not the input object")
                opname = OPS[i % len(OPS)][0]
                ref = reduce_ref(opname, [named_values(i, r, rep) for r in range(size)])
                problem = compare(out, ref)
                if problem:
                    problems.append(f"named.{i} ({opname}, {ref.dtype}, n={ref.size}): {problem}")
            return "; ".join(problems) or None

        checks.check(f"50 named allreduces out of order, pass {rep}", named_out_of_order)

    # 2. Many small tensors are fused.
    def many_small():
        n, count = 1000, 16
        before = cring.engine_stats()
        inputs = [np.arange(count, dtype=np.float32) + k + rank for k in range(n)]
        handles = [
            cring.allreduce_async(x, op=cring.Sum, name=f"small.{k}") for k, x in enumerate(inputs)
        ]
        outs = [cring.synchronize(h) for h in handles]
        after = cring.engine_stats()
        delta = {key: after[key] - before[key] for key in after}
        checks.info["small_delta"] = delta
        print(
            f"1000 small allreduces: {delta['collectives']} collectives, "
            f"{delta['fused_tensors']} fused tensors, {delta['cycles']} cycles",
            flush=True,
        )
        offset = sum(range(size))
        for k, out in enumerate(outs):
            ref = (np.arange(count, dtype=np.float32) + k) * size + offset
            problem = compare(out, ref.astype(np.float32))
            if problem:
                return f"small.{k}: {problem}"
        if delta["tensors"] != n:
            return f"engine_stats tensors grew by {delta['tensors']}, expected {n}"
        return None

    checks.check("1000 small allreduces", many_small)

    # 12. Mixed collectives in one async batch, in a different order per rank, twice.
    for rep in range(2):

        def mixed_batch(rep=rep):
            root = size - 1
            bcast_in = np.full(5, 10.0 * rank + rep, dtype=np.float64)
            bcast_inplace = np.arange(9, dtype=np.int32) * (rank + 1) + rep
            gather_in = np.full((rank + 1, 2), rank + rep, dtype=np.int64)
            scatter_in = (np.arange(7 * 3, dtype=np.float32).reshape(7, 3) + rep) * (rank + 1)
            reduce_in = np.arange(1001, dtype=np.float32) + rank + rep
            reduce2_in = np.full(3, rank + 1 + rep, dtype=np.int32)
            submit = {
                "bcast": lambda: cring.broadcast_async(bcast_in, root, name="mix.bcast"),
                "bcast_": lambda: cring.broadcast_async_(bcast_inplace, root, name="mix.bcast_"),
                "gather": lambda: cring.allgather_async(gather_in, name="mix.gather"),
                "scatter": lambda: cring.reducescatter_async(
                    scatter_in, op=cring.Sum, name="mix.scatter"
                ),
                "reduce": lambda: cring.allreduce_async(reduce_in, op=cring.Sum, name="mix.reduce"),
                "reduce2": lambda: cring.allreduce_async_(
                    reduce2_in, op=cring.Max, name="mix.reduce2"
                ),
            }
            keys = list(submit)
            handles = {
                keys[i]: submit[keys[i]]()
                for i in submission_order(len(keys), rank, size, 100 + rep)
            }
            got = {k: cring.synchronize(handles[k]) for k in keys}
            rows = [7 // size + (1 if r < 7 % size else 0) for r in range(size)]
            start = sum(rows[:rank])
            full_scatter = (np.arange(21, dtype=np.float32).reshape(7, 3) + rep) * sum(
                range(1, size + 1)
            )
            refs = {
                "bcast": np.full(5, 10.0 * root + rep, dtype=np.float64),
                "bcast_": np.arange(9, dtype=np.int32) * (root + 1) + rep,
                "gather": np.concatenate(
                    [np.full((r + 1, 2), r + rep, dtype=np.int64) for r in range(size)]
                ),
                "scatter": full_scatter[start : start + rows[rank]].astype(np.float32),
                "reduce": (np.arange(1001, dtype=np.float32) + rep) * size + sum(range(size)),
                "reduce2": np.full(3, size + rep, dtype=np.int32),
            }
            problems = [f"{k}: {p}" for k in keys if (p := compare(got[k], refs[k]))]
            if got["bcast_"] is not bcast_inplace:
                problems.append("broadcast_async_ did not return its argument")
            return "; ".join(problems) or None

        checks.check(f"mixed async batch, pass {rep}", mixed_batch)

    checks.info["stats"] = cring.engine_stats()
    cring.shutdown()
    checks.finish()


if __name__ == "__main__":
    main()

"""Worker for tests/test_multihost.py and benchmarks/multihost.py; writes
<outdir>/rank<R>.json.

  multihost.py collectives OUTDIR   every collective x dtype (uneven counts, 0)
  multihost.py tree OUTDIR          allreduce around the tree/ring crossover
  multihost.py kill OUTDIR VICTIM   allreduce in a loop; VICTIM kills itself
  multihost.py bench OUTDIR SPEC    timings: SPEC is bytes:iterations,...
"""

import json
import os
import signal
import sys
import time
import traceback

import numpy as np

import cring

# 40_009: above the tree crossover (64 KiB) for every dtype but the 1-byte ones
COUNTS = [0, 7, 40_009]
# bfloat16 is left out: it needs torch here, and below the reduce kernels
# (tested in C and by test_collectives) the communicator sees only 2-byte
# elements, as for float16
REDUCE_DTYPES = ["float16", "float32", "float64", "int8", "uint8", "int32", "int64"]
OPS = {
    "sum": cring.Sum,
    "average": cring.Average,
    "min": cring.Min,
    "max": cring.Max,
    "product": cring.Product,
}
RTOL = {"float16": 2e-3, "float32": 1e-6, "float64": 1e-12}


def values(dtype, op, count, rank, salt=0):
    """Deterministic per-rank input as float64 (exactly representable in dtype)."""
    rng = np.random.default_rng([count, rank, len(dtype), salt])
    if dtype == "bool":
        return rng.integers(0, 2, count).astype(np.float64)
    if op == "product":
        choices = [1.0, 2.0] if dtype == "uint8" else [-1.0, 1.0, 2.0]
        if dtype in ("int8", "uint8") and cring.size() > 6:  # 2**7 would overflow
            choices = [1.0] if dtype == "uint8" else [-1.0, 1.0]
        return rng.choice(choices, count)
    lo = 0 if dtype == "uint8" else -20
    return rng.integers(lo, 21, count).astype(np.float64)


def make(dtype, data):
    return data.astype(np.bool_) if dtype == "bool" else data.astype(dtype)


def reference(op, dtype, per_rank):
    stack = np.stack(per_rank)
    if op == "sum":
        return stack.sum(0)
    if op == "average":
        ref = stack.sum(0) / len(per_rank)
        return ref if dtype.startswith("float") else np.trunc(ref)
    if op == "min":
        return stack.min(0)
    if op == "max":
        return stack.max(0)
    return stack.prod(0)


def compare(got, ref, dtype):
    got = np.asarray(got).astype(np.float64)
    if got.shape != ref.shape:
        return f"shape {got.shape} != expected {ref.shape}"
    tol = RTOL.get(dtype, 0)
    bad = np.flatnonzero(~np.isclose(got, ref, rtol=tol, atol=tol))
    if len(bad) == 0:
        return None
    i = int(bad[0])
    return f"{len(bad)} wrong elements, first at {i}: got {got[i]} expected {ref[i]}"


def result_file(outdir, rank, result):
    with open(f"{outdir}/rank{rank}.json", "w") as f:
        json.dump(result, f)


def collectives(outdir):
    rank, size = cring.rank(), cring.size()
    cases, failures = 0, []

    def check(label, fn):
        nonlocal cases
        cases += 1
        try:
            problem = fn()
        except Exception:
            problem = traceback.format_exc(limit=3)
        if problem:
            failures.append(f"{label}: {problem}")

    names = list(OPS)
    for d, dtype in enumerate(REDUCE_DTYPES):
        # every op on float32; two ops (rotating) on the other dtypes
        ops = names if dtype == "float32" else [names[d % 5], names[(d + 2) % 5]]
        for opname in ops:
            op = OPS[opname]
            for count in COUNTS:
                per_rank = [values(dtype, opname, count, r) for r in range(size)]
                ref = reference(opname, dtype, per_rank)
                check(
                    f"allreduce {dtype} {opname} n={count}",
                    lambda: compare(
                        cring.allreduce(make(dtype, per_rank[rank]), op=op), ref, dtype
                    ),
                )
                # uneven: rank r gets count // size (+1 for the first count % size)
                rows = [count // size + (1 if r < count % size else 0) for r in range(size)]
                start = sum(rows[:rank])
                check(
                    f"reducescatter {dtype} {opname} n={count}",
                    lambda: compare(
                        cring.reducescatter(make(dtype, per_rank[rank]), op=op),
                        ref[start : start + rows[rank]],
                        dtype,
                    ),
                )
    for dtype in REDUCE_DTYPES + ["bool"]:
        for count in COUNTS:
            data = [values(dtype, "sum", count, r, salt=1) for r in range(size)]
            for root in sorted({0, size - 1}):
                check(
                    f"broadcast {dtype} n={count} root={root}",
                    lambda: compare(
                        cring.broadcast(make(dtype, data[rank]), root), data[root], dtype
                    ),
                )
            lens = [count if r % 2 == 0 else count // 3 for r in range(size)]
            mine = values(dtype, "sum", lens[rank], rank, salt=2)
            want = np.concatenate([values(dtype, "sum", lens[r], r, salt=2) for r in range(size)])
            check(
                f"allgather {dtype} n={count}",
                lambda: compare(cring.allgather(make(dtype, mine)), want, dtype),
            )
            # alltoall: rank q sends (q + r) % 3 * count // 2 rows to rank r (zeros among them)
            splits = [(rank + r) % 3 * count // 2 for r in range(size)]
            x = np.concatenate(
                [values(dtype, "sum", splits[r], rank * 100 + r, salt=3) for r in range(size)]
                or [np.zeros(0)]
            )
            from_each = [(q + rank) % 3 * count // 2 for q in range(size)]
            want_a2a = np.concatenate(
                [values(dtype, "sum", from_each[q], q * 100 + rank, salt=3) for q in range(size)]
            )

            def a2a(x=x, splits=splits, want_a2a=want_a2a, dtype=dtype, from_each=from_each):
                got, got_splits = cring.alltoall(make(dtype, x), splits=splits)
                if list(np.asarray(got_splits)) != from_each:
                    return f"received splits {list(got_splits)} != {from_each}"
                return compare(got, want_a2a, dtype)

            check(f"alltoall {dtype} n={count}", a2a)

    def async_rounds():
        """Asynchronous submissions run by the engine thread, with ranks
        arriving at different times: idle ranks must wake for peers on their
        own host (doorbell) and on others (TCP input)."""
        for trial in range(3):
            if rank == (trial * 3) % size:
                time.sleep(0.05)
            hs = [
                cring.allreduce_async(
                    np.full(100 + i * 5000, rank, np.float32), op=cring.Sum, name=f"a{trial}.{i}"
                )
                for i in range(6)
            ]
            want = float(sum(range(size)))
            for i, h in enumerate(hs):
                got = cring.synchronize(h)
                if got.shape != (100 + i * 5000,) or not (got == want).all():
                    return f"trial {trial} tensor {i}: got {got[:3]}, expected {want}"
        return None

    check("asynchronous rounds", async_rounds)
    check("barrier", lambda: cring.barrier())
    stats = cring.engine_stats()
    result_file(
        outdir,
        rank,
        {
            "rank": rank,
            "size": size,
            "local_size": cring.local_size(),
            "cross_size": cring.cross_size(),
            "transport": cring.transport(),
            "cases": cases,
            "failures": failures,
            "stats": stats,
        },
    )
    return failures


def tree(outdir):
    rank, size = cring.rank(), cring.size()
    failures, cases = [], 0
    crossover = int(os.environ.get("CRING_TREE_MAX_BYTES", 65536))
    for dtype, es in (("float32", 4), ("int64", 8), ("uint8", 1), ("float16", 2)):
        for count in (1, 3, crossover // es - 1, crossover // es, crossover // es + 1):
            for opname in ("sum", "average", "min", "max", "product"):
                per_rank = [values(dtype, opname, count, r) for r in range(size)]
                ref = reference(opname, dtype, per_rank)
                cases += 1
                op = OPS[opname]
                problem = compare(cring.allreduce(make(dtype, per_rank[rank]), op=op), ref, dtype)
                if problem:
                    failures.append(f"{dtype} {opname} n={count}: {problem}")
    result_file(
        outdir,
        rank,
        {"rank": rank, "transport": cring.transport(), "cases": cases, "failures": failures},
    )
    return failures


def kill(outdir, victim):
    rank = cring.rank()
    x = np.ones(1000, dtype=np.float32)
    start = time.time()
    outcome = {"rank": rank, "transport": cring.transport()}
    try:
        for i in range(100000):
            if rank == victim and i == 50:
                with open(f"{outdir}/killed_at", "w") as f:
                    f.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            cring.allreduce(x, op=cring.Sum, name="loop")
            if time.time() - start > 120:
                break
        outcome["error"] = None
    except Exception as e:  # what a user would see
        outcome["error"] = type(e).__name__
        outcome["message"] = str(e)[:400]
    outcome["raised_at"] = time.time()
    result_file(outdir, rank, outcome)
    os._exit(0)  # no shutdown handshake with a dead peer


def bench(outdir, spec):
    """Times allreduce of float32 arrays: for each bytes:iterations, the
    median and the fastest of the iterations (after 2 warm-ups) and the
    TCP/shm bytes this rank moved per call (engine_stats deltas)."""
    rank = cring.rank()
    rows = []
    for item in spec.split(","):
        nbytes, iters = (int(v) for v in item.split(":"))
        x = np.ones(max(1, nbytes // 4), dtype=np.float32)
        for _ in range(2):
            cring.allreduce_(x, op=cring.Sum, name=f"b{nbytes}")
        cring.barrier()
        before = cring.engine_stats()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            cring.allreduce_(x, op=cring.Sum, name=f"b{nbytes}")
            times.append(time.perf_counter() - t0)
        after = cring.engine_stats()
        delta = {k: (after[k] - before[k]) / iters for k in after if k.endswith("_bytes_sent")}
        cring.barrier()
        rows.append(
            {
                "bytes": nbytes,
                "median_s": float(np.median(times)),
                "min_s": float(np.min(times)),
                "per_call": delta,
            }
        )
    result_file(outdir, rank, {"rank": rank, "transport": cring.transport(), "rows": rows})
    return []


def main():
    mode, outdir = sys.argv[1], sys.argv[2]
    cring.init()
    if mode == "kill":
        kill(outdir, int(sys.argv[3]))
    failures = {"collectives": collectives, "tree": tree}.get(mode)
    failures = failures(outdir) if failures else bench(outdir, sys.argv[3])
    cring.shutdown()
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()

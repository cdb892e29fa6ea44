"""Worker: every collective x dtype x op x element count on this job's ranks,
checked against NumPy references. Writes <outdir>/rank<R>.json with the
number of cases and every failure; exits 1 if any case failed."""

import json
import sys
import traceback
from functools import partial

import numpy as np

import cring

try:
    import torch  # only for bfloat16, which NumPy lacks
except ImportError:  # pragma: no cover - the test environment has torch
    torch = None

COUNTS = [0, 1, 7, 1_000_003]
REDUCE_DTYPES = ["float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64"]
MOVE_DTYPES = REDUCE_DTYPES + ["bool"]
OPS = {
    "sum": cring.Sum,
    "average": cring.Average,
    "min": cring.Min,
    "max": cring.Max,
    "product": cring.Product,
}
RTOL = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 1e-6, "float64": 1e-12}


def values(dtype, op, count, rank, salt=0):
    """Deterministic per-rank input as float64 (exactly representable in dtype)."""
    rng = np.random.default_rng(
        [count, rank, REDUCE_DTYPES.index(dtype) if dtype in REDUCE_DTYPES else 9, salt]
    )
    if dtype == "bool":
        return rng.integers(0, 2, count).astype(np.float64)
    if op == "product":
        choices = [1.0, 2.0] if dtype == "uint8" else [-1.0, 1.0, 2.0, 0.5]
        if dtype.startswith("int"):
            choices = [-1.0, 1.0, 2.0]
        return rng.choice(choices, count)
    lo = 0 if dtype == "uint8" else -20
    return rng.integers(lo, 21, count).astype(np.float64)


def make(dtype, data, kind="numpy"):
    if dtype == "bfloat16":
        return torch.tensor(data, dtype=torch.float64).to(torch.bfloat16)
    if dtype == "bool":
        return data.astype(np.bool_)
    return data.astype(dtype)


def as_f64(x):
    if torch is not None and isinstance(x, torch.Tensor):
        return x.to(torch.float64).numpy()
    return np.asarray(x).astype(np.float64)


def reference(op, dtype, per_rank):
    stack = np.stack(per_rank)
    if op == "sum":
        ref = stack.sum(0)
    elif op == "average":
        ref = stack.sum(0) / len(per_rank)
        if not dtype.startswith("float") and dtype != "bfloat16":
            ref = np.trunc(ref)
    elif op == "min":
        ref = stack.min(0)
    elif op == "max":
        ref = stack.max(0)
    else:
        ref = stack.prod(0)
    return ref


def compare(got, ref, dtype):
    got = as_f64(got)
    if got.shape != ref.shape:
        return f"shape {got.shape} != expected {ref.shape}"
    if dtype in RTOL:
        ok = np.allclose(got, ref, rtol=RTOL[dtype], atol=RTOL[dtype])
    else:
        ok = np.array_equal(got, ref)
    if ok:
        return None
    bad = np.flatnonzero(~np.isclose(got, ref, rtol=RTOL.get(dtype, 0), atol=RTOL.get(dtype, 0)))
    i = int(bad[0])
    return (
        f"{len(bad)} wrong elements, first at {i}: got {got.ravel()[i]} expected {ref.ravel()[i]}"
    )


def main():
    outdir = sys.argv[1]
    cring.init()
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

    def in_view(dtype, data, ref):
        """A view that starts inside a larger array: the result lands in
        the view, and the elements around it are untouched."""
        base = np.full(len(data) + 5, 7, dtype=dtype)
        x = base[3 : 3 + len(data)]
        x[...] = data
        cring.allreduce_(x, op=cring.Sum, name=f"view.{dtype}.{len(data)}")
        around = base[[0, 1, 2, -2, -1]].astype(np.float64)
        if not (around == 7).all():
            return f"wrote outside the view: {around}"
        return compare(x, ref, dtype)

    for dtype in REDUCE_DTYPES:
        for opname, op in OPS.items():
            for count in COUNTS:
                per_rank = [values(dtype, opname, count, r) for r in range(size)]
                ref = reference(opname, dtype, per_rank)

                def out_of_place():
                    x = make(dtype, per_rank[rank])
                    before = as_f64(x).copy()
                    y = cring.allreduce(x, op=op)
                    if type(y) is not type(x):
                        return f"returned {type(y).__name__} for {type(x).__name__}"
                    if not np.array_equal(as_f64(x), before):
                        return "input was modified"
                    return compare(y, ref, dtype)

                def in_place(name=None):
                    x = make(dtype, per_rank[rank])
                    # with a name, NumPy arrays take _C.allreduce_'s direct path
                    y = cring.allreduce_(x, op=op, name=name)
                    if y is not x:
                        return "allreduce_ did not return its argument"
                    return compare(x, ref, dtype)

                def scatter():
                    y = cring.reducescatter(make(dtype, per_rank[rank]), op=op)
                    rows = [count // size + (1 if r < count % size else 0) for r in range(size)]
                    start = sum(rows[:rank])
                    return compare(y, ref[start : start + rows[rank]], dtype)

                check(f"allreduce {dtype} {opname} n={count}", out_of_place)
                check(f"allreduce_ {dtype} {opname} n={count}", in_place)
                check(
                    f"allreduce_ named {dtype} {opname} n={count}",
                    partial(in_place, f"ip.{dtype}.{opname}.{count}"),
                )
                if dtype != "bfloat16" and opname == "sum":
                    check(
                        f"allreduce_ named view {dtype} n={count}",
                        partial(in_view, dtype, per_rank[rank], ref),
                    )
                check(f"reducescatter {dtype} {opname} n={count}", scatter)

    for dtype in MOVE_DTYPES:
        for count in COUNTS:
            for root in sorted({0, size - 1}):
                data = [values(dtype, "sum", count, r, salt=1) for r in range(size)]

                def bcast():
                    x = make(dtype, data[rank])
                    y = cring.broadcast(x, root_rank=root)
                    problem = compare(y, data[root], dtype)
                    if problem:
                        return "broadcast: " + problem
                    z = make(dtype, data[rank])
                    if cring.broadcast_(z, root) is not z:
                        return "broadcast_ did not return its argument"
                    return compare(z, data[root], dtype)

                check(f"broadcast {dtype} n={count} root={root}", bcast)

            def gather():
                rows = [count if r % 2 == 0 else count // 2 for r in range(size)]
                mine = values(dtype, "sum", rows[rank], rank, salt=2)
                y = cring.allgather(make(dtype, mine))
                ref = np.concatenate(
                    [values(dtype, "sum", rows[r], r, salt=2) for r in range(size)]
                )
                return compare(y, ref, dtype)

            check(f"allgather {dtype} n={count}", gather)

    def gather_2d():
        x = np.full((rank + 1, 3), rank, dtype=np.int32)
        y = cring.allgather(x)
        ref = np.concatenate([np.full((r + 1, 3), r, dtype=np.int32) for r in range(size)])
        return compare(y, ref.astype(np.float64), "int32")

    check("allgather 2-d uneven first dimension", gather_2d)

    def scatter_2d():
        x = np.arange(7 * 3, dtype=np.float32).reshape(7, 3) * (rank + 1)
        y = cring.reducescatter(x, op=cring.Sum)
        full = np.arange(7 * 3, dtype=np.float64).reshape(7, 3) * sum(range(1, size + 1))
        rows = [7 // size + (1 if r < 7 % size else 0) for r in range(size)]
        start = sum(rows[:rank])
        return compare(y, full[start : start + rows[rank]], "float32")

    check("reducescatter 2-d", scatter_2d)

    def barrier():
        cring.barrier()
        return None

    check("barrier", barrier)
    result = {
        "rank": rank,
        "size": size,
        "transport": cring.transport(),
        "cases": cases,
        "failures": failures,
    }
    with open(f"{outdir}/rank{rank}.json", "w") as f:
        json.dump(result, f)
    cring.shutdown()
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()

"""Worker: every collective x the 16-bit and unsigned integer dtypes (int16,
uint16, uint32, uint64) x op, on NumPy arrays and on CPU torch tensors,
against NumPy references computed with the same wrap-around. Writes
<outdir>/rank<R>.json with the number of cases and every failure; exits 1 if
any case failed."""

import json
import sys
import traceback

import numpy as np

import cring

try:
    import torch
except ImportError:  # pragma: no cover - the test environment has torch
    torch = None

DTYPES = ["int16", "uint16", "uint32", "uint64"]
COUNTS = [0, 1, 7, 100_003]
OPS = {
    "sum": cring.Sum,
    "average": cring.Average,
    "min": cring.Min,
    "max": cring.Max,
    "product": cring.Product,
}


def values(dtype, count, rank, salt=0):
    """Per-rank input that reaches the dtype's extremes: sums and products
    wrap, and uint64 values above 2**63 test unsigned comparison."""
    info = np.iinfo(dtype)
    rng = np.random.default_rng([count, rank, DTYPES.index(dtype), salt])
    raw = rng.integers(0, 2**64, count, dtype=np.uint64, endpoint=False)
    x = raw.astype(dtype)  # every bit pattern of the width
    small = rng.integers(0, 7, count).astype(dtype)
    pick = rng.integers(0, 3, count)
    x = np.where(pick == 0, small, x)
    if count:
        x[0] = info.max if rank % 2 == 0 else info.min
    return x.astype(dtype)


def reference(op, dtype, per_rank):
    stack = np.stack(per_rank)
    with np.errstate(over="ignore"):
        if op in ("sum", "average"):
            ref = stack.sum(0, dtype=dtype)
            if op == "average":
                n = len(per_rank)
                if dtype.startswith("u"):
                    ref = ref // dtype_t(dtype)(n)
                else:  # toward zero, as C divides
                    wide = ref.astype(np.int64)
                    ref = (np.sign(wide) * (np.abs(wide) // n)).astype(dtype)
        elif op == "min":
            ref = stack.min(0)
        elif op == "max":
            ref = stack.max(0)
        else:
            ref = stack.prod(0, dtype=dtype)
    return ref.astype(dtype)


def dtype_t(dtype):
    return np.dtype(dtype).type


def as_numpy(x):
    if torch is not None and isinstance(x, torch.Tensor):
        return x.numpy()
    return np.asarray(x)


def compare(got, ref):
    got = as_numpy(got)
    if got.dtype != ref.dtype:
        return f"dtype {got.dtype} != expected {ref.dtype}"
    if got.shape != ref.shape:
        return f"shape {got.shape} != expected {ref.shape}"
    if np.array_equal(got, ref):
        return None
    bad = np.flatnonzero(got.ravel() != ref.ravel())
    i = int(bad[0])
    return f"{len(bad)} wrong, first at {i}: got {got.ravel()[i]} expected {ref.ravel()[i]}"


def kinds():
    out = ["numpy"]
    if torch is not None:
        out.append("torch")
    return out


def make(kind, data):
    data = np.array(data)  # a fresh, writable copy
    if kind == "torch":
        return torch.from_numpy(data)
    return data


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
            problem = traceback.format_exc(limit=4)
        if problem:
            failures.append(f"{label}: {problem}")

    for dtype in DTYPES:
        for kind in kinds():
            for count in COUNTS:
                tag = f"{kind} {dtype} n={count}"
                for opname, op in OPS.items():
                    per_rank = [values(dtype, count, r) for r in range(size)]
                    ref = reference(opname, dtype, per_rank)
                    mine = per_rank[rank]

                    def out_of_place(op=op, ref=ref, mine=mine):
                        x = make(kind, mine)
                        y = cring.allreduce(x, op=op)
                        if not np.array_equal(as_numpy(x), mine):
                            return "input was modified"
                        return compare(y, ref)

                    def in_place(op=op, ref=ref, mine=mine, name=None):
                        x = make(kind, mine)
                        if cring.allreduce_(x, op=op, name=name) is not x:
                            return "allreduce_ did not return its argument"
                        return compare(x, ref)

                    def grouped(op=op, ref=ref, mine=mine):
                        ys = cring.grouped_allreduce(
                            [make(kind, mine), make(kind, mine[:3])], op=op
                        )
                        return compare(ys[0], ref) or compare(ys[1], ref[:3])

                    def scatter(op=op, ref=ref, mine=mine):
                        y = cring.reducescatter(make(kind, mine), op=op)
                        rows = [count // size + (r < count % size) for r in range(size)]
                        start = sum(rows[:rank])
                        return compare(y, ref[start : start + rows[rank]])

                    check(f"allreduce {tag} {opname}", out_of_place)
                    check(f"allreduce_ {tag} {opname}", in_place)
                    check(
                        f"allreduce_ named {tag} {opname}",
                        lambda f=in_place, n=f"ip.{tag}.{opname}": f(name=n),
                    )
                    check(f"grouped_allreduce {tag} {opname}", grouped)
                    check(f"reducescatter {tag} {opname}", scatter)

                data = [values(dtype, count, r, salt=1) for r in range(size)]

                def bcast(data=data):
                    root = size - 1
                    y = cring.broadcast(make(kind, data[rank]), root_rank=root)
                    z = make(kind, data[rank])
                    cring.broadcast_(z, root)
                    return compare(y, data[root]) or compare(z, data[root])

                def gather():
                    rows = [count if r % 2 == 0 else count // 2 for r in range(size)]
                    y = cring.allgather(make(kind, values(dtype, rows[rank], rank, salt=2)))
                    ref = np.concatenate([values(dtype, rows[r], r, salt=2) for r in range(size)])
                    return compare(y, ref)

                def all_to_all():
                    # rank r sends (j + 1) * (count % 5 + 1) rows to rank j
                    unit = count % 5 + 1
                    sent = [values(dtype, (j + 1) * unit, rank, salt=3 + j) for j in range(size)]
                    out, splits = cring.alltoall(
                        make(kind, np.concatenate(sent)),
                        splits=[(j + 1) * unit for j in range(size)],
                    )
                    ref = np.concatenate(
                        [values(dtype, (rank + 1) * unit, r, salt=3 + rank) for r in range(size)]
                    )
                    got_splits = [int(s) for s in as_numpy(splits)]
                    if got_splits != [(rank + 1) * unit] * size:
                        return f"received splits {got_splits}"
                    return compare(out, ref)

                check(f"broadcast {tag}", bcast)
                check(f"allgather {tag}", gather)
                check(f"alltoall {tag}", all_to_all)

    result = {"rank": rank, "size": size, "cases": cases, "failures": failures}
    with open(f"{outdir}/rank{rank}.json", "w") as f:
        json.dump(result, f)
    cring.shutdown()
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()

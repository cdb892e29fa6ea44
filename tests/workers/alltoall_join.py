"""cring.alltoall and cring.join on NumPy arrays (no torch): rank r sends
(r + j) % 3 rows to rank j, some large enough to cross shared-memory window
halves; then uneven batches end in join(). Writes <out>/rank<R>.json."""

import json
import sys

import numpy as np

import cring

cring.init()
R, P = cring.rank(), cring.size()
problems = []


def block(src, dst, n, cols):
    rows = np.arange(n, dtype=np.float64)[:, None] * cols + np.arange(cols)
    return rows + src * 1e7 + dst * 1e6


for cols in (3, 50_000):  # 50 000 float64 columns: 400 kB per row
    splits = [(R + j) % 3 for j in range(P)]
    x = np.concatenate([block(R, j, splits[j], cols) for j in range(P)])
    out, received = cring.alltoall(x, splits=splits, name=f"a2a.{cols}")
    want = [(q + R) % 3 for q in range(P)]
    if received != want:
        problems.append(f"cols {cols}: received {received}, expected {want}")
    expected = np.concatenate([block(q, R, want[q], cols) for q in range(P)])
    if out.shape != expected.shape or not np.array_equal(out, expected):
        problems.append(f"cols {cols}: wrong alltoall output")

h = cring.alltoall_async(np.arange(P * 2, dtype=np.int8) + R, name="a2a.async")
out, received = cring.synchronize(h)
want = np.concatenate([np.arange(2 * R, 2 * R + 2, dtype=np.int8) + q for q in range(P)])
if received != [2] * P or out.dtype != np.int8 or not np.array_equal(out, want):
    problems.append(f"async alltoall: {out} {received}")

# uneven batches: rank r allreduces (Average) r + 1 times, then joins
seen = []
for _ in range(R + 1):
    seen.append(float(cring.allreduce(np.full(5, R + 1.0), name="grad")[0]))
last = cring.join()
expected = [sum(r + 1.0 for r in range(b, P)) / P for b in range(R + 1)]
if not np.allclose(seen, expected):
    problems.append(f"averages with joined ranks: {seen}, expected {expected}")
if last != P - 1:
    problems.append(f"join returned {last}, expected {P - 1}")
if cring.allreduce(np.ones(1), op=cring.Sum, name="after")[0] != P:
    problems.append("allreduce after join")

with open(f"{sys.argv[1]}/rank{R}.json", "w") as f:
    json.dump({"problems": problems, "last": last}, f)
cring.shutdown()

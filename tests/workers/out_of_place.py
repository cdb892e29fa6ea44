"""Worker: the out-of-place allreduce (cring.allreduce_async and
cring.torch.allreduce_async, queued in C for NumPy arrays and CPU torch
tensors; cring.allreduce, reduced in C and waited on by the caller): exact
results into new tensors with the inputs unchanged, in bursts that the
engine fuses (submitted in a different order on each rank), sizes on both
sides of shared memory's small/large forms, dtypes and ops, 0-d and empty
tensors, read-only inputs, unnamed calls, in-place and out-of-place calls in
one burst, dropped handles, and the Python route (scaling, compression)
next to it. Values are small integers, so every sum is exact in every
dtype. Writes <outdir>/rank<R>.json."""

import random
import sys

import numpy as np

import cring

from engine_common import Checks, compare

cring.init()
rank, size = cring.rank(), cring.size()
checks = Checks(sys.argv[1], rank, size)
checks.info["transport"] = cring.transport()


def rank_values(i, r, n, dtype):
    """Tensor i's input on rank r: small integers (exact in any dtype)."""
    return ((np.arange(n) + i + 3 * r) % 7).astype(dtype)


def expected(i, n, dtype, op):
    vals = np.stack([rank_values(i, r, n, dtype).astype(np.float64) for r in range(size)])
    out = {
        cring.Sum: vals.sum(0),
        cring.Max: vals.max(0),
        cring.Min: vals.min(0),
        cring.Average: vals.sum(0) / size,
    }[op]
    return out.astype(dtype)


def burst(n_tensors, n, dtype, op, order_seed, *, named=True, inplace_every=0):
    """n_tensors async allreduces submitted in a per-rank order, then synchronized."""
    ins = [rank_values(i, rank, n, dtype) for i in range(n_tensors)]
    keep = [x.copy() for x in ins]
    order = list(range(n_tensors))
    if named:
        random.Random(order_seed * 100 + rank).shuffle(order)
    handles = {}
    for i in order:
        name = f"oop.{n}.{np.dtype(dtype).name}.{i}" if named else None
        if inplace_every and i % inplace_every == 0:
            handles[i] = cring.allreduce_async_(ins[i], op=op, name=name)
        else:
            handles[i] = cring.allreduce_async(ins[i], op=op, name=name)
    for i in range(n_tensors):
        got = cring.synchronize(handles[i])
        in_place = inplace_every and i % inplace_every == 0
        if type(got) is not np.ndarray:
            return f"tensor {i}: a {type(got).__name__} back"
        if in_place != (got is ins[i]):
            return f"tensor {i}: in place {bool(in_place)} but result is input: {got is ins[i]}"
        problem = compare(got, expected(i, n, dtype, op))
        if problem:
            return f"tensor {i} ({n} x {np.dtype(dtype).name}): {problem}"
        if not in_place and (problem := compare(ins[i], keep[i])):
            return f"tensor {i}: input changed: {problem}"
    return None


avg_dtypes = (np.float32, np.float64)
for dtype in (np.float32, np.float64, np.int32, np.int64, np.float16, np.uint8):
    for op in (cring.Sum, cring.Max, cring.Min, cring.Average):
        if op == cring.Average and dtype not in avg_dtypes:
            continue
        for rep in range(2):  # the second pass runs from the response cache
            checks.check(
                f"burst 200 x 1024 {np.dtype(dtype).name} op {int(op)} pass {rep}",
                lambda: burst(200, 1024, dtype, op, rep),
            )
for n in (1, 7, 100_000, 1_000_003):  # odd sizes; the large ones past the small form
    checks.check(f"burst of {n} elements", lambda: burst(6, n, np.float32, cring.Sum, 1))
checks.check(
    "500 x 4 KiB, in place every third", lambda: burst(500, 1024, np.float32, 1, 2, inplace_every=3)
)
for rep in range(3):  # unnamed calls: the same order on every rank
    checks.check(
        f"unnamed burst {rep}", lambda: burst(80, 256, np.float32, cring.Sum, 0, named=False)
    )


def shapes():
    for shape, name in (((), "scalar"), ((0,), "empty"), ((3, 4, 5), "3d")):
        x = np.full(shape, rank + 1, np.int64)
        got = cring.synchronize(cring.allreduce_async(x, op=cring.Sum, name=f"shape.{name}"))
        want = np.full(shape, size * (size + 1) // 2, np.int64)
        problem = compare(got, want)
        if got is x or problem:
            return f"{name}: {got!r} is input {got is x}: {problem}"
    return None


checks.check("0-d, empty and 3-d", shapes)


def read_only():
    x = np.full(64, float(rank), np.float32)
    x.setflags(write=False)
    got = cring.synchronize(cring.allreduce_async(x, op=cring.Sum, name="ro"))
    return compare(got, np.full(64, float(sum(range(size))), np.float32))


checks.check("read-only input", read_only)


def python_route():
    x = np.full(16, float(rank + 1), np.float32)
    want = np.full(16, 2.0 * sum(range(1, size + 1)) * 0.5, np.float32)
    h = cring.allreduce_async(
        x, op=cring.Sum, name="scaled", prescale_factor=2.0, postscale_factor=0.5
    )
    problem = compare(cring.synchronize(h), want)
    if problem:
        return f"scaled: {problem}"
    h = cring.allreduce_async(x, cring.Sum, "compressed", cring.Compression.fp16)
    return compare(cring.synchronize(h), np.full(16, float(sum(range(1, size + 1))), np.float32))


checks.check("scaling and compression (the Python route)", python_route)


def dropped_and_polled():
    for k in range(20):  # dropped handles: the engine keeps both tensors alive
        cring.allreduce_async(np.full(512, float(k), np.float32), name=f"dropped.{k}")
    h = cring.allreduce_async(np.full(8, float(rank), np.float32), op=cring.Max, name="polled")
    while not cring.poll(h):
        pass
    return compare(cring.synchronize(h), np.full(8, float(size - 1), np.float32))


checks.check("dropped and polled handles", dropped_and_polled)


def errors():
    try:
        cring.allreduce_async(np.ones(4, np.float32), op=99, name="badop")
    except ValueError as e:
        if "op" not in str(e):
            return f"bad op: {e}"
    else:
        return "an unknown op did not raise"
    x = np.ones(4 + rank, np.float32)  # a different shape on each rank
    try:
        cring.synchronize(cring.allreduce_async(x, name="shape.mismatch"))
    except cring.MismatchError as e:
        if "shape.mismatch" not in str(e):
            return f"mismatch error does not name the tensor: {e}"
    else:
        return "a shape mismatch did not raise"
    return None


if size > 1:
    checks.check("errors", errors)


def sync_calls(n, dtype, op, named):
    """cring.allreduce (synchronous, out of place; issue 35: reduced in C for
    NumPy arrays, the caller waiting as allreduce_ does) on tensors 0..4."""
    for i in range(5):
        x = rank_values(i, rank, n, dtype)
        keep = x.copy()
        name = f"sync.{n}.{np.dtype(dtype).name}.{int(op)}.{i}" if named else None
        got = cring.allreduce(x, op=op, name=name)
        if type(got) is not np.ndarray or got is x or got.dtype != x.dtype:
            return f"tensor {i}: {type(got).__name__} {getattr(got, 'dtype', None)}, input back"
        problem = compare(got, expected(i, n, dtype, op)) or compare(x, keep)
        if problem:
            return f"tensor {i} ({n} x {np.dtype(dtype).name}): {problem}"
    return None


# 1 and 7 elements (odd), 4 KiB (rides the negotiation round), 64 KiB,
# and sizes past shared memory's small form and its rounds
for n in (1, 7, 1024, 16384, 100_003, 1_000_003):
    checks.check(f"sync {n} float32 sum", lambda: sync_calls(n, np.float32, cring.Sum, True))
for dtype in (np.float64, np.int32, np.int64, np.float16, np.uint8):
    for op in (cring.Sum, cring.Max, cring.Min):
        checks.check(
            f"sync 1000 {np.dtype(dtype).name} op {int(op)}",
            lambda: sync_calls(1000, dtype, op, True),
        )
checks.check("sync Average float64", lambda: sync_calls(333, np.float64, cring.Average, True))
checks.check("sync unnamed", lambda: sync_calls(256, np.float32, cring.Sum, False))


def sync_forms():
    got = cring.allreduce(np.full(8, float(rank + 1), np.float32), name="sync.default")
    if (problem := compare(got, np.full(8, (size + 1) / 2, np.float32))) is not None:
        return f"default op (Average): {problem}"
    for shape, label in (((), "scalar"), ((0,), "empty"), ((3, 4, 5), "3d")):
        x = np.full(shape, rank + 1, np.int64)
        got = cring.allreduce(x, op=cring.Sum, name=f"sync.shape.{label}")
        problem = compare(got, np.full(shape, size * (size + 1) // 2, np.int64))
        if got is x or got.shape != shape or problem:
            return f"{label}: {got!r}: {problem}"
    x = np.full(64, float(rank), np.float32)
    x.setflags(write=False)
    problem = compare(
        cring.allreduce(x, op=cring.Sum, name="sync.ro"),
        np.full(64, 1.0 * sum(range(size)), np.float32),
    )
    if problem:
        return f"read-only input: {problem}"
    strided = np.arange(20, dtype=np.float32)[::2] + rank  # the Python route copies it
    got = cring.allreduce(strided, op=cring.Sum, name="sync.strided")
    if problem := compare(got, size * np.arange(0, 20, 2, dtype=np.float32) + sum(range(size))):
        return f"strided input: {problem}"
    got = cring.allreduce(
        np.full(4, 1.0, np.float32), op=cring.Sum, name="sync.scaled", prescale_factor=2.0
    )
    if (problem := compare(got, np.full(4, 2.0 * size, np.float32))) is not None:
        return f"prescale (the Python route): {problem}"
    return None


checks.check("sync: default op, 0-d, empty, 3-d, read-only, strided, scaled", sync_forms)


def sync_errors():
    try:
        cring.allreduce(np.ones(4, np.float32), op=99, name="sync.badop")
    except ValueError as e:
        if "op" not in str(e):
            return f"bad op: {e}"
    else:
        return "an unknown op did not raise"
    try:
        cring.allreduce(np.ones(4 + rank, np.float32), name="sync.mismatch")
    except cring.MismatchError as e:
        if "sync.mismatch" not in str(e):
            return f"mismatch error does not name the tensor: {e}"
    else:
        return "a shape mismatch did not raise"
    try:
        cring.allreduce([1.0, 2.0], name="sync.list")
    except (TypeError, ValueError) as e:
        if not str(e):
            return "a list input raised an empty error"
    else:
        return "a list input did not raise"
    return None


if size > 1:
    checks.check("sync errors", sync_errors)

try:
    import torch
except ImportError:
    torch = None

if torch is not None:
    import cring.torch as hvd

    def torch_burst(fn, dtype, tag):
        ins = [torch.full((1024,), float((i + rank) % 5), dtype=dtype) for i in range(300)]
        keep = [t.clone() for t in ins]
        order = list(range(300))
        random.Random(rank).shuffle(order)
        handles = {i: fn(ins[i], op=cring.Sum, name=f"{tag}.{i}") for i in order}
        for i in range(300):
            got = hvd.synchronize(handles[i])
            want = float(sum((i + r) % 5 for r in range(size)))
            if not isinstance(got, torch.Tensor) or got is ins[i] or got.dtype != dtype:
                return f"tensor {i}: {type(got).__name__} {getattr(got, 'dtype', None)}"
            if not torch.equal(got, torch.full((1024,), want, dtype=dtype)):
                return f"tensor {i}: {got[:4]} != {want}"
            if not torch.equal(ins[i], keep[i]):
                return f"tensor {i}: input changed"
        return None

    for dtype in (torch.float32, torch.float64, torch.int64, torch.bfloat16):
        for rep in range(2):
            checks.check(
                f"cring.allreduce_async torch {dtype} pass {rep}",
                lambda: torch_burst(cring.allreduce_async, dtype, f"ct.{dtype}"),
            )
            checks.check(
                f"hvd.allreduce_async torch {dtype} pass {rep}",
                lambda: torch_burst(hvd.allreduce_async, dtype, f"ht.{dtype}"),
            )

    def torch_forms():
        w = torch.full((3, 2), float(rank + 1), requires_grad=True)  # read through a detached view
        got = hvd.synchronize(hvd.allreduce_async(w, name="grad.w"))  # Average
        if got.requires_grad or not torch.equal(got, torch.full((3, 2), (size + 1) / 2)):
            return f"requires_grad input: {got}"
        p = torch.nn.Parameter(torch.full((4,), float(rank)))
        got = hvd.synchronize(hvd.allreduce_async(p, op=hvd.Sum, name="param"))
        if type(got) is not torch.Tensor or not torch.equal(
            got, torch.full((4,), 1.0 * sum(range(size)))
        ):
            return f"Parameter input: {type(got).__name__} {got}"
        s = torch.tensor(float(rank))
        got = hvd.synchronize(
            hvd.allreduce_async(s, op=hvd.Sum, name="t.scalar", process_set=hvd.global_process_set)
        )
        if got.shape != () or got.item() != sum(range(size)):
            return f"0-d: {got}"
        with pytest_warns_deprecation():  # average= goes to the Python function
            got = hvd.synchronize(hvd.allreduce_async(torch.ones(2), average=False, name="avg"))
        if got.tolist() != [float(size)] * 2:
            return f"average=False: {got}"
        got = hvd.synchronize(
            hvd.allreduce_async(torch.ones(2), name="scaled.t", prescale_factor=3.0)
        )
        if got.tolist() != [3.0, 3.0]:
            return f"prescale: {got}"
        return None

    import contextlib
    import warnings

    @contextlib.contextmanager
    def pytest_warns_deprecation():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            yield

    checks.check("torch inputs: requires_grad, Parameter, 0-d, average=, scaling", torch_forms)

    def torch_sync():
        for dtype in (torch.float32, torch.int64, torch.bfloat16):
            x = torch.full((1000,), float(rank + 1), dtype=dtype)
            got = cring.allreduce(x, op=cring.Sum, name=f"sync.t.{dtype}")
            want = torch.full((1000,), float(size * (size + 1) // 2), dtype=dtype)
            if type(got) is not torch.Tensor or got is x or not torch.equal(got, want):
                return f"{dtype}: {type(got).__name__} {got[:4] if hasattr(got, 'shape') else got}"
            if not torch.equal(x, torch.full((1000,), float(rank + 1), dtype=dtype)):
                return f"{dtype}: input changed"
        w = torch.full((3,), float(rank + 1), requires_grad=True)
        got = cring.allreduce(w, op=cring.Sum, name="sync.t.grad")
        if got.requires_grad or got.tolist() != [float(size * (size + 1) // 2)] * 3:
            return f"requires_grad input: {got}"
        return None

    checks.check("cring.allreduce on torch tensors", torch_sync)

cring.shutdown()
checks.finish()

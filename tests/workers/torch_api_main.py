"""Worker: the horovod.torch API of cring.torch on real ranks, called the way
a Horovod script calls it (`import cring.torch as hvd`).

Every rank makes its inputs from its rank with a seeded generator, so every
rank can rebuild every other rank's input and check results against NumPy
references computed in float64. Covers: basics and introspection; allreduce
in all four forms over dtypes x ops, average=, scale factors, compression;
grouped allreduce; allgather (uneven, 0-d, bool) and grouped allgather;
broadcast in all four forms; reducescatter and grouped reducescatter;
barrier; broadcast_object / allgather_object; gradients through allreduce,
grouped allreduce, allgather, grouped allgather, broadcast, reducescatter and
grouped reducescatter against analytic values; and errors (mismatch on all
ranks, duplicate in-flight names, root out of range, unsupported dtypes,
average with op, process sets, alltoall splits, Adasum).

Usage: torch_api_main.py OUTDIR. Writes OUTDIR/rank<R>.json; exits 1 on a failure.
"""

import os
import sys
import warnings

import numpy as np
import torch

import cring
import cring.torch as hvd

from engine_common import Checks

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
checks = Checks(sys.argv[1], RANK, SIZE)

FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
TOL = {torch.float16: 2e-3, torch.bfloat16: 2e-2}


def data(r, shape, dtype, kind="normal"):
    """Rank r's input: the same on every rank that asks for it."""
    g = torch.Generator().manual_seed(1000 + 17 * r + len(shape))
    if dtype.is_floating_point:
        if kind == "near1":  # for products: values near 1
            x = 1 + 0.1 * torch.randn(shape, generator=g, dtype=torch.float64)
        else:
            x = torch.randn(shape, generator=g, dtype=torch.float64)
        return x.to(dtype)
    low, high = (-3, 4) if kind == "near1" else (-50, 51)
    return torch.randint(low, high, shape, generator=g, dtype=dtype)


def all_inputs(shape, dtype, kind="normal"):
    return np.stack([data(r, shape, dtype, kind).double().numpy() for r in range(SIZE)])


def reference(stack, op, dtype):
    """What an allreduce with `op` of every rank's input gives (float64 NumPy)."""
    if op == hvd.Sum:
        out = stack.sum(0)
    elif op == hvd.Average:
        out = stack.sum(0) / SIZE
        if not dtype.is_floating_point:
            out = np.trunc(out)  # cring's integer Average divides toward zero
    elif op == hvd.Min:
        out = stack.min(0)
    elif op == hvd.Max:
        out = stack.max(0)
    else:
        out = stack.prod(0)
    return out


def close(got, ref, dtype=None, rtol=None, what=""):
    """None when the torch tensor `got` matches the float64 reference `ref`."""
    if not isinstance(got, torch.Tensor):
        return f"{what}: got a {type(got).__name__}, not a torch.Tensor"
    if tuple(got.shape) != tuple(np.shape(ref)):
        return f"{what}: shape {tuple(got.shape)} != {tuple(np.shape(ref))}"
    if dtype is not None and got.dtype != dtype:
        return f"{what}: dtype {got.dtype} != {dtype}"
    g = got.detach().double().numpy()
    tol = (
        rtol
        if rtol is not None
        else TOL.get(got.dtype, 1e-12 if got.dtype == torch.float64 else 1e-5)
    )
    if got.dtype.is_floating_point:
        ok = np.allclose(g, ref, rtol=tol, atol=tol)
    else:
        ok = np.array_equal(g, ref)
    if ok:
        return None
    i = int(np.flatnonzero(~np.isclose(g, ref, rtol=tol, atol=tol).ravel())[0])
    return f"{what}: element {i} is {g.ravel()[i]!r}, expected {np.ravel(ref)[i]!r}"


def collect(*problems):
    return "; ".join(p for p in problems if p) or None


def raises(exc_type, fn, match=None, not_type=None):
    """None when fn() raises exc_type (with `match` in the message and not
    an instance of not_type), else what happened."""
    try:
        fn()
    except exc_type as e:
        if not_type is not None and isinstance(e, not_type):
            return f"raised {type(e).__name__} ({not_type.__name__}): {e}"
        if match and match not in str(e):
            return f"{type(e).__name__} message {str(e)!r} lacks {match!r}"
        return None
    except Exception as e:  # noqa: BLE001
        return f"raised {type(e).__name__}: {e} instead of {exc_type.__name__}"
    return f"did not raise {exc_type.__name__}"


# ---- basics -----------------------------------------------------------------------------------


def basics():
    env_rank, env_size = int(os.environ["CRING_RANK"]), int(os.environ["CRING_SIZE"])
    facts = {
        "is_initialized": hvd.is_initialized() is True,
        "rank": RANK == env_rank,
        "size": SIZE == env_size,
        "local_rank": hvd.local_rank() == RANK,
        "local_size": hvd.local_size() == SIZE,
        "cross_rank": hvd.cross_rank() == 0,
        "cross_size": hvd.cross_size() == 1,
        "built": [
            f()
            for f in (
                hvd.mpi_built,
                hvd.mpi_enabled,
                hvd.gloo_built,
                hvd.gloo_enabled,
                hvd.ddl_built,
                hvd.ccl_built,
                hvd.rocm_built,
                hvd.mpi_threads_supported,
            )
        ]
        == [False] * 8
        and hvd.cring_built() is True
        and hvd.nccl_built() == cring.nccl_available(),
        "global_process_set": hvd.global_process_set.size() == SIZE
        and hvd.global_process_set.rank() == RANK
        and hvd.global_process_set.ranks == list(range(SIZE)),
    }
    hvd.init()  # a second init while initialised does nothing
    return ", ".join(k for k, ok in facts.items() if not ok) or None


checks.check("basics and introspection", basics)

# ---- allreduce --------------------------------------------------------------------------------


def allreduce_ops_dtypes():
    problems = []
    shape = (3, 337)
    for dtype in (
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int32,
        torch.int64,
        torch.int8,
        torch.uint8,
    ):
        for op in (hvd.Average, hvd.Sum, hvd.Min, hvd.Max, hvd.Product):
            small = op == hvd.Product or dtype in (torch.int8, torch.uint8)
            kind = "near1" if small else "normal"
            if dtype == torch.uint8:
                x = data(RANK, shape, torch.int64, "near1").abs().to(torch.uint8)
                stack = np.stack(
                    [
                        data(r, shape, torch.int64, "near1").abs().double().numpy()
                        for r in range(SIZE)
                    ]
                )
            else:
                x = data(RANK, shape, dtype, kind)
                stack = all_inputs(shape, dtype, kind)
            before = x.clone()
            out = hvd.allreduce(x, op=op, name=f"ar.{dtype}.{op.name}")
            ref = reference(stack, op, dtype)
            if dtype.is_floating_point:
                ref = torch.from_numpy(ref).to(dtype).double().numpy()  # rounded once
            problems.append(
                close(
                    out,
                    ref,
                    dtype,
                    rtol=TOL.get(dtype, 1e-5) * (4 if op == hvd.Product else 1),
                    what=f"{dtype} {op.name}",
                )
            )
            if not torch.equal(x, before) or out.data_ptr() == x.data_ptr():
                problems.append(f"{dtype} {op.name}: the input changed or was reused")
    return collect(*problems)


checks.check("allreduce over dtypes x ops", allreduce_ops_dtypes)


def allreduce_average_argument():
    x = data(RANK, (101,), torch.float64)
    stack = all_inputs((101,), torch.float64)
    problems = [close(hvd.allreduce(x), stack.mean(0), what="default op is Average")]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        problems.append(close(hvd.allreduce(x, average=True), stack.mean(0), what="average=True"))
        problems.append(close(hvd.allreduce(x, average=False), stack.sum(0), what="average=False"))
        problems.append(
            close(
                hvd.allreduce_(x.clone(), average=False),
                stack.sum(0),
                what="allreduce_ average=False",
            )
        )
    if sum(issubclass(w.category, DeprecationWarning) for w in caught) != 3:
        problems.append(f"expected 3 DeprecationWarnings, got {[str(w.message) for w in caught]}")
    for fn in (hvd.allreduce, hvd.allreduce_, hvd.allreduce_async, hvd.allreduce_async_):
        problems.append(
            raises(
                ValueError,
                lambda fn=fn: fn(x, average=True, op=hvd.Sum),
                match="supersedes average",
            )
        )
    problems.append(
        raises(ValueError, lambda: hvd.grouped_allreduce([x], average=False, op=hvd.Sum))
    )
    return collect(*problems)


checks.check("allreduce average= (deprecated) and op=", allreduce_average_argument)


def allreduce_scale_factors():
    x = data(RANK, (64,), torch.float64)
    stack = all_inputs((64,), torch.float64)
    out = hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0)
    inplace = hvd.allreduce_(x.clone(), op=hvd.Average, prescale_factor=2.0)
    handle = hvd.allreduce_async(x, op=hvd.Sum, postscale_factor=0.25, name="scaled.async")
    return collect(
        close(out, 1.5 * stack.sum(0), what="Sum x0.5 x3"),
        close(inplace, 2.0 * stack.mean(0), what="allreduce_ Average x2"),
        close(hvd.synchronize(handle), 0.25 * stack.sum(0), what="async x0.25"),
    )


checks.check("allreduce prescale/postscale", allreduce_scale_factors)


class ScaleCompressor(hvd.Compressor):
    """A user's Horovod-style compressor: doubles before, halves after."""

    calls = []

    @staticmethod
    def compress(tensor):
        ScaleCompressor.calls.append("compress")
        return tensor * 2, "ctx"

    @staticmethod
    def decompress(tensor, ctx):
        ScaleCompressor.calls.append(f"decompress:{ctx}")
        return tensor / 2


def allreduce_compression():
    problems = []
    x32 = data(RANK, (1000,), torch.float32)
    ref32 = all_inputs((1000,), torch.float32).mean(0)
    for comp, rtol in (
        (hvd.Compression.fp16, 2e-3),
        (hvd.Compression.bf16, 2e-2),
        (cring.Compression.fp16, 2e-3),
    ):
        problems.append(
            close(
                hvd.allreduce(x32, compression=comp),
                ref32,
                torch.float32,
                rtol=rtol,
                what=f"float32 with {comp}",
            )
        )
    # float64 is cast in Python as in Horovod (cring's wire compression is float32-only)
    x64 = data(RANK, (1000,), torch.float64)
    out64 = hvd.allreduce(x64, op=hvd.Sum, compression=hvd.Compression.fp16)
    problems.append(
        close(
            out64,
            all_inputs((1000,), torch.float64).sum(0),
            torch.float64,
            rtol=5e-3,
            what="float64 with fp16",
        )
    )
    xi = data(RANK, (50,), torch.int32)
    problems.append(
        close(
            hvd.allreduce(xi, op=hvd.Sum, compression=hvd.Compression.fp16),
            all_inputs((50,), torch.int32).sum(0),
            torch.int32,
            what="int32 fp16",
        )
    )
    ScaleCompressor.calls.clear()
    out = hvd.allreduce(x64, op=hvd.Sum, compression=ScaleCompressor)
    problems.append(close(out, all_inputs((1000,), torch.float64).sum(0), what="custom"))
    if ScaleCompressor.calls != ["compress", "decompress:ctx"]:
        problems.append(f"custom compressor calls {ScaleCompressor.calls}")
    grouped = hvd.grouped_allreduce([x32, x64], compression=hvd.Compression.fp16)
    problems.append(close(grouped[0], ref32, torch.float32, rtol=2e-3, what="grouped f32"))
    problems.append(
        close(
            grouped[1],
            all_inputs((1000,), torch.float64).mean(0),
            torch.float64,
            rtol=2e-3,
            what="grouped f64",
        )
    )
    return collect(*problems)


checks.check("allreduce compression", allreduce_compression)


def allreduce_in_place_and_async():
    problems = []
    stack = all_inputs((4097,), torch.float32)
    x = data(RANK, (4097,), torch.float32)
    ptr = x.data_ptr()
    y = hvd.allreduce_(x, op=hvd.Sum, name="inplace")
    if y is not x or x.data_ptr() != ptr:
        problems.append("allreduce_ did not return the same tensor and storage")
    problems.append(close(x, stack.sum(0), what="allreduce_"))
    x = data(RANK, (4097,), torch.float32)
    h = hvd.allreduce_async(x, op=hvd.Max, name="async.max")
    h_ = hvd.allreduce_async_(x.clone(), name="async.avg")
    out, out_ = hvd.synchronize(h), hvd.synchronize(h_)
    if not (hvd.poll(h) and hvd.poll(h_)):
        problems.append("poll() is False after synchronize")
    problems.append(close(out, stack.max(0), what="allreduce_async Max"))
    problems.append(close(out_, stack.mean(0), what="allreduce_async_ Average"))
    if not torch.equal(x, data(RANK, (4097,), torch.float32)):
        problems.append("allreduce_async changed its input")
    return collect(*problems)


checks.check("allreduce_, allreduce_async, allreduce_async_, poll", allreduce_in_place_and_async)


def grouped_allreduce_forms():
    problems = []
    specs = [((5,), torch.float64), ((2, 3), torch.float64), ((7,), torch.float64)]
    refs_sum = [all_inputs(s, d).sum(0) for s, d in specs]
    refs_avg = [reference(all_inputs(s, d), hvd.Average, d) for s, d in specs]
    fresh = lambda: [data(RANK, s, d) for s, d in specs]  # noqa: E731
    out = hvd.grouped_allreduce(fresh(), op=hvd.Sum, name="grouped")
    problems += [
        close(o, r, what=f"grouped_allreduce {i}") for i, (o, r) in enumerate(zip(out, refs_sum))
    ]
    ts = fresh()
    res = hvd.grouped_allreduce_(ts)
    if any(a is not b for a, b in zip(res, ts)):
        problems.append("grouped_allreduce_ did not return the same tensors")
    problems += [
        close(o, r, what=f"grouped_allreduce_ {i}") for i, (o, r) in enumerate(zip(ts, refs_avg))
    ]
    h = hvd.grouped_allreduce_async(fresh(), op=hvd.Sum, prescale_factor=2.0)
    problems += [
        close(o, 2 * r, what=f"grouped_allreduce_async {i}")
        for i, (o, r) in enumerate(zip(hvd.synchronize(h), refs_sum))
    ]
    ts = fresh()
    h = hvd.grouped_allreduce_async_(ts, average=False)
    res = hvd.synchronize(h)
    problems += [
        close(o, r, what=f"grouped_allreduce_async_ {i}")
        for i, (o, r) in enumerate(zip(ts, refs_sum))
    ]
    if any(a is not b for a, b in zip(res, ts)):
        problems.append("grouped_allreduce_async_ did not return the same tensors")
    return collect(*problems)


with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    checks.check("grouped_allreduce in all four forms", grouped_allreduce_forms)


def grouped_allreduce_mixed_dtypes():
    """A group whose tensors differ in dtype: each is reduced in its own
    dtype (the engine once staged them all in the first tensor's). Recorded
    here; test_torch_api.py's test_grouped_allreduce_with_mixed_dtypes
    requires no problem on any rank."""
    specs = [((4,), torch.int32), ((3,), torch.float64), ((2,), torch.float32)]
    out = hvd.grouped_allreduce([data(RANK, s, d) for s, d in specs], op=hvd.Sum)
    return collect(
        *(close(o, all_inputs(s, d).sum(0), d, what=f"{d}") for o, (s, d) in zip(out, specs))
    )


checks.info["mixed_dtype_group_problem"] = grouped_allreduce_mixed_dtypes()

# ---- allgather --------------------------------------------------------------------------------


def rows_of(r):
    return np.full((r + 1, 3), r, dtype=np.float64) + np.arange(3)


def allgather_forms():
    problems = []
    ref = np.concatenate([rows_of(r) for r in range(SIZE)])
    x = torch.from_numpy(rows_of(RANK)).float()
    problems.append(close(hvd.allgather(x, name="ag"), ref, torch.float32, what="allgather"))
    problems.append(
        close(
            hvd.synchronize(hvd.allgather_async(x.double())),
            ref,
            torch.float64,
            what="allgather_async",
        )
    )
    scalar = torch.tensor(RANK * 10, dtype=torch.int64)
    problems.append(
        close(hvd.allgather(scalar), np.arange(SIZE) * 10.0, torch.int64, what="0-d allgather")
    )
    mask = torch.tensor([RANK % 2 == 0, True])
    gathered = hvd.allgather(mask)
    if gathered.tolist() != [v for r in range(SIZE) for v in (r % 2 == 0, True)]:
        problems.append(f"bool allgather gave {gathered.tolist()}")
    # rank 0 contributes no rows to the second tensor
    a = torch.from_numpy(rows_of(RANK)).float()
    b = torch.arange(2 * RANK, dtype=torch.int64) + 100 * RANK
    ref_b = np.concatenate([np.arange(2 * r) + 100 * r for r in range(SIZE)]).astype(np.float64)
    out = hvd.grouped_allgather([a, b], name="gag")
    problems.append(close(out[0], ref, torch.float32, what="grouped_allgather a"))
    problems.append(close(out[1], ref_b, torch.int64, what="grouped_allgather b"))
    out = hvd.synchronize(hvd.grouped_allgather_async([b, a]))
    problems.append(close(out[0], ref_b, torch.int64, what="grouped_allgather_async b"))
    problems.append(close(out[1], ref, torch.float32, what="grouped_allgather_async a"))
    return collect(*problems)


checks.check("allgather, allgather_async, grouped_allgather(_async)", allgather_forms)

# ---- broadcast --------------------------------------------------------------------------------


def broadcast_forms():
    problems = []
    root = SIZE - 1
    shape = (3, 41)
    ref = data(root, shape, torch.float32).double().numpy()
    x = data(RANK, shape, torch.float32)
    out = hvd.broadcast(x, root_rank=root, name="bc")
    problems.append(close(out, ref, torch.float32, what="broadcast"))
    if not torch.equal(x, data(RANK, shape, torch.float32)):
        problems.append("broadcast changed its input")
    y = data(RANK, shape, torch.float32)
    if hvd.broadcast_(y, root) is not y:
        problems.append("broadcast_ did not return its argument")
    problems.append(close(y, ref, what="broadcast_"))
    problems.append(
        close(
            hvd.synchronize(hvd.broadcast_async(x, 0)),
            data(0, shape, torch.float32).double().numpy(),
            what="broadcast_async",
        )
    )
    z = data(RANK, shape, torch.float32)
    h = hvd.broadcast_async_(z, root_rank=root)
    if hvd.synchronize(h) is not z:
        problems.append("broadcast_async_ did not give back its argument")
    problems.append(close(z, ref, what="broadcast_async_"))
    flags = hvd.broadcast(torch.tensor([RANK == root, RANK != root]), root)
    if flags.tolist() != [True, False]:
        problems.append(f"bool broadcast gave {flags.tolist()}")
    return collect(*problems)


checks.check("broadcast in all four forms", broadcast_forms)

# ---- reducescatter ----------------------------------------------------------------------------


def my_rows(n):
    start = sum(n // SIZE + (1 if r < n % SIZE else 0) for r in range(RANK))
    return slice(start, start + n // SIZE + (1 if RANK < n % SIZE else 0))


def reducescatter_forms():
    problems = []
    n = 2 * SIZE + 1
    stack = all_inputs((n, 2), torch.float64)
    x = data(RANK, (n, 2), torch.float64)
    problems.append(
        close(
            hvd.reducescatter(x, op=hvd.Sum, name="rs"),
            stack.sum(0)[my_rows(n)],
            what="reducescatter Sum",
        )
    )
    problems.append(
        close(hvd.reducescatter(x), stack.mean(0)[my_rows(n)], what="reducescatter default Average")
    )
    problems.append(
        close(
            hvd.reducescatter(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5),
            stack.sum(0)[my_rows(n)],
            what="reducescatter scaled",
        )
    )
    problems.append(
        close(
            hvd.reducescatter(x.float(), op=hvd.Sum, compression=hvd.Compression.fp16),
            stack.sum(0)[my_rows(n)],
            torch.float32,
            rtol=5e-3,
            what="reducescatter fp16",
        )
    )
    problems.append(
        close(
            hvd.synchronize(hvd.reducescatter_async(x, op=hvd.Max)),
            stack.max(0)[my_rows(n)],
            what="reducescatter_async Max",
        )
    )
    v = data(RANK, (SIZE + 2,), torch.int32)
    vstack = all_inputs((SIZE + 2,), torch.int32)
    out = hvd.grouped_reducescatter([x, v], op=hvd.Sum)
    problems.append(close(out[0], stack.sum(0)[my_rows(n)], what="grouped_reducescatter x"))
    problems.append(
        close(out[1], vstack.sum(0)[my_rows(SIZE + 2)], torch.int32, what="grouped_reducescatter v")
    )
    out = hvd.synchronize(hvd.grouped_reducescatter_async([x, v], op=hvd.Sum))
    problems.append(
        close(
            out[1],
            vstack.sum(0)[my_rows(SIZE + 2)],
            torch.int32,
            what="grouped_reducescatter_async v",
        )
    )
    return collect(*problems)


checks.check("reducescatter and grouped_reducescatter", reducescatter_forms)


def barrier_and_objects():
    problems = []
    hvd.barrier()
    root = SIZE - 1
    obj = (
        {"config": [1, 2.5, "three"], "from": RANK, "fn": lambda v: v + RANK}
        if RANK == root
        else None
    )
    got = hvd.broadcast_object(obj, root_rank=root)
    if not (
        isinstance(got, dict)
        and got["from"] == root
        and got["config"] == [1, 2.5, "three"]
        and got["fn"](1) == 1 + root
    ):
        problems.append(f"broadcast_object gave {got!r}")
    big = bytes(range(256)) * 4096 if RANK == 0 else b""
    if hvd.broadcast_object(big, name="big") != bytes(range(256)) * 4096:
        problems.append("broadcast_object of 1 MiB differs")
    mine = {"rank": RANK, "pad": "x" * (RANK * 1000)}
    gathered = hvd.allgather_object(mine)
    if gathered != [{"rank": r, "pad": "x" * (r * 1000)} for r in range(SIZE)]:
        problems.append(f"allgather_object gave {[g.get('rank') for g in gathered]}")
    if hvd.allgather_object(RANK * 2, name="ints") != [r * 2 for r in range(SIZE)]:
        problems.append("named allgather_object differs")
    return collect(*problems)


checks.check("barrier, broadcast_object, allgather_object", barrier_and_objects)

# ---- gradients --------------------------------------------------------------------------------

MEAN_W = (SIZE + 1) / 2  # the average of the per-rank weights r + 1


def grad_allreduce():
    problems = []
    for op, pre, post, comp in (
        (hvd.Average, 1.0, 1.0, hvd.Compression.none),
        (hvd.Sum, 2.0, 0.5, hvd.Compression.none),
        (hvd.Sum, 1.0, 3.0, hvd.Compression.none),
        (hvd.Average, 1.0, 1.0, hvd.Compression.fp16),
    ):
        x = torch.full((6,), float(RANK + 1), requires_grad=True)
        y = hvd.allreduce(x, op=op, prescale_factor=pre, postscale_factor=post, compression=comp)
        if y.grad_fn is None:
            problems.append(f"{op.name}: allreduce output has no grad_fn")
            continue
        (y * (RANK + 1)).sum().backward()
        total = sum(range(1, SIZE + 1))
        value = total / SIZE if op == hvd.Average else total
        problems.append(close(y, np.full(6, value * pre * post), what=f"{op.name} forward"))
        problems.append(
            close(
                x.grad,
                np.full(6, (MEAN_W if op == hvd.Average else total) * pre * post),
                rtol=2e-3,
                what=f"{op.name} x{pre} x{post} {comp.__name__} grad",
            )
        )
    # an expanded incoming gradient (sum() of the output) is fine, and no_grad gives no graph
    x = torch.ones(3, 4, requires_grad=True)
    hvd.allreduce(x, op=hvd.Sum).sum().backward()
    problems.append(close(x.grad, np.full((3, 4), float(SIZE)), what="expanded grad"))
    with torch.no_grad():
        if hvd.allreduce(x).requires_grad:
            problems.append("allreduce under no_grad requires grad")
    return collect(*problems)


checks.check("gradient of allreduce", grad_allreduce)


def grad_grouped_allreduce():
    a = torch.full((3,), 1.0 + RANK, requires_grad=True)
    b = torch.full((2, 2), -1.0, requires_grad=True)
    ya, yb = hvd.grouped_allreduce([a, b])  # Average
    ((ya * (RANK + 1)).sum() + (yb * 2 * (RANK + 1)).sum()).backward()
    problems = [
        close(a.grad, np.full(3, MEAN_W), what="Average grad a"),
        close(b.grad, np.full((2, 2), 2 * MEAN_W), what="Average grad b"),
    ]
    a.grad = b.grad = None
    ya, yb = hvd.grouped_allreduce([a, b], op=hvd.Sum, name="gsum")
    (ya.sum() + yb.sum() * (RANK + 1)).backward()
    problems += [
        close(a.grad, np.full(3, float(SIZE)), what="Sum grad a"),
        close(b.grad, np.full((2, 2), float(sum(range(1, SIZE + 1)))), what="Sum grad b"),
    ]
    return collect(*problems)


checks.check("gradient of grouped_allreduce", grad_grouped_allreduce)


def weights(r, shape):
    return (r + 1) * (torch.arange(int(np.prod(shape)), dtype=torch.float64) + 1).reshape(shape)


def grad_allgather():
    problems = []
    rows = [r + 1 for r in range(SIZE)]
    total = sum(rows)
    offset = sum(rows[:RANK])
    x = torch.from_numpy(rows_of(RANK)).requires_grad_()
    y = hvd.allgather(x)
    (y * weights(RANK, (total, 3))).sum().backward()
    # Horovod's gradient: the incoming gradient averaged over ranks, this rank's rows
    expected = (MEAN_W * (torch.arange(total * 3, dtype=torch.float64) + 1)).reshape(total, 3)
    problems.append(
        close(x.grad, expected[offset : offset + rows[RANK]].numpy(), what="allgather grad")
    )
    s = torch.tensor(float(RANK), dtype=torch.float64, requires_grad=True)
    (hvd.allgather(s) * weights(RANK, (SIZE,))).sum().backward()
    problems.append(close(s.grad, np.array(MEAN_W * (RANK + 1)), what="0-d allgather grad"))
    a = torch.from_numpy(rows_of(RANK)).requires_grad_()
    b = torch.ones(2 * RANK, dtype=torch.float64, requires_grad=True)  # rank 0: no rows
    ga, gb = hvd.grouped_allgather([a, b])
    n_b = sum(2 * r for r in range(SIZE))
    ((ga * weights(RANK, (total, 3))).sum() + (gb * weights(RANK, (n_b,))).sum()).backward()
    off_b = sum(2 * r for r in range(RANK))
    expected_b = MEAN_W * (torch.arange(n_b, dtype=torch.float64) + 1)
    problems.append(
        close(
            a.grad, expected[offset : offset + rows[RANK]].numpy(), what="grouped_allgather grad a"
        )
    )
    problems.append(
        close(b.grad, expected_b[off_b : off_b + 2 * RANK].numpy(), what="grouped_allgather grad b")
    )
    return collect(*problems)


checks.check("gradient of allgather and grouped_allgather", grad_allgather)


def grad_broadcast():
    problems = []
    for root in sorted({0, SIZE - 1}):
        x = torch.full((5,), float(RANK), requires_grad=True)
        y = hvd.broadcast(x, root_rank=root)
        (y * (RANK + 1)).sum().backward()
        problems.append(close(y, np.full(5, float(root)), what=f"root {root} forward"))
        # Horovod's gradient: averaged over ranks on the root, zero elsewhere
        problems.append(
            close(x.grad, np.full(5, MEAN_W if RANK == root else 0.0), what=f"root {root} grad")
        )
    return collect(*problems)


checks.check("gradient of broadcast", grad_broadcast)


def grad_reducescatter():
    problems = []
    n = 2 * SIZE + 1
    owner = np.concatenate(
        [np.full(n // SIZE + (1 if r < n % SIZE else 0), r) for r in range(SIZE)]
    )
    for op, pre, factor in ((hvd.Sum, 1.0, SIZE), (hvd.Average, 1.0, 1), (hvd.Sum, 0.5, SIZE)):
        x = torch.ones(n, 2, dtype=torch.float64, requires_grad=True)
        y = hvd.reducescatter(x, op=op, prescale_factor=pre)
        (y * (RANK + 1)).sum().backward()
        # Horovod's gradient: the incoming gradients allgathered, x size() for Sum
        expected = np.repeat(((owner + 1) * factor * pre)[:, None], 2, axis=1)
        problems.append(close(x.grad, expected, what=f"reducescatter {op.name} x{pre} grad"))
    a = torch.ones(n, dtype=torch.float64, requires_grad=True)
    b = torch.ones(n, 3, dtype=torch.float64, requires_grad=True)
    ya, yb = hvd.grouped_reducescatter([a, b], op=hvd.Sum)
    ((ya * (RANK + 1)).sum() + (yb * 2).sum()).backward()
    problems.append(close(a.grad, (owner + 1.0) * SIZE, what="grouped_reducescatter grad a"))
    problems.append(close(b.grad, np.full((n, 3), 2.0 * SIZE), what="grouped grad b"))
    return collect(*problems)


checks.check("gradient of reducescatter and grouped_reducescatter", grad_reducescatter)

# ---- errors -----------------------------------------------------------------------------------


def a2a_block(src, dst, n):
    """The rows rank src sends rank dst: values encode (src, dst, row)."""
    base = torch.arange(n, dtype=torch.float64) + src * 100 + dst * 10
    return torch.stack([base, -base], dim=1)


def alltoall_forms():
    problems = []
    splits = [(RANK + j) % 3 for j in range(SIZE)]  # some ranks send nothing to some
    x = torch.cat([a2a_block(RANK, j, splits[j]) for j in range(SIZE)])
    received = [(q + RANK) % 3 for q in range(SIZE)]
    expected = torch.cat([a2a_block(q, RANK, received[q]) for q in range(SIZE)]).numpy()
    out, rec = hvd.alltoall(x, splits=splits, name="a2a.splits")
    if rec.dtype != torch.int32 or rec.tolist() != received:
        problems.append(f"received splits {rec!r}, expected int32 {received}")
    problems.append(close(out, expected, what="alltoall with splits"))
    h = hvd.alltoall_async(x, splits=torch.tensor(splits, dtype=torch.int32), name="a2a.async")
    out2, rec2 = hvd.synchronize(h)
    problems.append(close(out2, expected, what="alltoall_async with tensor splits"))
    if rec2.tolist() != received:
        problems.append(f"alltoall_async received splits {rec2.tolist()} != {received}")
    y = torch.arange(2 * SIZE, dtype=torch.int32) + 1000 * RANK
    even = hvd.alltoall(y)  # no splits: the output only, two rows from each rank
    problems.append(
        close(
            even,
            np.concatenate([np.arange(2 * RANK, 2 * RANK + 2) + 1000 * q for q in range(SIZE)]),
            dtype=torch.int32,
            what="alltoall without splits",
        )
    )
    if SIZE > 1:
        problems.append(
            raises(
                cring.MismatchError,
                lambda: hvd.alltoall(torch.ones(SIZE, 2 + RANK), name="a2a.mm"),
                match="a2a.mm",
            )
        )
    problems.append(
        close(
            hvd.alltoall(x, splits=splits, name="a2a.splits")[0],
            expected,
            what="alltoall after a mismatch",
        )
    )
    return collect(*problems)


checks.check("alltoall with and without splits", alltoall_forms)


def grad_alltoall():
    splits = [(RANK + j) % 3 + 1 for j in range(SIZE)]
    x = torch.arange(2.0 * sum(splits), dtype=torch.float64).reshape(-1, 2).requires_grad_()
    out, rec = hvd.alltoall(x, splits=splits, name="grad.a2a")
    # rows received from rank q weigh (q + 1) * (RANK + 1)
    w = torch.cat(
        [
            torch.full((int(rec[q]), 2), float((q + 1) * (RANK + 1)), dtype=torch.float64)
            for q in range(SIZE)
        ]
    )
    (out * w).sum().backward()
    # so the rows this rank sent to rank j carry the weight (RANK + 1) * (j + 1)
    expected = np.concatenate(
        [np.full((splits[j], 2), float((RANK + 1) * (j + 1))) for j in range(SIZE)]
    )
    return close(x.grad, expected, what="alltoall gradient")


checks.check("gradient of alltoall", grad_alltoall)


def join_uneven_batches():
    """Rank r has r + 1 batches. Each batch a DistributedOptimizer step on a
    linear model; a rank out of batches joins, and the others' averaged
    gradients count it as zeros. Every rank replays the whole job alone to
    know what the parameters must be."""
    problems = []

    def batch(r, b):
        g = torch.Generator().manual_seed(1000 * r + b)
        return torch.randn(4, 3, generator=g, dtype=torch.float64), torch.randn(
            4, 1, generator=g, dtype=torch.float64
        )

    def model():
        torch.manual_seed(7)
        return torch.nn.Linear(3, 1).double()

    m = model()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters()
    )
    for b in range(RANK + 1):
        xb, yb = batch(RANK, b)
        opt.zero_grad()
        torch.nn.functional.mse_loss(m(xb), yb).backward()
        opt.step()
    last = hvd.join()
    if last != SIZE - 1:
        problems.append(f"join() returned {last}, expected {SIZE - 1} (the rank with most batches)")

    ref = model()  # replay: step b averages the gradients of ranks r >= b over SIZE
    for b in range(SIZE):
        grads = [torch.zeros_like(p) for p in ref.parameters()]
        for r in range(b, SIZE):
            ref.zero_grad()
            xb, yb = batch(r, b)
            torch.nn.functional.mse_loss(ref(xb), yb).backward()
            for g, p in zip(grads, ref.parameters()):
                g += p.grad
        with torch.no_grad():
            for g, p in zip(grads, ref.parameters()):
                p -= 0.1 * g / SIZE
        if b == RANK:  # this rank stopped stepping here
            mine = [p.detach().clone() for p in ref.parameters()]
    for got, want in zip(m.parameters(), mine):
        problems.append(close(got, want.numpy(), rtol=1e-10, what="parameters after join"))
    # after join() returns, collectives run as before
    after = hvd.allreduce(torch.full((2,), float(RANK)), op=hvd.Sum, name="after.join")
    problems.append(close(after, np.full(2, float(sum(range(SIZE)))), what="allreduce after join"))
    return collect(*problems)


checks.check("join with uneven batches", join_uneven_batches)


def mismatch_raises_everywhere():
    problems = [
        raises(
            cring.MismatchError,
            lambda: hvd.allreduce(torch.ones(3 + RANK), name="mm.shape"),
            match="mm.shape",
            not_type=hvd.HorovodInternalError,
        ),
        raises(
            cring.MismatchError,
            lambda: hvd.allgather(torch.ones(2, 2 + RANK), name="mm.trailing"),
            match="mm.trailing",
        ),
        raises(
            cring.MismatchError,
            lambda: hvd.broadcast(torch.ones(2), RANK, name="mm.root"),
            match="mm.root",
        )
        if SIZE > 1
        else None,
        raises(
            cring.MismatchError,
            lambda: hvd.allreduce(
                torch.ones(4, dtype=torch.float64 if RANK else torch.float32), name="mm.dtype"
            ),
        ),
    ]
    after = hvd.allreduce(torch.full((3,), float(RANK)), op=hvd.Sum, name="mm.shape")
    problems.append(close(after, np.full(3, float(sum(range(SIZE)))), what="op after mismatch"))
    return collect(*problems)


checks.check("mismatches raise MismatchError on every rank", mismatch_raises_everywhere)


def duplicate_in_flight_names():
    # Rank `owner` submits 'dup.<owner>' twice before the others can have
    # submitted theirs: they only submit after 'go.<owner>', which the owner
    # joins after the duplicate.
    problems = []
    for owner in range(SIZE):
        name = f"dup.{owner}"
        x = torch.full((4,), float(RANK + 1))
        if RANK == owner:
            h = hvd.allreduce_async(x, op=hvd.Sum, name=name)
            problems.append(
                raises(
                    ValueError,
                    lambda: hvd.allreduce_async_(torch.zeros(4), op=hvd.Sum, name=name),
                    match=name,
                )
            )
            problems.append(
                raises(ValueError, lambda: hvd.broadcast_async(torch.zeros(4), 0, name=name))
            )
            hvd.allreduce(torch.zeros(1), name=f"go.{owner}")
        else:
            hvd.allreduce(torch.zeros(1), name=f"go.{owner}")
            h = hvd.allreduce_async(x, op=hvd.Sum, name=name)
        problems.append(
            close(hvd.synchronize(h), np.full(4, float(sum(range(1, SIZE + 1)))), what=name)
        )
    return collect(*problems)


checks.check("duplicate in-flight names raise ValueError", duplicate_in_flight_names)


def argument_errors():
    x = torch.ones(4)
    cx = torch.ones(4, dtype=torch.complex64)
    problems = [
        raises(ValueError, lambda: hvd.broadcast(x, SIZE), match="out of range"),
        raises(ValueError, lambda: hvd.broadcast_(x, -1), match="out of range"),
        raises(ValueError, lambda: hvd.broadcast_async(x, SIZE + 3)),
        raises(ValueError, lambda: hvd.broadcast_object({"a": 1}, root_rank=SIZE)),
        raises(ValueError, lambda: hvd.allreduce_(torch.ones(4, 4).t()), match="contiguous"),
    ]
    for label, fn in (
        ("allreduce", lambda: hvd.allreduce(cx)),
        ("allreduce_", lambda: hvd.allreduce_(cx)),
        ("allgather", lambda: hvd.allgather(cx)),
        ("broadcast", lambda: hvd.broadcast(cx, 0)),
        ("reducescatter", lambda: hvd.reducescatter(cx)),
        ("complex128", lambda: hvd.allreduce(torch.ones(2, dtype=torch.complex128))),
    ):
        problem = raises(TypeError, fn, match="dtype")
        problems.append(problem and f"{label}: {problem}")
    problems.append(
        raises(
            TypeError if SIZE in (1, 2, 4, 8) else ValueError,
            lambda: hvd.allreduce(torch.ones(2, dtype=torch.int32), op=hvd.Adasum),
            match="Adasum",
        )
    )
    other = hvd.ProcessSet([0])
    for label, fn in (
        ("allreduce", lambda: hvd.allreduce(x, process_set=other)),
        ("allreduce_", lambda: hvd.allreduce_(x, process_set=other)),
        ("allreduce_async", lambda: hvd.allreduce_async(x, process_set=other)),
        ("grouped_allreduce", lambda: hvd.grouped_allreduce([x], process_set=other)),
        ("allgather", lambda: hvd.allgather(x, process_set=other)),
        ("grouped_allgather", lambda: hvd.grouped_allgather([x], process_set=other)),
        ("broadcast", lambda: hvd.broadcast(x, 0, process_set=other)),
        ("broadcast_", lambda: hvd.broadcast_(x, 0, process_set=other)),
        ("reducescatter", lambda: hvd.reducescatter(x, process_set=other)),
        ("barrier", lambda: hvd.barrier(process_set=other)),
        ("broadcast_object", lambda: hvd.broadcast_object(1, process_set=other)),
        ("allgather_object", lambda: hvd.allgather_object(1, process_set=other)),
    ):  # a process set never added (tests/test_process_sets.py covers registered ones)
        problem = raises(ValueError, fn, match="not registered")
        problems.append(problem and f"{label}: {problem}")
    problem = raises(NotImplementedError, lambda: hvd.init(comm=[0]), match="not supported")
    problems.append(problem and f"init comm: {problem}")
    for label, fn, match in (
        (
            "alltoall splits length",
            lambda: hvd.alltoall(x, splits=[1] * (SIZE + 1)),
            "one per rank",
        ),
        ("alltoall splits sum", lambda: hvd.alltoall(x, splits=[5] + [0] * (SIZE - 1)), "add up"),
        (
            "alltoall negative split",
            lambda: hvd.alltoall(x, splits=[-1, 5] + [0] * (SIZE - 2)),
            "negative",
        ),
        (
            "alltoall uneven",
            lambda: (
                hvd.alltoall(torch.ones(SIZE + 1)) if SIZE > 1 else hvd.alltoall(torch.ones(()))
            ),
            "alltoall",
        ),
        ("alltoall 0-d", lambda: hvd.alltoall(torch.ones(())), "dimension"),
    ):
        problem = raises(ValueError, fn, match=match)
        problems.append(problem and f"{label}: {problem}")
    # nothing above reached the engine: the next collective lines up on every rank
    after = hvd.allreduce(torch.full((2,), float(RANK)), op=hvd.Sum, name="after.errors")
    problems.append(close(after, np.full(2, float(sum(range(SIZE)))), what="op after errors"))
    return collect(*problems)


checks.check("argument errors are raised locally", argument_errors)

checks.info["engine_errors"] = cring.engine_stats()["errors"]
hvd.shutdown()
checks.finish()

"""The dtype x collective x shape sweep of CUDA tensors against the CPU path
(issue 26): every collective on device tensors must give exactly what the
same call gives on NumPy arrays in the same job. Run by tests/gpu/sweep_worker.py
(CPU CI: FakeCudaTensor against the test doubles libfake_nccl/libfake_cudart,
world sizes 1-3, and the fake's one-rank defect switched on) and by
tests/gpu/run_gpu_checks.py on a real GPU (torch CUDA tensors).

`sweep(to_device, to_numpy, ...)` takes how to make a device tensor from a
NumPy array and how to read a result back; it returns (cases run, failures).
Every rank must call it with the same arguments (the calls are collective).

What "exactly" means: the same bytes, except for one documented case: a
float64 Average with scale factors at a world size that is not a power of
two, where NCCL's pre-multiplied sum folds 1/size into the factor (a rounding
the CPU path does not make): compared to 1e-15 relative.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

import cring
from cring._collectives import NUMPY_DTYPES

DTYPES = NUMPY_DTYPES  # every dtype the CPU path takes (cring owns the list)
FLOATS = ("float16", "float32", "float64")
LARGE = 2**20 + 3
OPS = (("Sum", cring.Sum), ("Average", cring.Average), ("Min", cring.Min), ("Max", cring.Max))
FLOAT_SCALES = ((2.0, 0.25),)
INT_SCALES = ((3.0, 0.5), (0.5, 1.0))


def values(dtype: str, shape: tuple, rank: int, size: int, salt: int) -> np.ndarray:
    """Deterministic data: small integers (so that sums stay exact and do not
    overflow after a factor of 3), floats as multiples of `size` (so that an
    average is exact whatever the order of the sum)."""
    n = int(np.prod(shape)) if shape else 1
    i = np.arange(n, dtype=np.int64)
    if dtype == "bool":
        return ((i * 7 + rank * 3 + salt) % 3 == 0).reshape(shape)
    v = (i * 37 + rank * 101 + salt * 13) % 41 - 20
    if dtype.startswith("uint"):
        v = v + 20
    if dtype in FLOATS:
        v = v * size
    return v.astype(dtype).reshape(shape)


class _Sweep:
    def __init__(
        self, to_device: Callable, to_numpy: Callable, rank: int, size: int, log: Callable
    ):
        self.dev, self.host, self.rank, self.size, self.log = to_device, to_numpy, rank, size, log
        self.cases, self.failures = 0, []

    def compare(self, what: str, got: Any, want: np.ndarray, close: bool = False) -> None:
        self.cases += 1
        got = np.asarray(got)
        want = np.asarray(want)
        if got.shape != want.shape or got.dtype != want.dtype:
            self.fail(what, f"{got.dtype}{got.shape} instead of {want.dtype}{want.shape}")
        elif close:
            if not np.allclose(got, want, rtol=1e-15, atol=0):
                self.fail(what, f"max difference {np.max(np.abs(got - want))}")
        elif got.tobytes() != want.tobytes():
            bad = np.flatnonzero(got.ravel().view(np.uint8) != want.ravel().view(np.uint8))
            first = int(bad[0]) // max(want.itemsize, 1)
            self.fail(
                what,
                f"{len(bad)} bytes differ, first at element {first}: "
                f"{got.ravel()[first]!r} instead of {want.ravel()[first]!r}",
            )

    def fail(self, what: str, why: str) -> None:
        self.failures.append(f"rank {self.rank}: {what}: {why}")
        self.log(f"FAIL {what}: {why}", verbose=False)

    def both(self, what: str, call: Callable, close: bool = False, **kw: Any) -> None:
        """call(make, tag) on NumPy arrays and on device tensors; the results
        (an array, or a tuple/list of them) must agree. An exception on the
        CPU must be the same class on the device."""
        self.log(f"case {what}", verbose=True)
        try:
            want = call(lambda a: a.copy(), "cpu")
            want_error = None
        except Exception as e:  # noqa: BLE001  (compared below)
            want, want_error = None, e
        try:
            got = call(self.dev, "dev")
            # read back at once (a copy), before any later call runs
            got = [x if isinstance(x, np.ndarray) else self.host(x) for x in _as_list(got)]
            got_error = None
        except Exception as e:  # noqa: BLE001
            got, got_error = None, e
        if want_error or got_error:
            self.cases += 1
            if type(want_error) is not type(got_error):
                self.fail(what, f"CPU raised {want_error!r}, the device {got_error!r}")
            return
        for k, (g, w) in enumerate(zip(got, _as_list(want))):
            self.compare(f"{what}[{k}]" if len(got) > 1 else what, g, np.asarray(w), close)


def _half_factor_at_one_rank(s: _Sweep, process_set: Any = None) -> None:
    """Device tensors on one rank (world size 1, or a process set of one rank):
    a scaled float16 Sum/Average is x * factor with the factor (prescale x
    postscale) rounded to float16 first, as NCCL's pre-multiplied sum and
    Horovod's GPU path compute it, whether NCCL or the staged route (the
    one-rank defect's guard) ran it, on the global set and on a process set
    alike (each set has its own NCCL communicator; docs/gpu.md). The CPU path
    scales float16 by the float32 factor (Horovod's CPU rule), so this is not
    compared with the CPU; 0.3 and 0.15 are not float16 numbers, so the two
    rules differ here."""
    where_set = "" if process_set is None else " on a one-rank set"
    for pre, post in ((0.3, 1.0), (1.0, 0.3), (2.0, 0.15)):
        factor = np.float32(np.float16(pre * post))
        for op_name, op in OPS[:2]:
            for in_place in (True, False):
                x = values("float16", (17, 17, 17), 0, 1, 13)
                want = (x.astype(np.float32) * factor).astype(np.float16)
                where = "in place" if in_place else "out of place"
                what = f"one-rank float16 {op_name} x{pre},{post} {where}{where_set}"
                s.log(f"case {what}", verbose=True)
                kw = dict(op=op, prescale_factor=pre, postscale_factor=post)
                if process_set is not None:
                    kw["process_set"] = process_set
                try:
                    t = s.dev(x)
                    tensor_name = f"sweep.half.{pre}.{post}.{op_name}.{in_place}"
                    if in_place:
                        cring.allreduce_(t, name=tensor_name, **kw)
                    else:
                        t = cring.allreduce(t, name=tensor_name, **kw)
                    s.compare(what, s.host(t), want)
                except Exception as e:  # noqa: BLE001  (a failure, then the next case)
                    s.cases += 1
                    s.fail(what, repr(e))


def _as_list(x: Any) -> list:
    return list(x) if isinstance(x, (tuple, list)) else [x]


def sweep(
    to_device: Callable[[np.ndarray], Any],
    to_numpy: Callable[[Any], np.ndarray],
    *,
    dtypes: tuple = DTYPES,
    large: bool = True,
    process_sets: bool = True,
    log: Callable[..., None] = lambda line, verbose: None,
) -> tuple[int, list]:
    r, p = cring.rank(), cring.size()
    s = _Sweep(to_device, to_numpy, r, p, log)
    n = 0

    def name(tag: str, what: str) -> str:
        nonlocal n
        n += 1
        return f"sweep.{tag}.{n // 2}.{what}"

    shapes = [(17, 17, 17), (1,), (5, 3)]
    for dtype in dtypes:
        reducible = dtype != "bool"
        # ---- allreduce: every op, in and out of place, with and without factors ----
        for shape in shapes + ([(LARGE,)] if large else []):
            big = shape == (LARGE,)
            for op_name, op in OPS if reducible else ():
                if big and op_name not in ("Sum", "Average"):
                    continue
                scales = [(1.0, 1.0)]
                if op_name in ("Sum", "Average") or dtype not in FLOATS:
                    scales += list(FLOAT_SCALES if dtype in FLOATS else INT_SCALES)
                if big:  # the one-rank defect's cases; Sum once, in place
                    scales = scales[:2] if op_name == "Average" else scales[:1]
                for pre, post in scales:
                    close = (
                        dtype == "float64"
                        and op_name == "Average"
                        and (pre, post) != (1.0, 1.0)
                        and p & (p - 1) != 0
                    )
                    for in_place in (True, False):
                        if big and in_place != (op_name == "Sum"):
                            continue
                        x = values(dtype, shape, r, p, 1)
                        call = "allreduce_" if in_place else "allreduce"
                        what = f"{call} {op_name} {dtype}{shape} x{pre},{post}"

                        def ar(
                            make, tag, x=x, op=op, pre=pre, post=post, in_place=in_place, w=what
                        ):
                            t = make(x)
                            kw = dict(op=op, prescale_factor=pre, postscale_factor=post)
                            if in_place:
                                cring.allreduce_(t, name=name(tag, w), **kw)
                                return t
                            return cring.allreduce(t, name=name(tag, w), **kw)

                        s.both(what, ar, close)
        # ---- grouped allreduce mixing this dtype with float32 ----
        if reducible:

            def gar(make, tag, dtype=dtype):
                ts = [make(values(dtype, (17, 3), r, p, 2)), make(values("float32", (7,), r, p, 3))]
                return cring.grouped_allreduce(ts, op=cring.Sum, name=name(tag, f"gar {dtype}"))

            s.both(f"grouped_allreduce {dtype}+float32", gar)
        # ---- broadcast from the last rank, in and out of place ----
        for shape in [(17, 17, 17), (3,)] + ([(LARGE,)] if large else []):
            for in_place in (True, False) if shape != (LARGE,) else (False,):
                x = values(dtype, shape, r, p, 4)

                def bc(make, tag, x=x, in_place=in_place, shape=shape):
                    t = make(x)
                    w = f"bcast {dtype}{shape}{in_place}"
                    if in_place:
                        cring.broadcast_(t, root_rank=p - 1, name=name(tag, w))
                        return t
                    return cring.broadcast(t, root_rank=p - 1, name=name(tag, w))

                s.both(f"broadcast{'_' if in_place else ''} {dtype}{shape}", bc)
        # ---- allgather: uneven first dimensions, and an even large one ----
        for rows, rest in [(r + 1, (17, 17)), (2 * r + 1, ()), (0 if r == 0 else 3, (5,))] + (
            [(LARGE, ())] if large and dtype in ("float32", "int16", "bool") else []
        ):
            x = values(dtype, (rows,) + rest, r, p, 5)

            def ag(make, tag, x=x):
                return cring.allgather(make(x), name=name(tag, f"ag {dtype}"))

            s.both(f"allgather {dtype} rows {rows}x{rest}", ag)

        def gag(make, tag):
            ts = [make(values(dtype, (r + 2, 3), r, p, 6)), make(values("int64", (1,), r, p, 7))]
            return cring.grouped_allgather(ts, name=name(tag, f"gag {dtype}"))

        s.both(f"grouped_allgather {dtype}+int64", gag)
        # ---- reducescatter: 17 rows (uneven over 2 and 3 ranks) ----
        for op_name, op in OPS if reducible else ():
            scales = [(1.0, 1.0)] + (
                []
                if dtype in FLOATS and op_name not in ("Sum", "Average")
                else list(FLOAT_SCALES if dtype in FLOATS else INT_SCALES[:1])
            )
            for pre, post in scales:
                x = values(dtype, (17, 3), r, p, 8)
                close = dtype == "float64" and op_name == "Average" and pre != 1 and p & (p - 1)

                def rs(make, tag, x=x, op=op, pre=pre, post=post):
                    return cring.reducescatter(
                        make(x),
                        op=op,
                        prescale_factor=pre,
                        postscale_factor=post,
                        name=name(tag, f"rs {dtype} {op} {pre}"),
                    )

                s.both(f"reducescatter {op_name} {dtype} x{pre},{post}", rs, bool(close))
        # ---- alltoall: uneven splits, zero rows included ----
        splits = [(r + q) % 3 for q in range(p)]
        x = values(dtype, (sum(splits), 4), r, p, 9)

        def a2a(make, tag, x=x, splits=splits):
            out, received = cring.alltoall(make(x), splits=splits, name=name(tag, f"a2a {dtype}"))
            return out, np.asarray(received, dtype=np.int64)

        s.both(f"alltoall {dtype} splits {splits}", a2a)
        if p > 1:
            even = values(dtype, (2 * p, 3), r, p, 10)

            def a2e(make, tag, x=even):
                out, received = cring.alltoall(make(x), name=name(tag, f"a2e {dtype}"))
                return out, np.asarray(received, dtype=np.int64)

            s.both(f"alltoall {dtype} even", a2e)

    # ---- a process set of one rank (each rank its own) ----
    if p == 1:
        _half_factor_at_one_rank(s)
    if process_sets and p > 1:
        sets = [cring.add_process_set([q]) for q in range(p)]
        mine = sets[r]
        for dtype in ("float32", "float16", "int32", "int16"):
            for shape in [(17, 17, 17)] + ([(LARGE,)] if large else []):
                scales = [(1.0, 1.0)] + list(FLOAT_SCALES if dtype in FLOATS else INT_SCALES)
                for pre, post in scales:
                    x = values(dtype, shape, r, 1, 11)

                    def ps_ar(make, tag, x=x, pre=pre, post=post, shape=shape):
                        return cring.allreduce(
                            make(x),
                            op=cring.Average,
                            prescale_factor=pre,
                            postscale_factor=post,
                            name=name(tag, f"ps {dtype}{shape}{pre}"),
                            process_set=mine,
                        )

                    s.both(f"one-rank set allreduce Average {dtype}{shape} x{pre},{post}", ps_ar)
            x = values(dtype, (5, 2), r, 1, 12)

            def ps_a2a(make, tag, x=x):
                out, received = cring.alltoall(
                    make(x), name=name(tag, f"ps a2a {dtype}"), process_set=mine
                )
                return out, np.asarray(received, dtype=np.int64)

            s.both(f"one-rank set alltoall {dtype}", ps_a2a)
        _half_factor_at_one_rank(s, mine)
        for ps in sets:
            cring.remove_process_set(ps)
    return s.cases, s.failures

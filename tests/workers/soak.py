"""Worker: a soak of thousands of random allreduces, every result checked
exactly.

Each unit of work (a synchronous call, a batch of asynchronous calls, or a
grouped call) draws its tensors' sizes (1 element to ~1 MiB, log-uniform so
most are small), dtypes (float16, bfloat16, float32, float64, int8, uint8,
int32, int64), ops (Sum, Average, Min, Max, Product) and names from a plan
every rank derives from the same seed. Every rank's input is a function of
(seed, unit, tensor, rank), so each rank regenerates its peers' inputs and
computes the expected result with NumPy, using the semantics cring documents:
integers wrap and Average divides toward zero; float16/bfloat16 are combined
in float32 and rounded to nearest even once. bfloat16, which NumPy lacks,
travels as uint16 bits under a DLPack bfloat16 dtype (tests/fake_dlpack.py)
and is reduced in place.

Resident memory (/proc/self/statm) is sampled after a warm-up that runs the
largest shapes of every kind once, and then every 500 tensors.

Usage: soak.py OUT_DIR OPS SEED
Writes OUT_DIR/rank<R>.json; on a wrong result raises with the unit, tensor,
dtype, op and first differing element.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: fake_dlpack

import cring  # noqa: E402

from fake_dlpack import FakeTensor  # noqa: E402

OUT_DIR, TOTAL, SEED = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
DTYPES = ["float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64"]
OPS = {
    "sum": cring.Sum,
    "average": cring.Average,
    "min": cring.Min,
    "max": cring.Max,
    "product": cring.Product,
}
ITEMSIZE = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "int8": 1,
    "uint8": 1,
    "int32": 4,
    "int64": 8,
}
MAX_BYTES = 1 << 20
NAME_POOL = 300  # names are reused with new shapes and dtypes, as a changing model would
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


# ---- inputs and the NumPy reference ---------------------------------------------


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, rounding to nearest even (inputs have no NaN)."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


def make_input(dtype: str, n: int, unit: int, index: int, rank: int) -> np.ndarray:
    """Rank `rank`'s input for tensor `index` of `unit`: the same on every rank."""
    rng = np.random.default_rng([SEED, unit, index, rank])
    if dtype in ("float16", "float32", "float64"):
        return rng.standard_normal(
            n, dtype=np.float64 if dtype == "float64" else np.float32
        ).astype(dtype)
    if dtype == "bfloat16":
        return f32_to_bf16_bits(rng.standard_normal(n, dtype=np.float32))
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, size=n, dtype=dtype, endpoint=True)


def reference(dtype: str, op: str, inputs: list) -> np.ndarray:
    """What every rank must hold after allreducing `inputs` (one per rank)."""
    size = len(inputs)
    if dtype in ("float16", "bfloat16"):
        wide = [
            bf16_bits_to_f32(x) if dtype == "bfloat16" else x.astype(np.float32) for x in inputs
        ]
        acc = combine(op, wide)
        if op == "average":
            acc = acc / np.float32(size)
        return f32_to_bf16_bits(acc) if dtype == "bfloat16" else acc.astype(np.float16)
    acc = combine(op, inputs)
    if op == "average":
        if dtype.startswith(("int", "uint")):
            # wrapped sum divided toward zero, without overflow: (s - s % n) / n
            acc = (acc - np.fmod(acc, acc.dtype.type(size))) // acc.dtype.type(size)
        else:
            acc = acc / acc.dtype.type(size)
    return acc.astype(dtype)


def combine(op: str, xs: list) -> np.ndarray:
    acc = xs[0].copy()
    with np.errstate(over="ignore"):
        for x in xs[1:]:
            if op in ("sum", "average"):
                acc = acc + x
            elif op == "product":
                acc = acc * x
            elif op == "min":
                acc = np.minimum(acc, x)
            else:
                acc = np.maximum(acc, x)
    return acc


# ---- the plan ----------------------------------------------------------------------


def draw_tensor(plan: np.random.Generator) -> tuple[str, int]:
    dtype = DTYPES[plan.integers(len(DTYPES))]
    nbytes = int(2 ** plan.uniform(0, 20))  # 1 B .. 1 MiB, log-uniform: skewed small
    return dtype, max(1, nbytes // ITEMSIZE[dtype])


class Tensor:
    """One tensor of a unit: this rank's input, the array cring sees, the expected result."""

    def __init__(self, unit: int, index: int, dtype: str, n: int, op: str, in_place: bool):
        self.dtype, self.n, self.op = dtype, n, op
        self.in_place = in_place or dtype == "bfloat16"  # no NumPy output for bfloat16
        inputs = [make_input(dtype, n, unit, index, r) for r in range(cring.size())]
        self.expected = reference(dtype, op, inputs)
        self.input = inputs[cring.rank()]
        self.pristine = None if self.in_place else self.input.copy()
        if dtype == "bfloat16":
            self.arg = FakeTensor(self.input, code=4, bits=16)  # DLPack kDLBfloat
        else:
            self.arg = self.input

    def check(self, result, where: str) -> None:
        got = self.input if self.in_place else result
        if not self.in_place:
            assert type(got) is np.ndarray and got.dtype.name == self.dtype, (where, type(got))
            if not np.array_equal(self.input, self.pristine):
                raise AssertionError(f"{where}: the input of an out-of-place call changed")
        else:
            assert result is self.arg, f"{where}: in-place call returned another object"
        if got.shape != self.expected.shape or not np.array_equal(got, self.expected):
            bad = np.flatnonzero(got != self.expected)
            i = int(bad[0]) if bad.size else -1
            raise AssertionError(
                f"{where}: {self.dtype} {self.op} of {self.n} elements is wrong at {bad.size} "
                f"elements; first at {i}: got {got[i] if i >= 0 else got.shape!r}, expected "
                f"{self.expected[i] if i >= 0 else self.expected.shape!r} (seed {SEED})"
            )


def run_unit(unit: int, plan: np.random.Generator, counts: dict, largest: bool = False) -> int:
    """Run one unit of work; returns how many tensors it allreduced."""
    mode = (
        ["sync", "sync", "async", "grouped"][plan.integers(4)]
        if not largest
        else ["sync", "async", "grouped"][unit % 3]
    )
    ntensors = 1 if mode == "sync" else int(plan.integers(2, 17)) if not largest else 16
    names = [f"soak.{k}" for k in plan.choice(NAME_POOL, size=ntensors, replace=False)]
    group_op = list(OPS)[plan.integers(len(OPS))]
    tensors = []
    for j in range(ntensors):
        dtype, n = draw_tensor(plan)
        if largest:
            dtype = DTYPES[(unit + j) % len(DTYPES)]
            n = MAX_BYTES // ITEMSIZE[dtype]
        op = group_op if mode == "grouped" else list(OPS)[plan.integers(len(OPS))]
        in_place = bool(plan.integers(2))
        tensors.append(Tensor(unit, j, dtype, n, op, in_place))
    counts[mode] = counts.get(mode, 0) + ntensors
    where = f"unit {unit} ({mode})"

    if mode == "sync":
        t = tensors[0]
        name = None if plan.integers(10) == 0 else names[0]  # some unnamed: same order everywhere
        fn = cring.allreduce_ if t.in_place else cring.allreduce
        t.check(fn(t.arg, op=OPS[t.op], name=name), where)
    elif mode == "async":
        # each rank submits, and then waits, in its own order: negotiation sorts it out
        order = np.random.default_rng([SEED, unit, 7, cring.rank()]).permutation(ntensors)
        handles = {}
        for j in order:
            t = tensors[j]
            fn = cring.allreduce_async_ if t.in_place else cring.allreduce_async
            handles[j] = fn(t.arg, op=OPS[t.op], name=names[j])
        for j in np.random.default_rng([SEED, unit, 8, cring.rank()]).permutation(ntensors):
            tensors[j].check(cring.synchronize(handles[j]), f"{where} tensor {j} {names[j]}")
    else:
        # one op, mixed dtypes; in place when any member must be (bfloat16)
        in_place = any(t.in_place for t in tensors)
        for t in tensors:
            t.in_place = in_place
        fn = cring.grouped_allreduce_ if in_place else cring.grouped_allreduce
        results = fn([t.arg for t in tensors], op=OPS[group_op], name=f"group.{names[0]}")
        assert len(results) == ntensors
        for j, (t, r) in enumerate(zip(tensors, results)):
            t.check(r, f"{where} tensor {j}")
    for t in tensors:
        counts[t.dtype] = counts.get(t.dtype, 0) + 1
        counts[t.op] = counts.get(t.op, 0) + 1
    return ntensors


def main() -> None:
    cring.init()
    assert cring.size() == 2
    plan = np.random.default_rng([SEED, 0xC0FFEE])  # identical on every rank
    counts: dict = {}
    t0 = time.monotonic()
    # Warm-up: the largest shapes of every mode once (the fusion buffer and
    # NumPy's allocator reach their working size), then the baseline.
    for unit in range(6):
        run_unit(unit, plan, {}, largest=True)
    gc.collect()
    rss_start = rss_bytes()
    samples = [rss_start]
    done, unit, next_sample = 0, 6, 500
    while done < TOTAL:
        done += run_unit(unit, plan, counts)
        unit += 1
        if done >= next_sample:
            gc.collect()
            samples.append(rss_bytes())
            next_sample += 500
    cring.barrier()
    gc.collect()
    rss_end = rss_bytes()
    samples.append(rss_end)
    result = {
        "rank": cring.rank(),
        "tensors": done,
        "units": unit - 6,
        "counts": counts,
        "seconds": time.monotonic() - t0,
        "rss_start": rss_start,
        "rss_end": rss_end,
        "rss_samples": samples,
        "transport": cring.transport(),
        "stats": cring.engine_stats(),
    }
    cring.shutdown()
    (OUT_DIR / f"rank{result['rank']}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()

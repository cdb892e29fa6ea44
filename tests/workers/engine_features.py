"""Worker: engine features, each against a NumPy reference.

- poll(): a 64 MiB async allreduce is not done right after submission, then
  completes in the background while the caller only polls;
- handles from threads: 4 threads per rank each submit 25 named allreduces
  and synchronize them; a handle submitted on one thread is synchronized on
  another;
- Compression.fp16 / bf16: small integers exact, random values within the
  wire dtype's tolerance (and visibly rounded), other dtypes untouched;
- grouped_allreduce(_)(_async)(_) over tensors of different shapes,
  grouped_allgather(_async) with different first dimensions,
  grouped_reducescatter;
- prescale_factor / postscale_factor with Sum.

Usage: engine_features.py OUTDIR. Writes OUTDIR/rank<R>.json; exits 1 on a failure.
"""

import sys
import threading
import time

import numpy as np

import cring

from engine_common import Checks, compare

TOL = {"fp16": 1e-3, "bf16": 8e-3}  # about one rounding of each wire dtype


def main():
    cring.init()
    rank, size = cring.rank(), cring.size()
    checks = Checks(sys.argv[1], rank, size)
    total = sum(range(1, size + 1))  # sum over ranks of (rank + 1)

    # 8. poll()
    def poll_large():
        n = 64 * 2**20 // 4
        x = np.full(n, rank + 1, dtype=np.float32)
        h = cring.allreduce_async(x, op=cring.Sum, name="poll.big")
        pending_polls = 0
        deadline = time.monotonic() + 50
        while not cring.poll(h):  # the engine progresses without synchronize()
            pending_polls += 1
            if time.monotonic() > deadline:
                return f"not done after 50 s of polling ({pending_polls} polls)"
            time.sleep(0.0005)
        checks.info["pending_polls"] = pending_polls
        if pending_polls == 0:
            return "poll() was True right after submitting a 64 MiB allreduce"
        out = cring.synchronize(h)
        if not cring.poll(h):
            return "poll() is False after synchronize()"
        if not (out == total).all():
            return f"wrong values: {np.unique(out)[:5]}"
        if cring.synchronize(h) is not out:  # the result is returned once and kept
            return "a second synchronize() returned a different object"
        return None

    checks.check("poll on a 64 MiB allreduce", poll_large)

    def poll_then_synchronize():
        h = cring.allreduce_async(
            np.full(16 * 2**20 // 4, rank, np.float32), op=cring.Sum, name="poll.sync"
        )
        before = cring.poll(h)
        out = cring.synchronize(h)
        if before:
            return "poll() was True right after submission"
        if not cring.poll(h):
            return "poll() is False after synchronize()"
        return compare(out[:8], np.full(8, sum(range(size)), np.float32))

    checks.check("poll False before synchronize, True after", poll_then_synchronize)

    # 9. Handles from threads
    def from_threads():
        nthreads, per_thread = 4, 25
        problems = []
        start = threading.Barrier(nthreads)

        def worker(t):
            try:
                start.wait()
                inputs = [
                    np.arange(1 + 97 * i, dtype=np.float64) * (t + 1) + rank
                    for i in range(per_thread)
                ]
                handles = [
                    cring.allreduce_async(x, op=cring.Sum, name=f"thread{t}.op{i}")
                    for i, x in enumerate(inputs)
                ]
                for i, h in enumerate(handles):
                    ref = np.arange(1 + 97 * i, dtype=np.float64) * (t + 1) * size + sum(
                        range(size)
                    )
                    problem = compare(cring.synchronize(h), ref)
                    if problem:
                        problems.append(f"thread{t}.op{i}: {problem}")
            except Exception as e:  # noqa: BLE001 - reported as a failure
                problems.append(f"thread {t}: {type(e).__name__}: {e}")

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(nthreads)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=55)
        if any(th.is_alive() for th in threads):
            return "a thread did not finish within 55 s"
        # a handle submitted here, synchronized on another thread
        h = cring.allreduce_async(np.full(5, rank, np.int32), op=cring.Sum, name="cross.thread")
        got = []
        th = threading.Thread(target=lambda: got.append(cring.synchronize(h)))
        th.start()
        th.join(timeout=55)
        if not got:
            problems.append("synchronize on another thread did not return")
        else:
            problem = compare(got[0], np.full(5, sum(range(size)), np.int32))
            if problem:
                problems.append(f"cross.thread: {problem}")
        return "; ".join(problems) or None

    checks.check("4 threads x 25 named allreduces", from_threads)

    # 10. Compression
    compressions = {"fp16": cring.Compression.fp16, "bf16": cring.Compression.bf16}

    def compression_small_integers():
        problems = []
        per_rank = [
            np.random.default_rng([1, r]).integers(-8, 9, 1001).astype(np.float32)
            for r in range(size)
        ]
        ref = np.sum(per_rank, axis=0).astype(np.float32)
        for cname, comp in compressions.items():
            out = cring.allreduce(
                per_rank[rank], op=cring.Sum, name=f"cint.{cname}", compression=comp
            )
            problem = compare(out, ref)
            if problem:
                problems.append(f"{cname}: {problem}")
            x = per_rank[rank].copy()
            if (
                cring.synchronize(
                    cring.allreduce_async_(x, op=cring.Sum, compression=comp, name=f"cint_.{cname}")
                )
                is not x
            ):
                problems.append(f"{cname}: in-place form did not return its argument")
            problem = compare(x, ref)
            if problem:
                problems.append(f"{cname} in place: {problem}")
        return "; ".join(problems) or None

    checks.check("compression: small integers exact", compression_small_integers)

    def compression_random():
        problems = []
        per_rank = [
            np.random.default_rng([2, r]).standard_normal(10_000).astype(np.float32)
            for r in range(size)
        ]
        exact = np.sum(np.stack(per_rank).astype(np.float64), axis=0)
        fp32 = cring.allreduce(
            per_rank[rank], op=cring.Sum, name="crand.none", compression=cring.Compression.none
        )
        problem = compare(fp32, exact.astype(np.float32), rtol=1e-6, atol=1e-6)
        if problem:
            problems.append(f"none: {problem}")
        # submitted together: the fusion must keep the three wire dtypes apart
        handles = {
            c: cring.allreduce_async(
                per_rank[rank], op=cring.Sum, name=f"crand.{c}", compression=comp
            )
            for c, comp in compressions.items()
        }
        for cname, h in handles.items():
            out = cring.synchronize(h)
            tol = TOL[cname] * (size + 1)
            problem = compare(out, exact.astype(np.float32), rtol=tol, atol=tol)
            if problem:
                problems.append(f"{cname}: {problem}")
            rounded = float(np.mean(out != fp32))
            checks.info[f"{cname}_rounded_fraction"] = rounded
            if rounded < 0.5:
                problems.append(
                    f"{cname}: only {rounded:.0%} of values differ from the float32 "
                    "result; was the payload compressed?"
                )
        return "; ".join(problems) or None

    checks.check("compression: random values within tolerance", compression_random)

    def compression_other_dtypes():
        problems = []
        for cname, comp in compressions.items():
            ints = np.arange(1000, dtype=np.int32) * 1009 + 1_000_000 + rank
            out = cring.allreduce(ints, op=cring.Sum, name=f"cother.i32.{cname}", compression=comp)
            ref = (np.arange(1000, dtype=np.int64) * 1009 + 1_000_000) * size + sum(range(size))
            problem = compare(out, ref.astype(np.int32))
            if problem:
                problems.append(f"int32 with {cname}: {problem}")
            doubles = np.full(7, 1.0 / 3.0 + rank, dtype=np.float64)
            out = cring.allreduce(
                doubles, op=cring.Sum, name=f"cother.f64.{cname}", compression=comp
            )
            ref = np.full(7, size / 3.0 + sum(range(size)), dtype=np.float64)
            problem = compare(out, ref, rtol=1e-14)
            if problem:
                problems.append(f"float64 with {cname}: {problem}")
        return "; ".join(problems) or None

    checks.check("compression ignored for int32 and float64", compression_other_dtypes)

    # 11. Grouped collectives and scaling
    shapes = [(3,), (4, 5), (0,), (2, 3, 4), ()]

    def grouped_inputs(r):
        # np.asarray: arithmetic on a 0-d array gives a NumPy scalar
        return [
            np.asarray(np.arange(int(np.prod(s)), dtype=np.float32).reshape(s) + 10 * k + r)
            for k, s in enumerate(shapes)
        ]

    grouped_refs = [
        np.asarray(np.sum([grouped_inputs(r)[k] for r in range(size)], axis=0), dtype=np.float32)
        for k in range(len(shapes))
    ]

    def check_group(label, outs, expect_same=None):
        if not isinstance(outs, list) or len(outs) != len(shapes):
            return f"{label}: expected a list of {len(shapes)}, got {type(outs).__name__}"
        problems = [
            f"{label}[{k}] {shapes[k]}: {p}"
            for k, out in enumerate(outs)
            if (p := compare(out, grouped_refs[k]))
        ]
        if expect_same is not None and any(a is not b for a, b in zip(outs, expect_same)):
            problems.append(f"{label}: in-place results are not the inputs")
        return "; ".join(problems) or None

    def grouped_allreduce():
        problems = []
        xs = grouped_inputs(rank)
        originals = [x.copy() for x in xs]
        problems.append(
            check_group(
                "grouped_allreduce", cring.grouped_allreduce(xs, op=cring.Sum, name="g.out")
            )
        )
        if any(not np.array_equal(a, b) for a, b in zip(xs, originals)):
            problems.append("grouped_allreduce modified its inputs")
        problems.append(
            check_group(
                "grouped_allreduce_async",
                cring.synchronize(cring.grouped_allreduce_async(xs, op=cring.Sum, name="g.async")),
            )
        )
        ys = grouped_inputs(rank)
        problems.append(
            check_group(
                "grouped_allreduce_",
                cring.grouped_allreduce_(ys, op=cring.Sum, name="g.inplace"),
                expect_same=ys,
            )
        )
        zs = grouped_inputs(rank)
        problems.append(
            check_group(
                "grouped_allreduce_async_",
                cring.synchronize(
                    cring.grouped_allreduce_async_(zs, op=cring.Sum, name="g.async_")
                ),
                expect_same=zs,
            )
        )
        return "; ".join(p for p in problems if p) or None

    checks.check("grouped allreduce, different shapes", grouped_allreduce)

    def grouped_allgather():
        problems = []

        def mine(r):
            return [
                np.full((r + 1, 2), r, dtype=np.float32),
                np.arange(2 * r * 3, dtype=np.int64).reshape(2 * r, 3) + 100 * r,
                np.array(float(r)),
            ]

        refs = [
            np.concatenate([mine(r)[0] for r in range(size)]),
            np.concatenate([mine(r)[1] for r in range(size)]),
            np.array([float(r) for r in range(size)]),
        ]
        for label, outs in [
            ("grouped_allgather", cring.grouped_allgather(mine(rank), name="gg.sync")),
            (
                "grouped_allgather_async",
                cring.synchronize(cring.grouped_allgather_async(mine(rank), name="gg.async")),
            ),
        ]:
            problems += [f"{label}[{k}]: {p}" for k in range(3) if (p := compare(outs[k], refs[k]))]
        return "; ".join(problems) or None

    checks.check("grouped allgather, different first dimensions", grouped_allgather)

    def grouped_reducescatter():
        xs = [
            np.arange(7 * 3, dtype=np.float64).reshape(7, 3) * (rank + 1),
            np.arange(5, dtype=np.int32) + rank,
        ]
        outs = cring.grouped_reducescatter(xs, op=cring.Sum, name="grs")
        problems = []
        for k, (full, n) in enumerate(
            [
                (np.arange(21, dtype=np.float64).reshape(7, 3) * total, 7),
                (np.arange(5, dtype=np.int32) * size + sum(range(size)), 5),
            ]
        ):
            rows = [n // size + (1 if r < n % size else 0) for r in range(size)]
            start = sum(rows[:rank])
            p = compare(outs[k], full[start : start + rows[rank]])
            if p:
                problems.append(f"[{k}]: {p}")
        return "; ".join(problems) or None

    checks.check("grouped reducescatter", grouped_reducescatter)

    def scaling():
        problems = []
        x = np.arange(1000, dtype=np.float32) + rank
        plain = (np.arange(1000, dtype=np.float32) * size + sum(range(size))).astype(np.float32)
        cases = {
            # prescale 2 then postscale 0.5 is the plain sum (the staged path)
            "pre 2 post 0.5": dict(prescale_factor=2.0, postscale_factor=0.5),
            # postscale alone (a single tensor runs in place, unstaged)
            "post 0.25": dict(postscale_factor=0.25),
            "pre 0.5": dict(prescale_factor=0.5),
        }
        factor = {"pre 2 post 0.5": 1.0, "post 0.25": 0.25, "pre 0.5": 0.5}
        for label, kw in cases.items():
            out = cring.allreduce(x, op=cring.Sum, name=f"scale.{label}", **kw)
            p = compare(out, (plain * factor[label]).astype(np.float32))
            if p:
                problems.append(f"allreduce {label}: {p}")
        # prescale 1/size with Sum is the average
        out = cring.allreduce(x, op=cring.Sum, prescale_factor=1.0 / size, name="scale.avg")
        p = compare(out, (plain / size).astype(np.float32), rtol=1e-6)
        if p:
            problems.append(f"allreduce prescale 1/size: {p}")
        # int32, fused with a second async tensor, and in place
        ints = np.arange(10, dtype=np.int32) * 3 + rank
        h1 = cring.allreduce_async_(
            ints, op=cring.Sum, prescale_factor=2.0, postscale_factor=0.5, name="scale.int"
        )
        h2 = cring.allreduce_async(
            np.ones(3, np.int32),
            op=cring.Sum,
            prescale_factor=2.0,
            postscale_factor=0.5,
            name="scale.int2",
        )
        cring.synchronize(h1)
        p = compare(
            ints, (np.arange(10, dtype=np.int32) * 3 * size + sum(range(size))).astype(np.int32)
        )
        if p:
            problems.append(f"int32 in place pre 2 post 0.5: {p}")
        p = compare(cring.synchronize(h2), np.full(3, size, np.int32))
        if p:
            problems.append(f"int32 fused pre 2 post 0.5: {p}")
        # grouped, and reducescatter
        outs = cring.grouped_allreduce(
            grouped_inputs(rank),
            op=cring.Sum,
            prescale_factor=2.0,
            postscale_factor=0.5,
            name="scale.grouped",
        )
        p = check_group("grouped pre 2 post 0.5", outs)
        if p:
            problems.append(p)
        y = np.arange(6 * 2, dtype=np.float32).reshape(6, 2) + rank
        out = cring.reducescatter(
            y, op=cring.Sum, prescale_factor=2.0, postscale_factor=0.5, name="scale.rs"
        )
        full = np.arange(12, dtype=np.float32).reshape(6, 2) * size + sum(range(size))
        rows = [6 // size + (1 if r < 6 % size else 0) for r in range(size)]
        start = sum(rows[:rank])
        p = compare(out, full[start : start + rows[rank]].astype(np.float32))
        if p:
            problems.append(f"reducescatter pre 2 post 0.5: {p}")
        return "; ".join(problems) or None

    checks.check("prescale / postscale with Sum", scaling)

    cring.shutdown()
    checks.finish()


if __name__ == "__main__":
    main()

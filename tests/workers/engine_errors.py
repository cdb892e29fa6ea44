"""Worker: errors of the async engine.

- A shape mismatch on one name among good async allreduces: only that
  handle raises MismatchError (on every rank, naming the tensor and the
  first disagreeing rank); the other handles are right; the next op works.
- A name submitted again while in flight raises ValueError at submission;
  the first request still completes correctly, and the name is free again
  once synchronized.

Usage: engine_errors.py OUTDIR. Writes OUTDIR/rank<R>.json; exits 1 on a failure.
"""

import sys

import numpy as np

import cring

from engine_common import Checks, compare


def main():
    cring.init()
    rank, size = cring.rank(), cring.size()
    checks = Checks(sys.argv[1], rank, size)
    offset = sum(range(size))

    # 3. One bad name among good ones, submitted async in rank-dependent order.
    def async_mismatch():
        good = {f"good.{k}": np.arange(5 + k, dtype=np.float32) + rank for k in range(6)}
        # rank 1 gives 'bad.shape' one more element; at size 3 rank 2 also
        # disagrees on 'bad.op' while ranks 0 and 1 agree.
        bad_shape = np.ones(4 + (rank == 1), dtype=np.float32)
        bad_op = np.ones(4, dtype=np.float64)
        submit = [
            (n, (lambda x=x, n=n: cring.allreduce_async(x, op=cring.Sum, name=n)))
            for n, x in good.items()
        ]
        submit.insert(
            3,
            ("bad.shape", lambda: cring.allreduce_async(bad_shape, op=cring.Sum, name="bad.shape")),
        )
        if size >= 3:
            submit.insert(
                5,
                (
                    "bad.op",
                    lambda: cring.allreduce_async(
                        bad_op, op=cring.Max if rank == 2 else cring.Sum, name="bad.op"
                    ),
                ),
            )
        if rank == 1:
            submit.reverse()
        handles = {n: fn() for n, fn in submit}
        problems = []
        expected = {
            "bad.shape": ("rank 0 vs rank 1", "shape float32 [4] vs float32 [5]"),
            "bad.op": ("rank 0 vs rank 2", "op sum vs max"),
        }
        for n, h in handles.items():
            if n in expected:
                try:
                    cring.synchronize(h)
                except cring.MismatchError as e:
                    msg = str(e)
                    print(f"{n}: MismatchError: {msg}", flush=True)
                    for part in (f"'{n}'", *expected[n]):
                        if part not in msg:
                            problems.append(f"{n}: {part!r} not in message {msg!r}")
                else:
                    problems.append(f"{n}: synchronize did not raise MismatchError")
                if not cring.poll(h):
                    problems.append(f"{n}: poll() is False after the error")
            else:
                k = int(n.split(".")[1])
                ref = (np.arange(5 + k, dtype=np.float32) * size + offset).astype(np.float32)
                problem = compare(cring.synchronize(h), ref)
                if problem:
                    problems.append(f"{n}: {problem}")
        # the communicator stays usable, and a failed name can be used again
        after = cring.allreduce(np.full(3, rank, dtype=np.int64), op=cring.Sum, name="bad.shape")
        problem = compare(after, np.full(3, offset, dtype=np.int64))
        if problem:
            problems.append(f"op after the mismatch: {problem}")
        return "; ".join(problems) or None

    checks.check("async mismatch among good ops", async_mismatch)

    # 4. Duplicate in-flight names. Rank `owner` submits 'dup.<owner>' and
    # submits it again before the others can have submitted theirs: they only
    # submit after 'go.<owner>', which the owner joins after the duplicate.
    def duplicate_name():
        problems = []
        for owner in range(size):
            name = f"dup.{owner}"
            x = np.full(4, rank + 1, dtype=np.float64)
            if rank == owner:
                h = cring.allreduce_async(x, op=cring.Sum, name=name)
                try:
                    cring.allreduce_async(np.zeros(4), op=cring.Sum, name=name)
                except ValueError as e:
                    print(f"{name}: ValueError: {e}", flush=True)
                    if name not in str(e) or "in flight" not in str(e):
                        problems.append(f"{name}: unexpected message {str(e)!r}")
                else:
                    problems.append(f"{name}: second submission did not raise ValueError")
                try:  # the in-place form and other collectives check names too
                    cring.broadcast_async_(np.zeros(4), 0, name=name)
                except ValueError:
                    pass
                else:
                    problems.append(f"{name}: broadcast with the same name did not raise")
                if cring.poll(h):
                    problems.append(f"{name}: completed before the other ranks submitted it")
                cring.allreduce(np.zeros(1), name=f"go.{owner}")
            else:
                cring.allreduce(np.zeros(1), name=f"go.{owner}")
                h = cring.allreduce_async(x, op=cring.Sum, name=name)
            problem = compare(
                cring.synchronize(h), np.full(4, sum(range(1, size + 1)), dtype=np.float64)
            )
            if problem:
                problems.append(f"{name}: {problem}")
            # once synchronized, the name is free again
            again = cring.allreduce(np.full(2, rank, dtype=np.int32), op=cring.Sum, name=name)
            problem = compare(again, np.full(2, offset, dtype=np.int32))
            if problem:
                problems.append(f"{name} reused: {problem}")
        return "; ".join(problems) or None

    checks.check("duplicate in-flight name", duplicate_name)

    checks.info["errors"] = cring.engine_stats()["errors"]
    cring.shutdown()
    checks.finish()


if __name__ == "__main__":
    main()

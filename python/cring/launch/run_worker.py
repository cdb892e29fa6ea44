# The rank's side of cring.run(fn): the command every rank of such a job runs
# (python -m cring.launch.run_worker). It reads the pickled call from the
# job's rendezvous store, runs it and puts back the result or the error. The
# caller's side (and the documentation) is cring._run_api.
"""One rank of a cring.run() job: fetch fn/args/kwargs, run, report.

Store keys (job id J, the same CRING_JOB_ID as every rank sees):

    cring.run/J/call          cloudpickle of (fn, args, kwargs), set by the caller
    cring.run/J/result/R      pickled return value of rank R
    cring.run/J/errors        counter: how many ranks reported an error
    cring.run/J/error/N       the N-th error reported (1, 2, ...): a pickled dict
                              rank, type, message, traceback, exception (the
                              pickled exception, or None if it does not pickle)

Exit status: 0 after the result is stored, 1 after an error is stored, 2 when
the call cannot be read (the caller's error names it).
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback
from typing import Any

from .._elastic_protocol import StoreClient

__all__ = ["Keys", "dumps", "main"]

# The store refuses larger messages (STORE_MAX_MESSAGE_BYTES, 64 MiB) and a
# key and some framing share the message.
MAX_VALUE_BYTES = (64 << 20) - 8192


class Keys:
    def __init__(self, job_id: str) -> None:
        self.prefix = f"cring.run/{job_id}"
        self.call = f"{self.prefix}/call"
        self.errors = f"{self.prefix}/errors"

    def result(self, rank: int) -> str:
        return f"{self.prefix}/result/{rank}"

    def error(self, n: int) -> str:
        return f"{self.prefix}/error/{n}"


def dumps(obj: Any, what: str) -> bytes:
    """cloudpickle (functions and classes defined in __main__ or interactively
    are pickled by value, as Horovod does); ValueError if the store cannot take it."""
    try:
        import cloudpickle
    except ImportError as exc:  # a package dependency; say so if it is missing
        raise ImportError(
            f"cring.run needs cloudpickle to send {what}: pip install cloudpickle"
        ) from exc
    data = cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    if len(data) > MAX_VALUE_BYTES:
        raise ValueError(
            f"cring.run: {what} pickles to {len(data)} bytes, more than the "
            f"{MAX_VALUE_BYTES} the job's store carries; pass a path or load the data "
            "inside the function instead"
        )
    return data


def _error_record(rank: int, exc: BaseException) -> bytes:
    record = {
        "rank": rank,
        "type": type(exc).__name__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        "exception": None,
    }
    try:
        record["exception"] = dumps(exc, "the exception")
        pickle.loads(record["exception"])  # it must also come back
    except Exception:
        record["exception"] = None
    return pickle.dumps(record)


def main() -> int:
    env = os.environ
    rank = int(env["CRING_RANK"])
    keys = Keys(env["CRING_JOB_ID"])
    timeout_s = float(env.get("CRING_TIMEOUT_SECONDS") or 60.0)
    client = StoreClient(env["CRING_ADDR"], int(env["CRING_PORT"]), env.get("CRING_SECRET"), 60.0)
    try:
        payload = client.get(keys.call, timeout_s)
        if payload is None:
            print(f"cring.run: rank {rank}: the call was not in the store", file=sys.stderr)
            return 2
        try:
            fn, args, kwargs = pickle.loads(payload)
            result = fn(*args, **kwargs)
            # an elastic job may have given this worker another rank meanwhile
            rank = int(os.environ["CRING_RANK"])
            data = dumps(result, f"the result of rank {rank}")
        except BaseException as exc:  # noqa: BLE001  (reported to the caller, who raises it)
            traceback.print_exc()
            n = client.add(keys.errors, 1)
            client.set(keys.error(n), _error_record(rank, exc))
            return 1
        client.set(keys.result(rank), data)
        return 0
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main())

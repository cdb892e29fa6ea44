# What `cringrun --elastic` (cring/launch/elastic_driver.py) and its workers
# (cring/elastic.py) agree on: a client of the rendezvous store, the store keys
# of one elastic job and the generation records. Stdlib and cring._C only.
"""The elastic protocol between the launcher and its workers (see docs/elastic.md).

The launcher publishes generation records under `Keys.generation(g)` and the
number of the newest one under `Keys.latest`; workers announce themselves
with `Keys.joined`/`Keys.formed` and ask for a new generation through
`Keys.request_count`/`Keys.request(n)`. Both sides reach the store through
`StoreClient`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from . import _C

__all__ = ["Keys", "StoreClient", "make_final_record", "make_record"]


class StoreClient:
    """A blocking client of cring's rendezvous store (set/get/add/wait; the C
    core's own protocol and authentication) with the job secret; every
    failure is a ConnectionError."""

    def __init__(self, addr: str, port: int, secret: str | None, timeout_s: float) -> None:
        try:
            self._c = _C.StoreClient(addr, int(port), secret, float(timeout_s))
        except _C.CRingError as exc:
            raise ConnectionError(str(exc)) from None

    def close(self) -> None:
        self._c.close()

    def abort(self) -> None:
        """From another thread: a call blocked in this client fails at once."""
        self._c.interrupt()

    def _do(self, method: str, *args: Any) -> Any:
        try:
            return getattr(self._c, method)(*args)
        except _C.CRingError as exc:
            raise ConnectionError(str(exc)) from None

    def set(self, key: str, value: bytes) -> None:
        self._do("set", key, value)

    def get(self, key: str, timeout_s: float) -> bytes | None:
        """The value of key once it exists; None if it did not appear in time."""
        return self._do("get", key, float(timeout_s))

    def add(self, key: str, delta: int) -> int:
        return self._do("add", key, int(delta))

    def wait(self, keys: Iterable[str], timeout_s: float) -> bool:
        """True once every key exists; False if not all did within timeout_s."""
        keys = list(keys)
        return True if not keys else self._do("wait", keys, float(timeout_s))


class Keys:
    """Store keys of one elastic job (all under '<job id>/elastic/')."""

    def __init__(self, job_id: str) -> None:
        self.prefix = f"{job_id}/elastic"

    def generation(self, g: int) -> str:
        """The record of generation g (JSON, see make_record)."""
        return f"{self.prefix}/gen/{g}"

    @property
    def latest(self) -> str:
        """The number of the newest generation formed (decimal text)."""
        return f"{self.prefix}/latest"

    def joined(self, g: int, worker: int) -> str:
        """Set by a worker carried over into generation g once it has left the previous one."""
        return f"{self.prefix}/joined/{g}/{worker}"

    def formed(self, g: int) -> str:
        """Set by the workers carried over into generation g once cring is initialised in it."""
        return f"{self.prefix}/formed/{g}"

    @property
    def request_count(self) -> str:
        return f"{self.prefix}/requests"

    def request(self, n: int) -> str:
        """The n-th request (from 1) of a worker for a new generation (JSON)."""
        return f"{self.prefix}/request/{n}"


def make_record(
    generation: int, workers: list[int], added: Iterable[int] = (), reason: str = ""
) -> bytes:
    """A generation record: `workers` in rank order; `added` were started for it."""
    return json.dumps(
        {
            "generation": generation,
            "size": len(workers),
            "ranks": {str(w): r for r, w in enumerate(workers)},
            "added": sorted(added),
            "reason": reason,
        }
    ).encode()


def make_final_record(generation: int, reason: str) -> bytes:
    """Stored where generation `generation` would go: no generation follows."""
    return json.dumps({"generation": generation, "finished": True, "reason": reason}).encode()

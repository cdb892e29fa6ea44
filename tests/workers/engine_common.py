"""Helpers shared by the engine_*.py workers: run labelled checks, collect
failures instead of stopping at the first, and write <outdir>/rank<R>.json."""

from __future__ import annotations

import json
import sys
import traceback
from typing import Any, Callable, Optional

import numpy as np


class Checks:
    """Runs named checks; a check returns None when fine, else a description."""

    def __init__(self, outdir: str, rank: int, size: int):
        self.outdir = outdir
        self.rank = rank
        self.size = size
        self.cases = 0
        self.failures: list[str] = []
        self.info: dict[str, Any] = {}

    def check(self, label: str, fn: Callable[[], Optional[str]]) -> None:
        self.cases += 1
        try:
            problem = fn()
        except Exception:
            problem = traceback.format_exc(limit=4)
        if problem:
            self.failures.append(f"{label}: {problem}")
            print(f"FAIL {label}: {problem}", flush=True)

    def finish(self) -> None:
        """Write the result file and exit non-zero when any check failed."""
        result = {
            "rank": self.rank,
            "size": self.size,
            "cases": self.cases,
            "failures": self.failures,
            **self.info,
        }
        with open(f"{self.outdir}/rank{self.rank}.json", "w") as f:
            json.dump(result, f)
        print(f"rank {self.rank}: {self.cases} checks, {len(self.failures)} failed", flush=True)
        sys.exit(1 if self.failures else 0)


def compare(got: Any, ref: np.ndarray, rtol: float = 0.0, atol: float = 0.0) -> Optional[str]:
    """None when `got` matches `ref` (exactly, or within tolerances), else what differs."""
    got = np.asarray(got)
    if got.shape != ref.shape:
        return f"shape {got.shape} != expected {ref.shape}"
    if got.dtype != ref.dtype:
        return f"dtype {got.dtype} != expected {ref.dtype}"
    g, r = got.astype(np.float64), ref.astype(np.float64)
    ok = np.isclose(g, r, rtol=rtol, atol=atol) if (rtol or atol) else (g == r)
    if ok.all():
        return None
    bad = np.flatnonzero(~ok.ravel())
    i = int(bad[0])
    return (
        f"{len(bad)} of {got.size} elements wrong, first at {i}: got {g.ravel()[i]!r} "
        f"expected {r.ravel()[i]!r}"
    )

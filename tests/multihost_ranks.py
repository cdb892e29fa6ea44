"""Start a job's ranks directly on simulated hosts (tests/simhosts.py), with a
hard timeout, and collect what each rank wrote to <outdir>/rank<R>.json.

Used by tests/test_multihost.py and benchmarks/multihost.py. Ranks are started
with CRING_RANK/CRING_SIZE/CRING_ADDR/CRING_PORT (rank 0 serves the store on
loopback), not through cringrun, so the C side is tested on its own; the
launcher's own multi-host tests go through cringrun -H.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).parent))
from simhosts import SimHosts  # noqa: E402

from ports import free_port  # noqa: E402

WORKERS = Path(__file__).parent / "workers"


def placement(nhosts: int, per_host: int, layout="block") -> list[int]:
    """Host index of every rank: 'block' (ranks 0..L-1 on host 0, ...),
    'cyclic' (rank r on host r % nhosts), or a list of host indices."""
    if isinstance(layout, (list, tuple)):
        return list(layout)
    size = nhosts * per_host
    if layout == "cyclic":
        return [r % nhosts for r in range(size)]
    return [r // per_host for r in range(size)]


class Job:
    """One job's ranks on simulated hosts. `with Job(hosts, 2, 2, argv, outdir)`
    starts them; `wait()` waits with a hard timeout (killing everything when it
    passes); `kill(rank)` kills one rank; `results()` reads the rank files."""

    def __init__(
        self,
        hosts: SimHosts,
        per_host: int,
        argv: Sequence[str],
        outdir: Path,
        env: Optional[dict] = None,
        layout="block",
        timeout_s: float = 30.0,
    ):
        self.hosts = hosts
        self.outdir = Path(outdir)
        self.outdir.mkdir(parents=True, exist_ok=True)
        self.where = placement(len(hosts.names), per_host, layout)
        self.size = len(self.where)
        port = free_port()
        self.procs: list[subprocess.Popen] = []
        for rank, h in enumerate(self.where):
            full = dict(os.environ)
            full.update(
                {
                    "CRING_RANK": str(rank),
                    "CRING_SIZE": str(self.size),
                    "CRING_ADDR": "127.0.0.1",
                    "CRING_PORT": str(port),
                    "CRING_TIMEOUT_SECONDS": str(timeout_s),
                }
            )
            for k in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID", "RANK", "WORLD_SIZE"):
                full.pop(k, None)
            if env:
                full.update(env)
            log = open(self.outdir / f"rank{rank}.log", "w")
            self.procs.append(
                hosts.popen(
                    hosts.names[h],
                    [sys.executable, *argv],
                    env=full,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                )
            )
            log.close()

    def kill(self, rank: int) -> None:
        self.procs[rank].kill()

    def wait(self, timeout_s: float) -> list[Optional[int]]:
        """Exit codes of every rank; ranks still running after timeout_s are
        killed and reported as None."""
        deadline = time.monotonic() + timeout_s
        codes: list[Optional[int]] = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        return codes

    def logs(self) -> str:
        parts = []
        for r in range(self.size):
            path = self.outdir / f"rank{r}.log"
            text = path.read_text(errors="replace") if path.exists() else ""
            parts.append(f"--- rank {r} ---\n{text[-3000:]}")
        return "\n".join(parts)

    def results(self) -> list[Optional[dict]]:
        out = []
        for r in range(self.size):
            path = self.outdir / f"rank{r}.json"
            out.append(json.loads(path.read_text()) if path.exists() else None)
        return out

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)


def run(
    nhosts: int,
    per_host: int,
    worker: str,
    args: Sequence[str],
    outdir: Path,
    env: Optional[dict] = None,
    layout="block",
    timeout_s: float = 120.0,
    cring_timeout_s: float = 30.0,
) -> tuple[list[Optional[int]], list[Optional[dict]], str]:
    """Run tests/workers/<worker> on nhosts x per_host ranks; returns the exit
    codes (None: killed at the timeout), the rank files and the ranks' logs."""
    names = [f"host{chr(ord('A') + i)}" for i in range(nhosts)]
    with SimHosts(names) as hosts:
        with Job(
            hosts,
            per_host,
            [str(WORKERS / worker), *args],
            outdir,
            env=env,
            layout=layout,
            timeout_s=cring_timeout_s,
        ) as job:
            codes = job.wait(timeout_s)
            return codes, job.results(), job.logs()

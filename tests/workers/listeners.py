"""Worker for tests/test_security.py: join the job, check an allreduce, then
record every TCP socket this process and its parent (the launcher, when there
is one) hold: listening and connected, with their local addresses, read from
/proc/<pid>/fd and /proc/net/tcp{,6}. Writes OUT_DIR/rank<R>.json.

Usage: listeners.py OUT_DIR"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import numpy as np

import cring

LISTEN = "0A"


def _addr(hex_addr: str) -> tuple[str, int]:
    host, port = hex_addr.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        ip = socket.inet_ntop(socket.AF_INET, raw[::-1])
    else:  # four little-endian 32-bit words
        words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
        ip = socket.inet_ntop(socket.AF_INET6, words)
    return ip, int(port, 16)


def tcp_sockets(pid: int) -> list[dict]:
    """The TCP sockets process `pid` has open."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        return []
    found = []
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[9] in inodes:
                ip, port = _addr(f[1])
                found.append({"local": ip, "port": port, "listening": f[3] == LISTEN})
    return found


def main() -> None:
    out = Path(sys.argv[1])
    cring.init()
    x = np.full(100, 1.0, np.float32)
    cring.allreduce_(x, op=cring.Sum)
    assert (x == cring.size()).all()
    report = {
        "rank": cring.rank(),
        "transport": cring.transport(),
        "self": tcp_sockets(os.getpid()),
        "parent": tcp_sockets(os.getppid()),
        "store_port": int(os.environ.get("CRING_PORT", "0") or 0),
    }
    cring.barrier()  # every rank has looked before any closes its connections
    cring.shutdown()
    (out / f"rank{report['rank']}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()

"""Ports for servers that tests start (rendezvous stores, MASTER_PORT), unique
across every process on this machine that takes them here: pytest-xdist's
workers, other checkouts' suites running at the same time. No pytest import:
benchmarks/ and tests/multihost_ranks.py use it too."""

from __future__ import annotations

import fcntl
import os
import random
import socket
from typing import Optional

# One byte of this file per port, locked (fcntl record lock) by the process
# that was handed the port: every test process on the machine (xdist workers,
# other checkouts' suites) that asks free_port() skips ports another one holds.
# The kernel drops a process's locks when it exits, so nothing is left to
# clean up; the file itself is empty.
PORT_LOCK_FILE = os.environ.get("CRING_TEST_PORT_LOCKS", "/tmp/cring-test-ports.lock")
_port_lock_fd: Optional[int] = None
_PORTS_GIVEN: set = set()


def _port_locks() -> Optional[int]:
    global _port_lock_fd
    if _port_lock_fd is None:
        try:
            _port_lock_fd = os.open(PORT_LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except OSError:  # e.g. another user's file: ports are then unique within this process
            _port_lock_fd = -1
    return _port_lock_fd if _port_lock_fd >= 0 else None


def free_port(lo: int = 15000, hi: Optional[int] = None) -> int:
    """A port for a server a test starts later. Taken from below the kernel's
    ephemeral range (where port 0 would land): there, an outgoing
    connection's source port cannot take it between this check and the
    server's listen ("Address already in use" failed a Lightning test once).
    Never the same port twice in one process, and never one that another
    process using free_port() (an xdist worker, another suite on this
    machine) holds: each port handed out stays locked in PORT_LOCK_FILE until
    this process exits. [lo, hi): the range tried (hi: the ephemeral range's
    start, at most 32768); when all of it is taken, a port the kernel picks."""
    if hi is None:
        try:
            with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
                ephemeral_lo = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            ephemeral_lo = 32768
        hi = max(lo + 1, min(ephemeral_lo, 32768))
    locks = _port_locks()
    for _ in range(2000):
        port = random.randrange(lo, hi)
        if port in _PORTS_GIVEN:
            continue
        if locks is not None:
            try:
                fcntl.lockf(locks, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, port, os.SEEK_SET)
            except OSError:  # another process was handed it
                continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                if locks is not None:
                    fcntl.lockf(locks, fcntl.LOCK_UN, 1, port, os.SEEK_SET)
                continue
        _PORTS_GIVEN.add(port)
        return port
    with socket.socket() as s:  # every try was taken: let the kernel choose
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

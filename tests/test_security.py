"""Rendezvous security (issue 9, item 3): every connection to the store must
prove the job secret (HMAC-SHA256 of a fresh nonce), a wrong or missing secret
is refused at once (not after a time-out), and a single-host job keeps its
store and its TCP connections on loopback. Processes run with hard timeouts.

The store's wire handshake is re-implemented here from its description in
csrc/bootstrap/store_protocol.h, so that the tests speak to it as a stranger would."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import shutil
import socket
import struct
import subprocess
import sys
from typing import Optional

import pytest

from cring import _C

from conftest import WORKERS, rank_results, run_ranks
from test_bootstrap import clean_env, free_port

TIMEOUT_S = 120


# ---- a minimal store client --------------------------------------------------------


def recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError(f"closed after {len(data)} of {n} bytes")
        data += chunk
    return data


def answer(secret: Optional[str], nonce: bytes) -> bytes:
    return b"CRS1" + hmac.new((secret or "").encode(), nonce, hashlib.sha256).digest()


def handshake(
    port: int, secret: Optional[str], forged: Optional[bytes] = None
) -> tuple[socket.socket, int, bytes]:
    """Connect, answer the nonce (or send `forged`); return (socket, verdict, nonce)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    hello = recv_exact(sock, 20)
    assert hello[:4] == b"CRS1"
    nonce = hello[4:]
    sock.sendall(forged if forged is not None else answer(secret, nonce))
    verdict = recv_exact(sock, 1)[0]
    return sock, verdict, nonce


def closed_by_server(sock: socket.socket) -> bool:
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def store_set(sock: socket.socket, key: bytes, value: bytes) -> int:
    body = b"\x01" + struct.pack("<I", len(key)) + key + value
    sock.sendall(struct.pack("<I", len(body)) + body)
    length, status = struct.unpack("<IB", recv_exact(sock, 5))
    recv_exact(sock, length - 1)
    return status


def store_get(sock: socket.socket, key: bytes, timeout_ms: int = 1000) -> tuple[int, bytes]:
    body = b"\x02" + struct.pack("<QI", timeout_ms, len(key)) + key
    sock.sendall(struct.pack("<I", len(body)) + body)
    length, status = struct.unpack("<IB", recv_exact(sock, 5))
    return status, recv_exact(sock, length - 1)


@pytest.fixture
def store():
    server = _C.StoreServer("127.0.0.1", 0, "job-secret")
    yield server
    server.stop()


# ---- authentication --------------------------------------------------------------------


def test_right_secret_is_served(store):
    """The control case: the handshake as written here is the real one."""
    sock, verdict, _ = handshake(store.port, "job-secret")
    assert verdict == 0
    assert store_set(sock, b"k", b"v") == 0
    assert store_get(sock, b"k") == (0, b"v")
    sock.close()


@pytest.mark.parametrize("secret", ["wrong", "", None, "job-secret ", "JOB-SECRET", "job-secre"])
def test_wrong_or_missing_secret_is_refused(store, secret):
    sock, verdict, _ = handshake(store.port, secret)
    assert verdict == 1
    assert closed_by_server(sock)
    sock.close()


def test_replayed_and_garbled_answers_are_refused(store):
    # an answer overheard on one connection is useless on the next (new nonce)
    first, verdict, nonce = handshake(store.port, "job-secret")
    assert verdict == 0
    first.close()
    sock, verdict, _ = handshake(store.port, None, forged=answer("job-secret", nonce))
    assert verdict == 1 and closed_by_server(sock)
    sock.close()
    # right MAC, wrong magic; and a bit flipped in the MAC
    sock = socket.create_connection(("127.0.0.1", store.port), timeout=10)
    good = answer("job-secret", recv_exact(sock, 20)[4:])
    sock.sendall(b"XRS1" + good[4:])
    assert recv_exact(sock, 1) == b"\x01" and closed_by_server(sock)
    sock.close()
    sock = socket.create_connection(("127.0.0.1", store.port), timeout=10)
    good = bytearray(answer("job-secret", recv_exact(sock, 20)[4:]))
    good[-1] ^= 1
    sock.sendall(bytes(good))
    assert recv_exact(sock, 1) == b"\x01" and closed_by_server(sock)
    sock.close()


def test_requests_before_authentication_are_not_served(store):
    """A request sent in place of the handshake is taken as a (wrong) answer:
    nothing is stored, and the connection is closed."""
    sock = socket.create_connection(("127.0.0.1", store.port), timeout=10)
    recv_exact(sock, 20)
    body = b"\x01" + struct.pack("<I", 6) + b"stolen" + b"x" * 40
    sock.sendall(struct.pack("<I", len(body)) + body)
    assert recv_exact(sock, 1) == b"\x01" and closed_by_server(sock)
    sock.close()
    ok, verdict, _ = handshake(store.port, "job-secret")
    assert verdict == 0
    assert store_get(ok, b"stolen", timeout_ms=0)[0] == 1  # TIMEOUT: never set
    ok.close()


WRONG_SECRET_RANK = r"""
import sys, time, cring
t0 = time.monotonic()
try:
    cring.init(rank=int(sys.argv[1]), size=2, addr="127.0.0.1", port=int(sys.argv[2]),
               secret=sys.argv[3] or None, timeout_s=float(sys.argv[4]))
except cring.CRingError as e:
    print(f"RAISED {type(e).__name__} after {time.monotonic() - t0:.2f}s: {e}", flush=True)
    sys.exit(0)
print("JOINED", flush=True)
sys.exit(1)
"""


@pytest.mark.parametrize("secret", ["not-the-secret", ""])
def test_init_with_wrong_secret_raises_at_once(store, secret):
    """cring.init() with a secret the store does not accept raises CRingError
    naming the secret within seconds, although its time-out is 60 s."""
    proc = subprocess.run(
        [sys.executable, "-c", WRONG_SECRET_RANK, "1", str(store.port), secret, "60"],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "RAISED CRingError" in proc.stdout, proc.stdout
    assert "secret" in proc.stdout
    took = float(proc.stdout.split(" after ")[1].split("s:")[0])
    assert took < 10.0, proc.stdout


def test_job_with_one_wrong_secret_fails_on_every_rank():
    """Rank 0 serves the store with one secret, rank 1 brings another: rank 1
    is refused at once; rank 0 gives up after its time-out. Nobody hangs."""
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WRONG_SECRET_RANK, str(r), port, s, "3"],
            env=clean_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r, s in ((0, "secret-a"), (1, "secret-b"))
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=TIMEOUT_S))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail("a rank hung on a refused rendezvous")
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out + err[-3000:]
    assert "RAISED CRingError" in outs[1][0] and "secret" in outs[1][0], outs[1]
    assert "RAISED TimeoutError" in outs[0][0], outs[0]


# ---- loopback for single-host jobs -------------------------------------------------------


def is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    if addr.version == 6 and addr.ipv4_mapped:
        addr = addr.ipv4_mapped
    return addr.is_loopback


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_cringrun_store_and_connections_stay_on_loopback(tmp_path, transport):
    """cringrun serves the store on 127.0.0.1 only, and every socket the
    ranks hold (store client, TCP transport) is on loopback."""
    run_ranks(
        2,
        "listeners.py",
        str(tmp_path),
        env=clean_env(CRING_TRANSPORT=transport),
        timeout=TIMEOUT_S,
    )
    reports = rank_results(tmp_path, 2)
    store_port = reports[0]["store_port"]
    launcher_listening = [s for s in reports[0]["parent"] if s["listening"]]
    assert any(s["port"] == store_port for s in launcher_listening), reports[0]["parent"]
    for s in launcher_listening:
        assert is_loopback(s["local"]), f"the launcher listens on {s['local']}:{s['port']}"
    for r in reports:
        assert r["transport"] == ("shm" if transport == "auto" else "tcp")
        assert r["self"], "the rank holds no TCP socket (not even its store client)?"
        for s in r["self"]:
            assert is_loopback(s["local"]), f"rank {r['rank']} has a socket on {s['local']}"
        if transport == "tcp":  # a store client plus one connection to the peer
            assert len([s for s in r["self"] if not s["listening"]]) >= 2, r["self"]


def test_rank0_store_without_address_is_loopback(tmp_path):
    """Under mpirun without an address (and without mpi4py), rank 0 chooses
    where to serve the store itself: loopback on a single host."""
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("Open MPI's mpirun is not installed")
    blocker = tmp_path / "nompi"
    (blocker / "mpi4py").mkdir(parents=True)
    (blocker / "mpi4py" / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    out = tmp_path / "out"
    out.mkdir()
    env = clean_env(PYTHONPATH=str(blocker))
    cmd = [
        mpirun,
        "--allow-run-as-root",
        "--oversubscribe",
        "-np",
        "2",
        "-x",
        "PYTHONPATH",
        sys.executable,
        str(WORKERS / "listeners.py"),
        str(out),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    reports = rank_results(out, 2)
    listening = [s for s in reports[0]["self"] if s["listening"]]
    assert listening, "rank 0 should serve the store"
    for r in reports:
        for s in r["self"]:
            assert is_loopback(s["local"]), f"rank {r['rank']} has a socket on {s['local']}"

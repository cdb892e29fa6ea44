"""Hostile traffic at a live rendezvous store (issue 9, items 3 and 4): while a
real 2-rank job joins and leaves ten times through the store (alternating
shared memory and TCP), fuzzer threads send it random bytes, wrong and
replayed handshakes, malformed, truncated and oversized requests, idle and
trickling connections, and bursts of connections. The job must finish with
correct results, the store must keep answering a legitimate client quickly,
and the fuzzing must really have overlapped the job.

CRING_FUZZ_SEED replays the fuzzer's choices (default: a fresh seed, printed
on failure). The C harness csrc/tests/test_fuzz.c goes deeper, under ASan."""

from __future__ import annotations

import os
import random
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest

from cring import _C

from conftest import WORKERS
from test_bootstrap import clean_env
from test_security import answer, handshake, recv_exact, store_get, store_set

SECRET = "fuzzed-job-secret"
ROUNDS = 10
JOB_TIMEOUT_S = 240
MAX_MESSAGE = 64 << 20


class Fuzzer:
    """Threads that attack the store at `port` until stop() is called."""

    def __init__(self, port: int, seed: int, threads: int = 4):
        self.port, self.seed = port, seed
        self.stop_event = threading.Event()
        self.counts: dict[str, int] = {}
        self.errors: list[str] = []
        self.lock = threading.Lock()
        self.threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)
        ]
        self.held: list[socket.socket] = []  # idle or half-sent connections left open

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def stop(self) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(timeout=30)
        for s in self.held:
            s.close()

    def _count(self, kind: str) -> None:
        with self.lock:
            self.counts[kind] = self.counts.get(kind, 0) + 1

    def _connect(self) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=5)
        s.settimeout(5)
        return s

    def _run(self, index: int) -> None:
        rng = random.Random(self.seed * 1000 + index)
        cases = [
            self.random_bytes,
            self.wrong_handshake,
            self.malformed_request,
            self.oversized_request,
            self.slow_or_idle,
            self.burst,
        ]
        weights = [3, 3, 4, 1, 1, 1]
        while not self.stop_event.is_set():
            case = rng.choices(cases, weights)[0]
            try:
                case(rng)
            except (OSError, ConnectionError):
                pass  # the store is entitled to close on us at any point
            except Exception as e:  # a wrong reply: reported by the test
                with self.lock:
                    self.errors.append(f"{case.__name__}: {e!r}")

    # ---- the cases ----------------------------------------------------------------
    def random_bytes(self, rng: random.Random) -> None:
        """Bytes instead of a handshake (sometimes before the greeting is read)."""
        with self._connect() as s:
            read_greeting = rng.random() < 0.5
            if read_greeting:
                recv_exact(s, 20)
            s.sendall(rng.randbytes(rng.choice([1, 35, 36, 37, 100, 4096, 70000])))
            s.shutdown(socket.SHUT_WR)
            reply = drain(s)
            if not read_greeting:
                assert reply[:4] == b"CRS1", reply[:16]
                reply = reply[20:]
            # whatever was sent, an unauthenticated peer gets at most a refusal
            assert reply in (b"", b"\x01"), reply[:16]
        self._count("random_bytes")

    def wrong_handshake(self, rng: random.Random) -> None:
        secret = rng.choice([None, "", "wrong", SECRET + "x", SECRET[:-1]])
        s, verdict, nonce = handshake(self.port, secret)
        with s:
            assert verdict == 1, "a wrong secret was accepted"
            assert drain(s) == b""
        # a replay of a valid answer to an old nonce
        s, verdict, _ = handshake(self.port, None, forged=answer(SECRET, nonce))
        with s:
            assert verdict == 1, "a replayed answer was accepted"
        self._count("wrong_handshake")

    def malformed_request(self, rng: random.Random) -> None:
        """An authenticated client sending broken requests: unknown opcodes,
        key lengths past the end, trailing bytes, truncated messages."""
        s, verdict, _ = handshake(self.port, SECRET)
        with s:
            assert verdict == 0
            key = b"fuzz/" + rng.randbytes(rng.randrange(0, 12))
            kind = rng.randrange(5)
            if kind == 0:
                body = bytes([rng.choice([0, 5, 6, 99, 255])]) + rng.randbytes(rng.randrange(20))
            elif kind == 1:  # GET whose key length points past the message
                body = b"\x02" + struct.pack("<QI", 10, len(key) + rng.randrange(1, 5000)) + key
            elif kind == 2:  # ADD with a short delta
                body = b"\x03" + struct.pack("<I", len(key)) + key + b"\x01\x02"
            elif kind == 3:  # WAIT claiming more keys than it carries
                body = b"\x04" + struct.pack("<QI", 10, 1000) + struct.pack("<I", 3) + b"abc"
            else:  # a valid SET with its last bytes cut off, then the connection dropped
                body = b"\x01" + struct.pack("<I", len(key)) + key + b"value"
                s.sendall(struct.pack("<I", len(body) + 10) + body)
                self._count("malformed_request")
                return
            s.sendall(struct.pack("<I", len(body)) + body)
            s.shutdown(socket.SHUT_WR)
            reply = drain(s)
            assert reply == b"", f"a malformed request got a reply {reply[:16]!r}"
        self._count("malformed_request")

    def oversized_request(self, rng: random.Random) -> None:
        s, verdict, _ = handshake(self.port, SECRET)
        with s:
            assert verdict == 0
            if rng.random() < 0.5:  # over the limit: closed at once
                s.sendall(struct.pack("<IB", rng.choice([MAX_MESSAGE + 1, 0xFFFFFFFF]), 1))
                assert drain(s) == b""
            else:  # announces the maximum, sends 1 MiB, then leaves
                s.sendall(struct.pack("<IB", MAX_MESSAGE, 1) + bytes(1 << 20))
        self._count("oversized_request")

    def slow_or_idle(self, rng: random.Random) -> None:
        """Connections that never finish: silent, mid-handshake, or an
        authenticated request trickled out a byte at a time and abandoned."""
        s = self._connect()
        kind = rng.randrange(3)
        if kind == 1:
            recv_exact(s, 20)
            s.sendall(b"CRS1" + rng.randbytes(10))
        elif kind == 2:
            s.close()
            s, verdict, _ = handshake(self.port, SECRET)
            assert verdict == 0
            body = b"\x01" + struct.pack("<I", 4) + b"slow" + b"v" * 50
            for byte in (struct.pack("<I", len(body)) + body)[:30]:
                s.send(bytes([byte]))
                time.sleep(0.002)
        with self.lock:
            self.held.append(s)
            if len(self.held) > 100:
                self.held.pop(0).close()
        self._count("slow_or_idle")

    def burst(self, rng: random.Random) -> None:
        socks = [self._connect() for _ in range(rng.randrange(20, 100))]
        for s in socks:
            s.close()
        self._count("burst")


def drain(s: socket.socket, limit_s: float = 5.0) -> bytes:
    """Everything the store sends until it closes (or limit_s passes)."""
    data = b""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            break
        except socket.timeout:
            break
        if not chunk:
            break
        data += chunk
    return data


def legitimate_round_trip(port: int) -> float:
    t0 = time.monotonic()
    s, verdict, _ = handshake(port, SECRET)
    with s:
        assert verdict == 0
        assert store_set(s, b"check/key", b"still here") == 0
        assert store_get(s, b"check/key") == (0, b"still here")
    return time.monotonic() - t0


def test_job_completes_while_store_is_fuzzed():
    seed = int(os.environ.get("CRING_FUZZ_SEED") or random.SystemRandom().randrange(2**31))
    server = _C.StoreServer("127.0.0.1", 0, SECRET)
    fuzzer = Fuzzer(server.port, seed)
    procs = []
    try:
        fuzzer.start()
        time.sleep(0.2)  # the fuzzers are already at it when the ranks arrive
        before = dict(fuzzer.counts)
        for r in range(2):
            env = clean_env(
                CRING_RANK=str(r),
                CRING_SIZE="2",
                CRING_ADDR="127.0.0.1",
                CRING_PORT=str(server.port),
                CRING_SECRET=SECRET,
                CRING_STORE_EXTERNAL="1",
                CRING_JOB_ID=f"fuzzed-{seed}",
            )
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(WORKERS / "rendezvous_rounds.py"), str(ROUNDS)],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        outs = []
        for p in procs:
            try:
                outs.append(p.communicate(timeout=JOB_TIMEOUT_S))
            except subprocess.TimeoutExpired:
                pytest.fail(f"the job hung while the store was fuzzed (seed {seed})")
        during = {k: fuzzer.counts.get(k, 0) - before.get(k, 0) for k in fuzzer.counts}
        # while the fuzzers are still going, a legitimate client is served promptly
        took = legitimate_round_trip(server.port)
    finally:
        fuzzer.stop()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r} failed (fuzz seed {seed}):\n{out}\n{err[-4000:]}"
        assert f"ROUNDS OK {r} {ROUNDS}" in out
    assert not fuzzer.errors, f"the store misbehaved (seed {seed}): {fuzzer.errors[:5]}"
    total = sum(during.values())
    print(
        f"fuzz cases during the job: {total} {during}; legitimate round trip {took:.3f} s "
        f"(seed {seed})"
    )
    assert total >= 50 and all(
        during.get(k, 0) > 0 for k in ("random_bytes", "wrong_handshake", "malformed_request")
    )
    assert took < 2.0
    assert legitimate_round_trip(server.port) < 2.0
    server.stop()

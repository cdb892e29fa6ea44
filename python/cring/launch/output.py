# The output pump of cringrun: relays every rank's stdout/stderr to the
# launcher's own streams as whole lines with a rank prefix. Knows nothing of
# processes or signals; only of pipes and sinks.
"""Output relay of cringrun: whole lines, prefixed with the rank."""

from __future__ import annotations

import os
import selectors
import threading
import time
from dataclasses import dataclass
from typing import IO

_READ_CHUNK_BYTES = 1 << 16
_MAX_PENDING_LINE_BYTES = 1 << 20


class Sink:
    """One of the launcher's own output streams, written whole chunks at a time.

    The lock makes every write() appear in one piece relative to the others, so
    lines of different ranks (and the launcher's messages) never mix. A stream
    that fails (closed pipe) is marked broken and further output is dropped;
    the ranks' pipes are still drained so that no rank blocks.
    """

    def __init__(self, stream: IO[str]) -> None:
        self._text = stream
        self._binary: IO[bytes] | None = getattr(stream, "buffer", None)
        self._lock = threading.Lock()
        self._broken = False

    def write(self, data: bytes) -> None:
        if not data:
            return
        with self._lock:
            if self._broken:
                return
            try:
                if self._binary is not None:
                    self._text.flush()  # keep order with anything written as text
                    self._binary.write(data)
                    self._binary.flush()
                else:  # a text-only stream (e.g. a StringIO standing in for stdout)
                    self._text.write(data.decode("utf-8", errors="replace"))
                    self._text.flush()
            except (OSError, ValueError):
                self._broken = True


class LineBuffer:
    """Turns the byte stream of one rank's pipe into whole prefixed lines."""

    def __init__(self, prefix: bytes, max_pending_bytes: int = _MAX_PENDING_LINE_BYTES) -> None:
        self._prefix = prefix
        self._max_pending_bytes = max_pending_bytes
        self._pending = bytearray()

    def feed(self, chunk: bytes) -> bytes:
        """Add bytes read from the pipe; return the output ready to be written."""
        self._pending += chunk
        end = self._pending.rfind(b"\n") + 1
        out = b""
        if end:
            out = self._format(bytes(self._pending[:end]))
            del self._pending[:end]
        if len(self._pending) > self._max_pending_bytes:
            out += self._format_partial(bytes(self._pending))
            self._pending.clear()
        return out

    def finish(self) -> bytes:
        """At end of stream: return what is left (a final line without newline)."""
        out = self._format_partial(bytes(self._pending))
        self._pending.clear()
        return out

    def _format(self, lines: bytes) -> bytes:
        # lines ends with b"\n"; put the prefix in front of each of them.
        if not self._prefix:
            return lines
        return self._prefix + lines[:-1].replace(b"\n", b"\n" + self._prefix) + b"\n"

    def _format_partial(self, data: bytes) -> bytes:
        # data has no newline. With a prefix the line is terminated so that the
        # next rank's line starts on a line of its own; without, bytes pass as is.
        if not data or not self._prefix:
            return data
        return self._prefix + data + b"\n"


@dataclass
class Stream:
    rank: int
    pipe: IO[bytes]
    sink: Sink
    lines: LineBuffer


class OutputPump:
    """A thread that relays every rank's stdout and stderr pipes to the sinks.

    It reads whatever is available from any pipe (selectors), so a rank that
    writes a lot never blocks on a full pipe while the launcher waits on
    another one. Writing happens in this thread too, so a slow consumer of the
    launcher's output never delays signal handling in the main thread.
    """

    def __init__(self, streams: list[Stream]) -> None:
        self._selector = selectors.DefaultSelector()
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._selector.register(self._wake_read, selectors.EVENT_READ, None)
        self._open_by_rank: dict[int, int] = {}
        for stream in streams:
            self._selector.register(stream.pipe, selectors.EVENT_READ, stream)
            self._open_by_rank[stream.rank] = self._open_by_rank.get(stream.rank, 0) + 1
        self._condition = threading.Condition()
        self._stop_requested = False
        self._added: list[Stream] = []  # streams add() hands to the thread
        self._thread = threading.Thread(target=self._run, name="cringrun-output", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def add(self, streams: list[Stream]) -> None:
        """Relay more pipes (ranks started later); the thread registers them."""
        with self._condition:
            self._added.extend(streams)
            for stream in streams:
                self._open_by_rank[stream.rank] = self._open_by_rank.get(stream.rank, 0) + 1
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_write, b"x")
        except BlockingIOError:
            pass  # a wake-up is already pending

    def wait_closed(self, timeout_s: float, rank: int | None = None) -> bool:
        """Wait until every pipe (or every pipe of one rank) reached end of file."""
        deadline = time.monotonic() + timeout_s
        with self._condition:
            while True:
                if rank is None:
                    remaining_pipes = sum(self._open_by_rank.values())
                else:
                    remaining_pipes = self._open_by_rank.get(rank, 0)
                if remaining_pipes == 0 or not self._thread.is_alive():
                    return remaining_pipes == 0
                remaining_s = deadline - time.monotonic()
                if remaining_s <= 0:
                    return False
                self._condition.wait(remaining_s)

    def stop(self, timeout_s: float) -> None:
        """Relay what is still buffered in the pipes, close them and end the thread."""
        with self._condition:
            self._stop_requested = True
        self._wake()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._selector.close()
            os.close(self._wake_read)
            os.close(self._wake_write)
        # else the thread is stuck writing to our own stdout/stderr; it is a
        # daemon thread, leave it (and its file descriptors) to process exit.

    def _run(self) -> None:
        while True:
            for key, _ in self._selector.select():
                if key.data is None:
                    try:
                        os.read(self._wake_read, 4096)
                    except BlockingIOError:
                        pass
                    with self._condition:
                        stop_requested = self._stop_requested
                        added, self._added = self._added, []
                    for stream in added:
                        self._selector.register(stream.pipe, selectors.EVENT_READ, stream)
                    if stop_requested:
                        self._drain_and_close_all()
                        return
                else:
                    self._relay(key.data)

    def _relay(self, stream: Stream) -> None:
        try:
            chunk = os.read(stream.pipe.fileno(), _READ_CHUNK_BYTES)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if chunk:
            stream.sink.write(stream.lines.feed(chunk))
        else:
            self._close(stream)

    def _close(self, stream: Stream) -> None:
        stream.sink.write(stream.lines.finish())
        self._selector.unregister(stream.pipe)
        stream.pipe.close()
        with self._condition:
            self._open_by_rank[stream.rank] -= 1
            self._condition.notify_all()

    def _drain_and_close_all(self) -> None:
        streams = [key.data for key in list(self._selector.get_map().values()) if key.data]
        for stream in streams:
            fd = stream.pipe.fileno()
            os.set_blocking(fd, False)
            while True:
                try:
                    chunk = os.read(fd, _READ_CHUNK_BYTES)
                except OSError:  # BlockingIOError: nothing more for now
                    break
                if not chunk:
                    break
                stream.sink.write(stream.lines.feed(chunk))
            self._close(stream)

# cringrun: the single-host process launcher (`cringrun -np N command ...`).
# It starts the ranks, serves their rendezvous store and relays their output;
# it must not import torch or any framework, and depends on the stdlib plus
# cring._C (imported lazily, only to serve the store).
"""Launch N local processes of one command as the ranks of a cring job.

Usage::

    cringrun -np N [--no-prefix] [--grace-seconds S] [--] command [args ...]
    python -m cring.run -np N ... command [args ...]

Everything from the first argument that is not a launcher option (or
everything after ``--``) is the command; its own flags are never parsed here.
The command is executed directly (no shell). Rank 0 inherits the launcher's
standard input; the other ranks read from ``/dev/null``.

Environment of every rank: the launcher's environment plus

    CRING_RANK, CRING_SIZE              rank and number of ranks
    CRING_LOCAL_RANK, CRING_LOCAL_SIZE  the same (every rank is on this host)
    CRING_ADDR=127.0.0.1, CRING_PORT    the rendezvous store the launcher serves
    CRING_SECRET                        random per-job token the store requires
    CRING_STORE_EXTERNAL=1              the store already runs; rank 0 must not
                                        start one
    CRING_JOB_ID                        random id of this job
    PYTHONUNBUFFERED=1                  unless already set

Output: every line a rank writes to stdout is printed on the launcher's stdout
as ``[R] line`` (R = rank), and every stderr line on the launcher's stderr the
same way. Output is relayed as bytes, whole lines at a time, so lines of
different ranks never mix. A final line without a newline is printed with a
newline added; a single line longer than 1 MiB is split into 1 MiB pieces,
each with its own prefix. ``--no-prefix`` relays the bytes unchanged (still
whole lines at a time).

Stopping: each rank runs in its own process group (session); every signal the
launcher sends goes to the whole group, so it reaches the rank's children too.
SIGINT, SIGTERM and SIGHUP received by the launcher are forwarded to every
rank; a second one kills them at once. When a rank exits non-zero or is killed
by a signal, the launcher prints one line on stderr naming it and sends
SIGTERM to the other ranks. Ranks still running ``--grace-seconds`` (default
5) after a SIGTERM or forwarded signal are killed with SIGKILL. When the job
ends, processes left in the ranks' process groups are killed with SIGKILL.

Exit status:

    0        every rank exited with 0
    code     the first rank to fail exited with this code
    128+sig  the first rank to fail was killed by signal sig (137 = SIGKILL)
    130/143  the launcher received SIGINT / SIGTERM (129 for SIGHUP)
    126/127  the command could not be executed / was not found
    2        usage error
    1        the launcher itself failed (e.g. the store could not start)

The first cause wins: ranks that die because the launcher stopped them do not
change the status.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Any

__all__ = ["main"]

PROG = "cringrun"
DEFAULT_GRACE_SECONDS = 5.0

# After the last rank has exited, how long to wait for its pipes to close (a
# child of a rank may still hold them) before killing what is left.
_OUTPUT_DRAIN_TIMEOUT_S = 2.0
# After a rank fails, how long to wait for its remaining output so that its
# last words are printed before the launcher's summary line.
_FAILED_RANK_OUTPUT_TIMEOUT_S = 0.5
# How long to wait for the output thread to finish writing at the very end.
_OUTPUT_THREAD_JOIN_TIMEOUT_S = 5.0
_READ_CHUNK_BYTES = 1 << 16
_MAX_PENDING_LINE_BYTES = 1 << 20
# Only used when main() runs outside the main thread, where signal handlers
# (and so SIGCHLD wake-ups) cannot be installed.
_POLL_INTERVAL_WITHOUT_SIGNALS_S = 0.05

_HOSTS_UNSUPPORTED = (
    "multi-host launch is not supported by cringrun yet; start one process per rank "
    "with CRING_* variables (see README)"
)
_USAGE = f"{PROG} -np N [options] [--] command [args ...]"

# Signals the launcher forwards to the ranks (each one, received, also sets
# the launcher's exit status to 128 + signum).
_FORWARDED_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number of seconds >= 0, got {text!r}"
        ) from None
    if not value >= 0 or value == float("inf"):  # also rejects nan
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        usage=_USAGE,
        description="Run N local processes of a command as the ranks of one cring job.",
        epilog=(
            "Everything from the first non-option argument on (or after '--') is the "
            "command and its arguments. Each rank gets CRING_RANK, CRING_SIZE, "
            "CRING_LOCAL_RANK, CRING_LOCAL_SIZE, CRING_ADDR, CRING_PORT, CRING_SECRET, "
            "CRING_STORE_EXTERNAL and CRING_JOB_ID in its environment. Exit status: 0 when "
            "every rank exits 0, else the first failing rank's code (128+N for signal N), "
            "130/143 after SIGINT/SIGTERM, 2 for usage errors."
        ),
        # Abbreviations would make '--num 4' ambiguous with the start of the command.
        allow_abbrev=False,
    )
    parser.add_argument(
        "-np",
        "-n",
        "--num-proc",
        dest="num_proc",
        type=_positive_int,
        metavar="N",
        help="number of processes (ranks) to start, >= 1 (required)",
    )
    parser.add_argument(
        "--no-prefix",
        action="store_true",
        help="relay output unchanged instead of prefixing each line with '[rank] '",
    )
    parser.add_argument(
        "--grace-seconds",
        type=_non_negative_float,
        default=DEFAULT_GRACE_SECONDS,
        metavar="S",
        help=(
            "seconds ranks get to exit after SIGTERM (or a forwarded signal) before "
            f"SIGKILL (default {DEFAULT_GRACE_SECONDS:g})"
        ),
    )
    parser.add_argument(
        "-H",
        "--hosts",
        metavar="HOSTS",
        help="not supported yet: cringrun launches on this host only",
    )
    return parser


# Launcher options that take a value as the next argument; used to find where
# the command starts without letting argparse look at the command's flags.
_OPTIONS_WITH_VALUE = frozenset({"-np", "-n", "--num-proc", "--grace-seconds", "-H", "--hosts"})


def _split_command(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split argv into (launcher arguments, command and its arguments).

    The command starts at '--' (which is dropped) or at the first argument that
    is neither an option nor the value of an option that takes one.
    """
    index = 0
    while index < len(argv):
        arg = argv[index]
        if arg == "--":
            return list(argv[:index]), list(argv[index + 1 :])
        if arg.startswith("-") and arg != "-":
            index += 2 if arg in _OPTIONS_WITH_VALUE else 1
            continue
        return list(argv[:index]), list(argv[index:])
    return list(argv), []


@dataclass(frozen=True)
class _Options:
    num_proc: int
    prefix_output: bool
    grace_seconds: float
    command: list[str]


def _parse_args(argv: Sequence[str]) -> _Options:
    """Parse the command line; raises SystemExit for --help and usage errors."""
    parser = _build_parser()
    launcher_args, command = _split_command(argv)
    namespace = parser.parse_args(launcher_args)
    if namespace.hosts is not None:
        parser.error(_HOSTS_UNSUPPORTED)
    if namespace.num_proc is None:
        parser.error("the number of processes is required: -np N")
    if not command:
        parser.error("missing the command to run after the options")
    return _Options(
        num_proc=namespace.num_proc,
        prefix_output=not namespace.no_prefix,
        grace_seconds=namespace.grace_seconds,
        command=command,
    )


# ---------------------------------------------------------------------------
# Output relay
# ---------------------------------------------------------------------------


class _Sink:
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


class _LineBuffer:
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
class _Stream:
    rank: int
    pipe: IO[bytes]
    sink: _Sink
    lines: _LineBuffer


class _OutputPump:
    """A thread that relays every rank's stdout and stderr pipes to the sinks.

    It reads whatever is available from any pipe (selectors), so a rank that
    writes a lot never blocks on a full pipe while the launcher waits on
    another one. Writing happens in this thread too, so a slow consumer of the
    launcher's output never delays signal handling in the main thread.
    """

    def __init__(self, streams: list[_Stream]) -> None:
        self._selector = selectors.DefaultSelector()
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_write, False)
        self._selector.register(self._wake_read, selectors.EVENT_READ, None)
        self._open_by_rank: dict[int, int] = {}
        for stream in streams:
            self._selector.register(stream.pipe, selectors.EVENT_READ, stream)
            self._open_by_rank[stream.rank] = self._open_by_rank.get(stream.rank, 0) + 1
        self._condition = threading.Condition()
        self._stop_requested = False
        self._thread = threading.Thread(target=self._run, name="cringrun-output", daemon=True)

    def start(self) -> None:
        self._thread.start()

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
        try:
            os.write(self._wake_write, b"x")
        except BlockingIOError:
            pass  # a wake-up is already pending
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
                    with self._condition:
                        stop_requested = self._stop_requested
                    if stop_requested:
                        self._drain_and_close_all()
                        return
                else:
                    self._relay(key.data)

    def _relay(self, stream: _Stream) -> None:
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

    def _close(self, stream: _Stream) -> None:
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


# ---------------------------------------------------------------------------
# Signals
# ---------------------------------------------------------------------------


class _SignalWatcher:
    """Records SIGINT/SIGTERM/SIGHUP and wakes the main loop on those and SIGCHLD.

    Uses signal.set_wakeup_fd so that a signal arriving at any moment makes the
    next wait() return at once; no wake-up is lost and nothing polls. Signals
    that were ignored when the launcher started (nohup, background jobs) stay
    ignored. Outside the main thread no handler can be installed; wait() then
    returns after a short interval so exits are still noticed.
    """

    def __init__(self) -> None:
        self._pending: list[int] = []
        self._previous_handlers: dict[int, Any] = {}
        self._previous_wakeup_fd = -1
        self._wake_read = -1
        self._wake_write = -1
        self._selector: selectors.BaseSelector | None = None
        self.active = False

    def __enter__(self) -> _SignalWatcher:
        if threading.current_thread() is not threading.main_thread():
            return self
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_read, selectors.EVENT_READ)
        self._previous_wakeup_fd = signal.set_wakeup_fd(self._wake_write, warn_on_full_buffer=False)
        self.active = True
        for signum in _FORWARDED_SIGNALS:
            previous = signal.getsignal(signum)
            if previous is signal.SIG_IGN:
                continue
            self._previous_handlers[signum] = previous
            signal.signal(signum, self._record)
        # A Python-level handler makes the C handler write to the wakeup fd.
        self._previous_handlers[signal.SIGCHLD] = signal.getsignal(signal.SIGCHLD)
        signal.signal(signal.SIGCHLD, self._ignore)
        return self

    def __exit__(self, *exc_info: object) -> None:
        if not self.active:
            return
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        signal.set_wakeup_fd(self._previous_wakeup_fd)
        assert self._selector is not None
        self._selector.close()
        os.close(self._wake_read)
        os.close(self._wake_write)
        self.active = False

    def _record(self, signum: int, frame: object) -> None:
        self._pending.append(signum)

    def _ignore(self, signum: int, frame: object) -> None:
        pass

    def take_signals(self) -> list[int]:
        taken, self._pending = self._pending, []
        return taken

    def wait(self, timeout_s: float | None) -> None:
        """Block until a signal arrives or timeout_s passes (None: no limit)."""
        if not self.active:
            time.sleep(
                _POLL_INTERVAL_WITHOUT_SIGNALS_S
                if timeout_s is None
                else min(timeout_s, _POLL_INTERVAL_WITHOUT_SIGNALS_S)
            )
            return
        assert self._selector is not None
        self._selector.select(timeout_s)
        try:
            while os.read(self._wake_read, 256):
                pass
        except BlockingIOError:
            pass


@contextlib.contextmanager
def _signals_blocked() -> Iterator[None]:
    """Block the launcher's signals in this thread for the duration.

    Threads created meanwhile (the output thread, the store's C thread) inherit
    the blocked mask, so every signal is delivered to the main thread and never
    interrupts a system call in theirs.
    """
    watched = {*_FORWARDED_SIGNALS, signal.SIGCHLD}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, watched)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


# ---------------------------------------------------------------------------
# The job
# ---------------------------------------------------------------------------


def _start_store(secret: str) -> tuple[Any, int]:
    """Serve the job's rendezvous store on 127.0.0.1; return (server, port).

    The server object has .stop(). Kept as one small function so that tests of
    pure launcher behaviour can replace it.
    """
    from cring._C import StoreServer

    server = StoreServer("127.0.0.1", 0, secret)
    return server, int(server.port)


def _exit_code_of(status: int) -> int:
    """Shell-style exit code for a Popen-style status (negative: killed by signal)."""
    return status if status >= 0 else 128 - status


def _describe_status(status: int) -> str:
    if status >= 0:
        return f"exited with code {status}"
    return f"was killed by signal {-status} ({_signal_name(-status)})"


def _processes(count: int) -> str:
    return f"{count} process" if count == 1 else f"{count} processes"


@dataclass
class _Rank:
    rank: int
    process: subprocess.Popen[bytes]
    status: int | None = None  # Popen.returncode convention once it has exited


def _exit_status_nowait(process: subprocess.Popen[bytes]) -> int | None:
    """The exit status of a child if it has exited, without reaping it.

    The child stays a zombie until reaped at the very end, so its pid (which is
    also its process group id) cannot be reused while the launcher may still
    signal that group.
    """
    if process.returncode is not None:
        return process.returncode
    if not hasattr(os, "waitid"):  # pragma: no cover - platforms without waitid
        return process.poll()
    try:
        info = os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # already reaped
        return process.poll()
    if info is None or info.si_pid == 0:
        return None
    if info.si_code == os.CLD_EXITED:
        return info.si_status
    return -info.si_status  # CLD_KILLED or CLD_DUMPED


class _Job:
    """Starts the ranks, watches them, stops them, and computes the exit status."""

    def __init__(self, options: _Options, env: dict[str, str]) -> None:
        self._options = options
        self._env = env
        self._stdout = _Sink(sys.stdout)
        self._stderr = _Sink(sys.stderr)
        self._ranks: list[_Rank] = []
        self._exit_code: int | None = None  # set by the first cause of the job's end
        self._kill_deadline: float | None = None  # when SIGTERM'd ranks get SIGKILL
        self._stop_signal: int | None = None  # the signal the stop began with
        self._killed = False
        self._pump: _OutputPump | None = None

    def message(self, text: str) -> None:
        self._stderr.write(f"{PROG}: {text}\n".encode("utf-8", errors="replace"))

    def run(self) -> int:
        with _SignalWatcher() as watcher:
            try:
                self._spawn_all()
                self._pump = _OutputPump(self._streams())
                with _signals_blocked():  # the thread inherits the mask
                    self._pump.start()
                self._supervise(watcher)
            finally:
                self._finish()
        return self._exit_code if self._exit_code is not None else 0

    # -- start ---------------------------------------------------------------

    def _spawn_all(self) -> None:
        size = self._options.num_proc
        for rank in range(size):
            env = dict(self._env)
            env.update(
                CRING_RANK=str(rank),
                CRING_SIZE=str(size),
                CRING_LOCAL_RANK=str(rank),
                CRING_LOCAL_SIZE=str(size),
            )
            try:
                process = subprocess.Popen(
                    self._options.command,
                    env=env,
                    stdin=None if rank == 0 else subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                )
            except (OSError, ValueError) as exc:  # ValueError: e.g. a NUL byte in an argument
                # The shell's codes: 127 not found, 126 found but not executable.
                if isinstance(exc, FileNotFoundError):
                    self._exit_code = 127
                elif isinstance(exc, PermissionError):
                    self._exit_code = 126
                else:
                    self._exit_code = 1
                detail = getattr(exc, "strerror", None) or str(exc)
                self.message(f"cannot start rank {rank}: {self._options.command[0]}: {detail}")
                if self._ranks:
                    self._begin_stop(signal.SIGTERM)
                return
            self._ranks.append(_Rank(rank, process))

    def _streams(self) -> list[_Stream]:
        streams = []
        for rank in self._ranks:
            prefix = f"[{rank.rank}] ".encode() if self._options.prefix_output else b""
            assert rank.process.stdout is not None and rank.process.stderr is not None
            streams.append(
                _Stream(rank.rank, rank.process.stdout, self._stdout, _LineBuffer(prefix))
            )
            streams.append(
                _Stream(rank.rank, rank.process.stderr, self._stderr, _LineBuffer(prefix))
            )
        return streams

    # -- watch ---------------------------------------------------------------

    def _supervise(self, watcher: _SignalWatcher) -> None:
        while True:
            for signum in watcher.take_signals():
                self._on_launcher_signal(signum)
            self._collect_exits()
            running = self._running()
            if not running:
                return
            timeout_s: float | None = None
            if self._kill_deadline is not None and not self._killed:
                remaining_s = self._kill_deadline - time.monotonic()
                if remaining_s <= 0:
                    self.message(
                        f"{_processes(len(running))} still running "
                        f"{self._options.grace_seconds:g} s after "
                        f"{_signal_name(self._stop_signal or signal.SIGTERM)}; killing them"
                    )
                    self._kill_all()
                    continue
                timeout_s = remaining_s
            watcher.wait(timeout_s)

    def _running(self) -> list[_Rank]:
        return [rank for rank in self._ranks if rank.status is None]

    def _on_launcher_signal(self, signum: int) -> None:
        running = self._running()
        if self._exit_code is None:
            self._exit_code = 128 + signum
        if self._stop_signal is None:
            self.message(
                f"received {_signal_name(signum)}; forwarding it to {_processes(len(running))}"
            )
            self._begin_stop(signum)
        elif not self._killed:
            self.message(
                f"received {_signal_name(signum)} while stopping; killing {_processes(len(running))}"
            )
            self._kill_all()

    def _collect_exits(self) -> None:
        newly_failed: list[_Rank] = []
        for rank in self._running():
            rank.status = _exit_status_nowait(rank.process)
            if rank.status is not None and rank.status != 0:
                newly_failed.append(rank)
        if newly_failed and self._exit_code is None:
            first = newly_failed[0]
            assert first.status is not None
            self._exit_code = _exit_code_of(first.status)
            self._on_rank_failure(first, first.status)

    def _on_rank_failure(self, failed: _Rank, status: int) -> None:
        # Let the failed rank's last output (e.g. a traceback) come out first.
        if self._pump is not None:
            self._pump.wait_closed(_FAILED_RANK_OUTPUT_TIMEOUT_S, rank=failed.rank)
        others = len(self._running())
        summary = f"rank {failed.rank} {_describe_status(status)}"
        if others:
            summary += f"; stopping the other {_processes(others)}"
        self.message(summary)
        self._begin_stop(signal.SIGTERM)

    # -- stop ----------------------------------------------------------------

    def _signal_groups(self, signum: int) -> None:
        # Leaders are not reaped before _finish, so every pid here is still
        # ours and is the id of the rank's process group.
        for rank in self._ranks:
            try:
                os.killpg(rank.process.pid, signum)
            except (ProcessLookupError, PermissionError):
                pass  # the group is empty (or, for a zombie leader, only that)

    def _begin_stop(self, signum: int) -> None:
        self._stop_signal = signum
        self._signal_groups(signum)
        if self._kill_deadline is None:
            self._kill_deadline = time.monotonic() + self._options.grace_seconds

    def _kill_all(self) -> None:
        self._killed = True
        self._signal_groups(signal.SIGKILL)

    def _finish(self) -> None:
        """Kill what is left in the ranks' groups, reap the ranks, flush output."""
        if self._running():  # only when supervision ended with an exception
            self._signal_groups(signal.SIGKILL)
        if self._pump is not None:
            self._pump.wait_closed(_OUTPUT_DRAIN_TIMEOUT_S)
        self._signal_groups(signal.SIGKILL)  # stragglers started by the ranks
        for rank in self._ranks:
            try:
                rank.process.wait(timeout=self._options.grace_seconds + 10)
            except subprocess.TimeoutExpired:
                self.message(
                    f"rank {rank.rank} (pid {rank.process.pid}) did not exit after SIGKILL"
                )
        if self._pump is not None:
            self._pump.stop(_OUTPUT_THREAD_JOIN_TIMEOUT_S)
        else:
            for rank in self._ranks:  # spawning failed before the pump started
                for pipe in (rank.process.stdout, rank.process.stderr):
                    if pipe is not None:
                        pipe.close()


def _job_environment(port: int, secret: str, job_id: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        CRING_ADDR="127.0.0.1",
        CRING_PORT=str(port),
        CRING_SECRET=secret,
        CRING_STORE_EXTERNAL="1",
        CRING_JOB_ID=job_id,
    )
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _launch(options: _Options) -> int:
    secret = secrets.token_hex(16)
    job_id = secrets.token_hex(8)
    try:
        with _signals_blocked():  # the store's C thread inherits the mask
            server, port = _start_store(secret)
    except ImportError as exc:
        print(
            f"{PROG}: cannot start the rendezvous store: cring's C extension is not "
            f"importable ({exc}); build and install the package (pip install .)",
            file=sys.stderr,
        )
        return 1
    except Exception as exc:
        print(f"{PROG}: cannot start the rendezvous store: {exc}", file=sys.stderr)
        return 1
    try:
        return _Job(options, _job_environment(port, secret, job_id)).run()
    finally:
        try:
            server.stop()
        except Exception as exc:
            print(f"{PROG}: warning: stopping the rendezvous store failed: {exc}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run cringrun with argv (default sys.argv[1:]); return the exit status."""
    if argv is None:
        argv = sys.argv[1:]
    try:
        options = _parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error already printed
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    return _launch(options)


if __name__ == "__main__":
    sys.exit(main())

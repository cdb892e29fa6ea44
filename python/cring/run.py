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

Elastic mode (docs/elastic.md)::

    cringrun --elastic -np K [--min-np M] [--max-np N]
             [--host-discovery-script S [--discovery-interval T]]
             [--reset-limit R] command [args ...]

Each process is a *worker* with an id that is never reused (0..K-1 at the
start; the output prefix is the worker id, not the rank). A worker that fails
(non-zero exit or signal) does not stop the others: the launcher publishes a
new *generation* in its store (the survivors in their previous rank order,
ranks 0..n-1) and the workers re-rendezvous into it (cring.elastic.run). If
fewer than M (default K) workers would remain, or R generations have already
been formed after the first, the job fails as above. The discovery script
(an executable printing 'host[:slots]' lines) is run every T seconds (default
1); while it reports more slots on this host than there are workers (at most
N), new workers are started for a new generation; slots on other hosts are
ignored with a warning. Failed workers are replaced only that way. Once a
worker has exited 0 the job is finishing: no generation is formed any more,
and a later failure ends the job. Extra environment of every worker:
CRING_ELASTIC=1, CRING_ELASTIC_WORKER_ID, CRING_ELASTIC_GENERATION. The exit
status is 0 when every worker still in the job exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import secrets
import selectors
import signal
import socket
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
DEFAULT_DISCOVERY_INTERVAL_S = 1.0

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


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
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
    elastic = parser.add_argument_group(
        "elastic training",
        "With --elastic, a worker that fails does not end the job: the others form a new "
        "generation (new ranks and size) through the launcher's store and carry on "
        "(cring.elastic.run); see docs/elastic.md.",
    )
    elastic.add_argument(
        "--elastic",
        action="store_true",
        help="keep the job running when workers fail, as long as --min-np remain",
    )
    elastic.add_argument(
        "--min-np",
        type=_positive_int,
        metavar="M",
        help="fail the job when fewer than M workers remain (default: -np)",
    )
    elastic.add_argument(
        "--max-np",
        type=_positive_int,
        metavar="N",
        help="never run more than N workers (default: no limit beyond the discovery script)",
    )
    elastic.add_argument(
        "--host-discovery-script",
        metavar="SCRIPT",
        help=(
            "executable printing one 'host[:slots]' line per host; workers are added "
            "while this host has more slots than running workers (only this host is used)"
        ),
    )
    elastic.add_argument(
        "--discovery-interval",
        type=_non_negative_float,
        default=DEFAULT_DISCOVERY_INTERVAL_S,
        metavar="S",
        help=f"seconds between runs of the discovery script (default {DEFAULT_DISCOVERY_INTERVAL_S:g})",
    )
    elastic.add_argument(
        "--reset-limit",
        type=_non_negative_int,
        metavar="K",
        help="fail the job instead of forming generation K+1 (default: no limit)",
    )
    return parser


# Launcher options that take a value as the next argument; used to find where
# the command starts without letting argparse look at the command's flags.
_OPTIONS_WITH_VALUE = frozenset(
    {
        "-np",
        "-n",
        "--num-proc",
        "--grace-seconds",
        "-H",
        "--hosts",
        "--min-np",
        "--max-np",
        "--host-discovery-script",
        "--discovery-interval",
        "--reset-limit",
    }
)


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
    elastic: bool = False
    min_np: int = 1
    max_np: int | None = None
    discovery_script: str | None = None
    discovery_interval_s: float = DEFAULT_DISCOVERY_INTERVAL_S
    reset_limit: int | None = None


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
    elastic_only = {
        "--min-np": namespace.min_np,
        "--max-np": namespace.max_np,
        "--host-discovery-script": namespace.host_discovery_script,
        "--reset-limit": namespace.reset_limit,
    }
    if namespace.discovery_interval != DEFAULT_DISCOVERY_INTERVAL_S:
        elastic_only["--discovery-interval"] = namespace.discovery_interval
    if not namespace.elastic:
        for option, value in elastic_only.items():
            if value is not None:
                parser.error(f"{option} needs --elastic")
    min_np = namespace.num_proc if namespace.min_np is None else namespace.min_np
    if min_np > namespace.num_proc:
        parser.error(f"--min-np {min_np} is more than -np {namespace.num_proc}")
    if namespace.max_np is not None and namespace.max_np < namespace.num_proc:
        parser.error(f"--max-np {namespace.max_np} is less than -np {namespace.num_proc}")
    script = namespace.host_discovery_script
    if script is not None and not (os.path.isfile(script) and os.access(script, os.X_OK)):
        parser.error(f"--host-discovery-script {script!r} is not an executable file")
    return _Options(
        num_proc=namespace.num_proc,
        prefix_output=not namespace.no_prefix,
        grace_seconds=namespace.grace_seconds,
        command=command,
        elastic=namespace.elastic,
        min_np=min_np,
        max_np=namespace.max_np,
        discovery_script=script,
        discovery_interval_s=namespace.discovery_interval,
        reset_limit=namespace.reset_limit,
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
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._selector.register(self._wake_read, selectors.EVENT_READ, None)
        self._open_by_rank: dict[int, int] = {}
        for stream in streams:
            self._selector.register(stream.pipe, selectors.EVENT_READ, stream)
            self._open_by_rank[stream.rank] = self._open_by_rank.get(stream.rank, 0) + 1
        self._condition = threading.Condition()
        self._stop_requested = False
        self._added: list[_Stream] = []  # streams add() hands to the thread
        self._thread = threading.Thread(target=self._run, name="cringrun-output", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def add(self, streams: list[_Stream]) -> None:
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

    def wake(self) -> None:
        """Make wait() return now (callable from any thread)."""
        if not self.active:
            return
        try:
            os.write(self._wake_write, b"\0")
        except (BlockingIOError, OSError):
            pass  # a wake-up is already pending (or the watcher is closing)

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
            if self._spawn(rank, _rank_environment(rank, size)) is None:
                if self._ranks:
                    self._begin_stop(signal.SIGTERM)
                return

    def _spawn(self, label: int, variables: dict[str, str]) -> _Rank | None:
        """Start one process of the command (label: its rank, or its worker id
        under --elastic; label 0 reads stdin). On failure, print why, set the
        exit code (127 not found, 126 not executable, else 1) and return None."""
        env = dict(self._env)
        env.update(variables)
        try:
            process = subprocess.Popen(
                self._options.command,
                env=env,
                stdin=None if label == 0 else subprocess.DEVNULL,
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
            what = "worker" if self._options.elastic else "rank"
            self.message(f"cannot start {what} {label}: {self._options.command[0]}: {detail}")
            return None
        started = _Rank(label, process)
        self._ranks.append(started)
        return started

    def _streams(self, ranks: list[_Rank] | None = None) -> list[_Stream]:
        streams = []
        for rank in self._ranks if ranks is None else ranks:
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
            timeout_s = self._tick()
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
                timeout_s = remaining_s if timeout_s is None else min(timeout_s, remaining_s)
            watcher.wait(timeout_s)

    def _tick(self) -> float | None:
        """Periodic work of a subclass; returns how soon to call again (None: no need)."""
        return None

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


# ---------------------------------------------------------------------------
# The elastic job
# ---------------------------------------------------------------------------

# A discovery script that runs longer than this is abandoned for that round.
_DISCOVERY_TIMEOUT_S = 30.0
# Blocking store reads of the request thread are renewed this often.
_REQUEST_WAIT_S = 3600.0


def _local_host_names() -> frozenset[str]:
    names = {"localhost", "127.0.0.1", "::1", "localhost.localdomain"}
    for name in (socket.gethostname(), socket.getfqdn()):
        if name:
            names.add(name.lower())
            names.add(name.split(".")[0].lower())
    return frozenset(names)


def _parse_discovery(text: str) -> tuple[dict[str, int], list[str]]:
    """Lines 'host' or 'host:slots' (blank lines and '#' comments skipped):
    ({host: slots}, [problems])."""
    hosts: dict[str, int] = {}
    problems = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        host, _, slots_text = line.rpartition(":") if ":" in line else (line, "", "1")
        try:
            slots = int(slots_text)
        except ValueError:
            slots = -1
        if not host or slots < 0:
            problems.append(f"ignoring the line {line!r} (expected host or host:slots)")
            continue
        hosts[host.lower()] = hosts.get(host.lower(), 0) + slots
    return hosts, problems


class _ElasticJob(_Job):
    """cringrun --elastic: a worker that fails leaves the job instead of ending it.

    Every process is a *worker* with an id that is never reused (its output
    prefix); a *generation* is a list of workers in rank order. When workers
    fail, the survivors (in their previous rank order) form the next
    generation, unless fewer than --min-np would remain; the launcher
    publishes it in its store (cring.elastic's keys and records) and the
    workers re-rendezvous into it. A discovery script can add workers (up to
    --max-np); a worker can ask for a new generation (after a time-out). Once
    a worker has exited 0 the job is finishing: no generation is formed any
    more and a failure ends the job as without --elastic.
    """

    def __init__(self, options: _Options, env: dict[str, str], job_id: str) -> None:
        super().__init__(options, env)
        from cring import elastic  # the protocol shared with the workers

        self._protocol = elastic
        self._keys = elastic._Keys(job_id)
        self._store: Any = None
        self._generation = -1
        self._resets = 0
        self._members: list[_Rank] = []  # the current generation, in rank order
        self._next_worker_id = 0
        self._finishing = False
        self._next_discovery_s = 0.0
        self._discovery_problem: str | None = None
        self._local_names = _local_host_names()
        self._requests: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        self._request_client: Any = None
        self._request_thread: threading.Thread | None = None
        self._watcher: _SignalWatcher | None = None
        self._closing = False
        self._added_now: list[_Rank] = []  # started for the current generation (not the first)
        self._abandoned: set[int] = set()  # ids of workers the launcher stopped: not failures

    def run(self) -> int:
        with _SignalWatcher() as watcher:
            self._watcher = watcher
            try:
                if self._connect():
                    self._spawn_all()
                    self._pump = _OutputPump(self._streams())
                    with _signals_blocked():  # the threads inherit the mask
                        self._pump.start()
                        self._start_request_thread()
                    self._supervise(watcher)
            finally:
                self._stop_request_thread()
                self._finish()
                if self._store is not None:
                    self._store.close()
        return self._exit_code if self._exit_code is not None else 0

    def _connect(self) -> bool:
        try:
            self._store = self._client()
            self._request_client = self._client()
        except (OSError, ConnectionError) as exc:
            self.message(f"cannot connect to its own rendezvous store: {exc}")
            self._exit_code = 1
            return False
        return True

    def _client(self) -> Any:
        return self._protocol._StoreClient(
            "127.0.0.1", int(self._env["CRING_PORT"]), self._env["CRING_SECRET"], 10.0
        )

    # -- requests from workers -------------------------------------------------

    def _start_request_thread(self) -> None:
        self._request_thread = threading.Thread(
            target=self._watch_requests, name="cringrun-requests", daemon=True
        )
        self._request_thread.start()

    def _watch_requests(self) -> None:
        n = 1
        while True:
            try:
                value = self._request_client.get(self._keys.request(n), _REQUEST_WAIT_S)
            except (OSError, ConnectionError, ValueError):
                return  # the launcher is closing the connection
            if value is None:
                continue
            n += 1
            try:
                request = json.loads(value)
            except ValueError:
                continue
            if isinstance(request, dict):
                self._requests.put(request)
                if not self._closing and self._watcher is not None:
                    self._watcher.wake()

    def _stop_request_thread(self) -> None:
        self._closing = True
        if self._request_client is not None:
            self._request_client.abort()
        if self._request_thread is not None:
            self._request_thread.join(_OUTPUT_THREAD_JOIN_TIMEOUT_S)

    def _handle_requests(self) -> None:
        while True:
            try:
                request = self._requests.get_nowait()
            except queue.Empty:
                return
            if self._stop_signal is not None or self._finishing:
                continue
            if request.get("generation") != self._generation:
                continue  # about a generation that has been replaced already
            self._collect_exits()  # deaths first: they may replace the generation
            if request.get("generation") != self._generation or self._stop_signal is not None:
                continue
            if not self._may_reset():
                continue
            self.message(
                f"worker {request.get('worker')} asked for a new generation "
                f"({request.get('reason', '')}); forming generation {self._generation + 1} "
                f"with the same {_workers(len(self._members))}"
            )
            self._new_generation(self._members, 0, "asked for by a worker")

    # -- generations -----------------------------------------------------------

    def _spawn_all(self) -> None:
        self._new_generation([], self._options.num_proc, "start")

    def _new_generation(self, carried: list[_Rank], added: int, reason: str) -> None:
        """Start `added` workers and publish generation +1 = carried + started."""
        generation = self._generation + 1
        size = len(carried) + added
        started: list[_Rank] = []
        for index in range(added):
            worker_id = self._next_worker_id
            self._next_worker_id += 1
            variables = _rank_environment(len(carried) + index, size)
            variables.update(
                CRING_ELASTIC="1",
                CRING_ELASTIC_WORKER_ID=str(worker_id),
                CRING_ELASTIC_GENERATION=str(generation),
            )
            worker = self._spawn(worker_id, variables)
            if worker is None:
                self._begin_stop(signal.SIGTERM)
                return
            started.append(worker)
        members = carried + started
        record = self._protocol.make_record(
            generation, [w.rank for w in members], [w.rank for w in started], reason
        )
        try:
            self._store.set(self._keys.generation(generation), record)
            self._store.set(self._keys.latest, str(generation).encode())
        except (OSError, ConnectionError) as exc:
            self.message(f"cannot publish generation {generation} in the store: {exc}")
            if self._exit_code is None:
                self._exit_code = 1
            self._begin_stop(signal.SIGTERM)
            return
        if generation > 0:
            self._resets += 1
        self._generation = generation
        self._members = members
        self._added_now = started if generation > 0 else []
        if started and self._pump is not None:
            self._pump.add(self._streams(started))

    def _may_reset(self, *, fail: bool = True) -> bool:
        """Whether --reset-limit allows another generation; if not and `fail`,
        stop the job (exit code 1)."""
        limit = self._options.reset_limit
        if limit is None or self._resets < limit:
            return True
        if fail:
            self.message(
                f"the job has already formed {limit} new generations (--reset-limit "
                f"{limit}); stopping the job"
            )
            if self._exit_code is None:
                self._exit_code = 1
            self._begin_stop(signal.SIGTERM)
        return False

    def _wanted_workers(self) -> int:
        """Workers the discovery script asks for (0 without a script)."""
        slots = self._discovered_slots
        if slots is None:
            return 0
        limit = self._options.max_np
        return slots if limit is None else min(slots, limit)

    _discovered_slots: int | None = None

    # -- exits -------------------------------------------------------------------

    def _collect_exits(self) -> None:
        failed: list[_Rank] = []
        finished: list[_Rank] = []
        for worker in self._running():
            worker.status = _exit_status_nowait(worker.process)
            if worker.status is not None:
                (finished if worker.status == 0 else failed).append(worker)
        if not failed and not finished:
            return
        if self._stop_signal is not None:  # already stopping: the first cause wins
            if failed and self._exit_code is None:
                self._exit_code = _exit_code_of(failed[0].status or 0)
            return
        if finished and not self._finishing:
            self._finishing = True
            reason = (
                f"worker {finished[0].rank} has finished (exit code 0), so the job is ending; "
                "no new generation is formed"
            )
            try:
                self._store.set(
                    self._keys.generation(self._generation + 1),
                    self._protocol.make_final_record(self._generation + 1, reason),
                )
            except (OSError, ConnectionError):
                pass  # workers waiting for a generation then time out instead
            self._stop_unjoined_workers()
        for worker in finished:
            if worker in self._members:
                self._members.remove(worker)
        failed = [w for w in failed if w.rank not in self._abandoned]
        if not failed:
            return
        if self._finishing:
            first = failed[0]
            assert first.status is not None
            self._exit_code = _exit_code_of(first.status)
            self._wait_for_output(failed)
            others = len(self._running())
            summary = f"worker {first.rank} {_describe_status(first.status)} after another finished"
            if others:
                summary += f"; stopping the other {_processes(others)}"
            self.message(summary)
            self._begin_stop(signal.SIGTERM)
            return
        self._reform(failed)

    def _stop_unjoined_workers(self) -> None:
        """When the job starts finishing: workers started for a generation that
        the others never formed (they finished first) would wait for them in
        vain; stop them, and do not count how they end."""
        added = [w for w in self._members if w in self._added_now and w.status is None]
        if not added:
            return
        try:
            formed = self._store.get(self._keys.formed(self._generation), 0.0) is not None
        except (OSError, ConnectionError):
            formed = False
        if formed:
            return
        self.message(
            f"stopping {_workers(len(added))} ({', '.join(str(w.rank) for w in added)}) started "
            f"for generation {self._generation}, which the others finished without joining"
        )
        for worker in added:
            self._abandoned.add(worker.rank)
            self._members.remove(worker)
            try:
                os.killpg(worker.process.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass

    def _wait_for_output(self, workers: list[_Rank]) -> None:
        if self._pump is not None:
            for worker in workers:
                self._pump.wait_closed(_FAILED_RANK_OUTPUT_TIMEOUT_S, rank=worker.rank)

    def _reform(self, failed: list[_Rank]) -> None:
        self._wait_for_output(failed)
        size = len(self._members)
        lost = []
        for worker in failed:
            assert worker.status is not None
            where = (
                f" (rank {self._members.index(worker)} of {size})"
                if worker in self._members
                else ""
            )
            lost.append(f"worker {worker.rank}{where} {_describe_status(worker.status)}")
            if worker in self._members:
                self._members.remove(worker)
        carried = list(self._members)
        added = max(0, self._wanted_workers() - len(carried))
        total = len(carried) + added
        what = "; ".join(lost)
        if total < self._options.min_np:
            first = failed[0]
            assert first.status is not None
            self._exit_code = _exit_code_of(first.status)
            self.message(
                f"{what}; {_workers(total)} {'remains' if total == 1 else 'remain'}, fewer than "
                f"--min-np {self._options.min_np}: stopping the job"
            )
            self._begin_stop(signal.SIGTERM)
            return
        if not self._may_reset():
            return
        more = f" ({added} new)" if added else ""
        self.message(
            f"{what}; continuing with {_workers(total)}{more} as generation {self._generation + 1}"
        )
        self._new_generation(carried, added, what)

    # -- discovery ---------------------------------------------------------------

    def _tick(self) -> float | None:
        self._handle_requests()
        script = self._options.discovery_script
        if script is None or self._finishing or self._stop_signal is not None:
            return None
        now = time.monotonic()
        if now >= self._next_discovery_s:
            self._discover(script)
            self._next_discovery_s = time.monotonic() + self._options.discovery_interval_s
            now = time.monotonic()
        return max(0.0, self._next_discovery_s - now)

    def _discovery_warning(self, problem: str | None) -> None:
        if problem is not None and problem != self._discovery_problem:
            self.message(f"warning: host discovery: {problem}")
        self._discovery_problem = problem

    def _discover(self, script: str) -> None:
        try:
            result = subprocess.run(
                [script],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=_DISCOVERY_TIMEOUT_S,
                check=False,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            self._discovery_warning(f"{script} failed: {exc}")
            return
        if result.returncode != 0:
            tail = result.stderr.decode(errors="replace").strip()[-500:]
            self._discovery_warning(f"{script} exited with code {result.returncode}: {tail}")
            return
        hosts, problems = _parse_discovery(result.stdout.decode(errors="replace"))
        remote = sorted(h for h in hosts if h not in self._local_names)
        if remote:
            problems.append(
                f"cringrun starts workers on this host only; ignoring {', '.join(remote)}"
            )
        self._discovery_warning("; ".join(problems) or None)
        self._discovered_slots = sum(n for h, n in hosts.items() if h in self._local_names)
        added = self._wanted_workers() - len(self._members)
        if added > 0 and not self._may_reset(fail=False):
            self._discovery_warning(
                f"not adding workers: --reset-limit {self._options.reset_limit} reached"
            )
        elif added > 0:
            self.message(
                f"host discovery: {self._discovered_slots} slots on this host; adding "
                f"{added} {'worker' if added == 1 else 'workers'} as generation "
                f"{self._generation + 1}"
            )
            self._new_generation(self._members, added, f"{added} added by host discovery")


def _workers(count: int) -> str:
    return f"{count} worker" if count == 1 else f"{count} workers"


def _rank_environment(rank: int, size: int) -> dict[str, str]:
    return {
        "CRING_RANK": str(rank),
        "CRING_SIZE": str(size),
        "CRING_LOCAL_RANK": str(rank),
        "CRING_LOCAL_SIZE": str(size),
    }


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
        env = _job_environment(port, secret, job_id)
        if options.elastic:
            return _ElasticJob(options, env, job_id).run()
        return _Job(options, env).run()
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

# The job: starts the ranks (here, or on other hosts through remote.py's
# remote shell), supervises them, forwards signals, stops them and computes
# the exit status. Elastic behaviour is in elastic_driver.py (a subclass).
"""The ranks of one cringrun job and their supervision."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from .cli import PROG, Options
from .hosts import Placement, is_local, local_host_names
from .output import LineBuffer, OutputPump, Sink, Stream
from .remote import ControlChannel, RemoteShell, spec_line
from .signals import SignalWatcher, signal_name, signals_blocked

# After the last rank has exited, how long to wait for its pipes to close (a
# child of a rank may still hold them) before killing what is left.
_OUTPUT_DRAIN_TIMEOUT_S = 2.0
# After a rank fails, how long to wait for its remaining output so that its
# last words are printed before the launcher's summary line.
FAILED_RANK_OUTPUT_TIMEOUT_S = 0.5
# How long to wait for the output thread to finish writing at the very end.
OUTPUT_THREAD_JOIN_TIMEOUT_S = 5.0


# After a remote rank was told to die (SIGKILL), how long its ssh client gets
# to report the exit before the launcher kills the client itself.
_REMOTE_EXIT_TIMEOUT_S = 10.0
# ssh's exit status when it fails itself (no connection, authentication).
_REMOTE_SHELL_FAILED = 255


def start_store(secret: str, addr: str = "127.0.0.1") -> tuple[Any, int]:
    """Serve the job's rendezvous store on addr; return (server, port).

    The server object has .stop(). Kept as one small function so that tests of
    pure launcher behaviour can replace it.
    """
    from cring._C import StoreServer

    try:
        server = StoreServer(addr, 0, secret)
    except Exception:
        if addr in ("127.0.0.1", "0.0.0.0"):
            raise
        # An address of this host that it cannot bind (e.g. behind NAT): listen
        # on every interface; the ranks still use addr.
        server = StoreServer("0.0.0.0", 0, secret)
    return server, int(server.port)


@dataclass
class HostsPlan:
    """Where the ranks of a multi-host job run and how remote ones start."""

    placements: list[Placement]
    shell: RemoteShell
    # What remote ranks get on top of their login environment (remote.py's
    # forwarded_environment plus the job's CRING_* variables).
    remote_env: dict[str, str]
    local_names: frozenset[str] = field(default_factory=local_host_names)

    def is_local(self, host: str | None) -> bool:
        return host is None or is_local(host, self.local_names)


def exit_code_of(status: int) -> int:
    """Shell-style exit code for a Popen-style status (negative: killed by signal)."""
    return status if status >= 0 else 128 - status


def describe_status(status: int) -> str:
    if status >= 0:
        return f"exited with code {status}"
    return f"was killed by signal {-status} ({signal_name(-status)})"


def count_processes(count: int) -> str:
    return f"{count} process" if count == 1 else f"{count} processes"


@dataclass
class Rank:
    rank: int
    process: subprocess.Popen[bytes]
    status: int | None = None  # Popen.returncode convention once it has exited
    host: str | None = None  # None: this host, started directly
    # Remote ranks: the ssh client's stdin, remote_wrapper.py's control channel.
    control: ControlChannel | None = None

    def where(self) -> str:
        return "" if self.host is None else f" on {self.host}"


def exit_status_nowait(process: subprocess.Popen[bytes]) -> int | None:
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


class Job:
    """Starts the ranks, watches them, stops them, and computes the exit status."""

    def __init__(
        self, options: Options, env: dict[str, str], hosts: HostsPlan | None = None
    ) -> None:
        self._options = options
        self._env = env
        self._hosts = hosts
        self._stdout = Sink(sys.stdout)
        self._stderr = Sink(sys.stderr)
        self._ranks: list[Rank] = []
        self._exit_code: int | None = None  # set by the first cause of the job's end
        self.first_failed_rank: int | None = None  # the rank (worker id) that failed first
        self._kill_deadline: float | None = None  # when SIGTERM'd ranks get SIGKILL
        self._stop_signal: int | None = None  # the signal the stop began with
        self._killed = False
        self._pump: OutputPump | None = None

    def message(self, text: str) -> None:
        self._stderr.write(f"{PROG}: {text}\n".encode("utf-8", errors="replace"))

    def run(self) -> int:
        with SignalWatcher() as watcher:
            try:
                self._spawn_all()
                self._pump = OutputPump(self._streams())
                with signals_blocked():  # the thread inherits the mask
                    self._pump.start()
                self._supervise(watcher)
            finally:
                self._finish()
        return self._exit_code if self._exit_code is not None else 0

    # -- start ---------------------------------------------------------------

    def _spawn_all(self) -> None:
        size = self._options.num_proc
        for rank in range(size):
            host, variables = None, rank_environment(rank, size)
            if self._hosts is not None:
                placement = self._hosts.placements[rank]
                host, variables = placement.host, placement_environment(placement, size)
            if self._spawn(rank, variables, host) is None:
                if self._ranks:
                    self._begin_stop(signal.SIGTERM)
                return

    def _spawn(self, label: int, variables: dict[str, str], host: str | None = None) -> Rank | None:
        """Start one process of the command (label: its rank, or its worker id
        under --elastic; label 0 reads stdin) on `host` (None: here). On
        failure, print why, set the exit code (127 not found, 126 not
        executable, else 1) and return None."""
        plan = self._hosts
        remote = plan is not None and not plan.is_local(host)
        if plan is not None and remote:
            argv = plan.shell.command_line(str(host), self._options.command)
            env = dict(self._env)  # for the remote shell itself (ssh-agent, ...)
            stdin: Any = subprocess.PIPE
        else:
            argv = self._options.command
            env = dict(self._env)
            env.update({name: value for name, value in self._options.exports if value is not None})
            env.update(variables)
            stdin = None if label == 0 else subprocess.DEVNULL
        try:
            process = subprocess.Popen(
                argv,
                env=env,
                stdin=stdin,
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
            where = f" on {host}" if host is not None else ""
            self.message(f"cannot start {what} {label}{where}: {argv[0]}: {detail}")
            return None
        started = Rank(label, process, host=host)
        if plan is not None and remote:
            assert process.stdin is not None
            started.control = ControlChannel(process.stdin)
            remote_env = dict(plan.remote_env)
            remote_env.update(variables)
            started.control.send(spec_line(remote_env, os.getcwd(), self._options.grace_seconds))
        self._ranks.append(started)
        return started

    def _streams(self, ranks: list[Rank] | None = None) -> list[Stream]:
        streams = []
        for rank in self._ranks if ranks is None else ranks:
            prefix = f"[{rank.rank}] ".encode() if self._options.prefix_output else b""
            assert rank.process.stdout is not None and rank.process.stderr is not None
            streams.append(Stream(rank.rank, rank.process.stdout, self._stdout, LineBuffer(prefix)))
            streams.append(Stream(rank.rank, rank.process.stderr, self._stderr, LineBuffer(prefix)))
        return streams

    # -- watch ---------------------------------------------------------------

    def _supervise(self, watcher: SignalWatcher) -> None:
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
                        f"{count_processes(len(running))} still running "
                        f"{self._options.grace_seconds:g} s after "
                        f"{signal_name(self._stop_signal or signal.SIGTERM)}; killing them"
                    )
                    self._kill_all()
                    continue
                timeout_s = remaining_s if timeout_s is None else min(timeout_s, remaining_s)
            watcher.wait(timeout_s)

    def _tick(self) -> float | None:
        """Periodic work of a subclass; returns how soon to call again (None: no need)."""
        return None

    def _running(self) -> list[Rank]:
        return [rank for rank in self._ranks if rank.status is None]

    def _on_launcher_signal(self, signum: int) -> None:
        running = self._running()
        if self._exit_code is None:
            self._exit_code = 128 + signum
        if self._stop_signal is None:
            self.message(
                f"received {signal_name(signum)}; forwarding it to {count_processes(len(running))}"
            )
            self._begin_stop(signum)
        elif not self._killed:
            self.message(
                f"received {signal_name(signum)} while stopping; "
                f"killing {count_processes(len(running))}"
            )
            self._kill_all()

    def _collect_exits(self) -> None:
        newly_failed: list[Rank] = []
        for rank in self._running():
            rank.status = exit_status_nowait(rank.process)
            if rank.status is not None and rank.status != 0:
                newly_failed.append(rank)
        if newly_failed and self._exit_code is None:
            first = newly_failed[0]
            assert first.status is not None
            self.first_failed_rank = first.rank
            self._exit_code = exit_code_of(first.status)
            self._on_rank_failure(first, first.status)

    def _on_rank_failure(self, failed: Rank, status: int) -> None:
        # Let the failed rank's last output (e.g. a traceback) come out first.
        if self._pump is not None:
            self._pump.wait_closed(FAILED_RANK_OUTPUT_TIMEOUT_S, rank=failed.rank)
        others = len(self._running())
        summary = f"rank {failed.rank}{failed.where()} {describe_status(status)}"
        if failed.control is not None and status == _REMOTE_SHELL_FAILED:
            summary += " (the remote shell's code when it cannot connect or start the command)"
        if others:
            summary += f"; stopping the other {count_processes(others)}"
        self.message(summary)
        self._begin_stop(signal.SIGTERM)

    # -- stop ----------------------------------------------------------------

    def _signal_groups(self, signum: int) -> None:
        for rank in self._ranks:
            signal_rank(rank, signum)

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
        remote_deadline = time.monotonic() + _REMOTE_EXIT_TIMEOUT_S
        for rank in self._ranks:
            if rank.control is not None:  # the wrapper has been told to kill
                try:
                    rank.process.wait(timeout=max(0.0, remote_deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    self.message(
                        f"rank {rank.rank}{rank.where()} did not report its exit; "
                        "killing its remote shell"
                    )
                kill_group(rank.process.pid, signal.SIGKILL)
            try:
                rank.process.wait(timeout=self._options.grace_seconds + 10)
            except subprocess.TimeoutExpired:
                self.message(
                    f"rank {rank.rank} (pid {rank.process.pid}) did not exit after SIGKILL"
                )
        if self._pump is not None:
            self._pump.stop(OUTPUT_THREAD_JOIN_TIMEOUT_S)
        else:
            for rank in self._ranks:  # spawning failed before the pump started
                for pipe in (rank.process.stdout, rank.process.stderr):
                    if pipe is not None:
                        pipe.close()


def kill_group(pid: int, signum: int) -> None:
    # Leaders are not reaped before Job._finish, so every pid here is still
    # ours and is the id of the rank's process group.
    try:
        os.killpg(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass  # the group is empty (or, for a zombie leader, only that)


def signal_rank(rank: Rank, signum: int) -> None:
    """Send signum to a rank: its process group here, or through the control
    channel to the wrapper on its host (which signals the rank's group there)."""
    if rank.control is not None:
        rank.control.signal(signum)
    else:
        kill_group(rank.process.pid, signum)


def placement_environment(placement: Placement, size: int) -> dict[str, str]:
    return {
        "CRING_RANK": str(placement.rank),
        "CRING_SIZE": str(size),
        "CRING_LOCAL_RANK": str(placement.local_rank),
        "CRING_LOCAL_SIZE": str(placement.local_size),
        "CRING_CROSS_RANK": str(placement.cross_rank),
        "CRING_CROSS_SIZE": str(placement.cross_size),
        "CRING_NODE_RANK": str(placement.host_index),
        "CRING_HOSTNAME": placement.host,
    }


def rank_environment(rank: int, size: int) -> dict[str, str]:
    return {
        "CRING_RANK": str(rank),
        "CRING_SIZE": str(size),
        "CRING_LOCAL_RANK": str(rank),
        "CRING_LOCAL_SIZE": str(size),
    }

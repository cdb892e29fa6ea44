# The launcher's side of ranks on other hosts: the remote-shell command line,
# the environment a remote rank gets, and the control channel (the ssh
# client's stdin) of remote_wrapper.py. Starts nothing itself (job.py does).
"""Remote ranks of cringrun: ssh command lines and the environment they forward."""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO

# Environment variable naming the remote-shell command (like --rsh).
RSH_ENV = "CRING_RSH"
# Forwarded to remote ranks when set in the launcher's environment, as
# horovodrun's ssh launch does for the interpreter and libraries to be found.
DEFAULT_FORWARDED = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH")
# Also forwarded: every variable of the launcher's environment with this
# prefix (cring's own knobs: CRING_TIMEOUT_SECONDS, CRING_TRANSPORT, ...).
FORWARDED_PREFIX = "CRING_"
# Options plain ssh gets unless a remote-shell command is given: never ask for
# a password (a job must not hang on a prompt).
_SSH_DEFAULTS = ("-o", "BatchMode=yes")

WRAPPER_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "remote_wrapper.py")


@dataclass(frozen=True)
class RemoteShell:
    """How to run a command on another host: `argv HOST 'command'`."""

    argv: tuple[str, ...]
    python: str  # the interpreter that runs remote_wrapper.py there

    def command_line(self, host: str, command: Sequence[str]) -> list[str]:
        """argv of the local remote-shell process that runs `command` (a rank's
        command, started through remote_wrapper.py) on `host`."""
        remote = [self.python, "-u", WRAPPER_PATH, "--", *command]
        return [*self.argv, host, "exec " + " ".join(shlex.quote(arg) for arg in remote)]


def remote_shell(
    rsh: str | None,
    ssh_port: int | None,
    identity_file: str | None,
    python: str | None,
    env: Mapping[str, str],
) -> RemoteShell:
    """--rsh (else $CRING_RSH, else ssh -o BatchMode=yes) with -p/-i added."""
    text = rsh if rsh is not None else env.get(RSH_ENV)
    if text is not None:
        argv = shlex.split(text)
        if not argv:
            raise ValueError("the remote-shell command (--rsh or CRING_RSH) is empty")
    else:
        argv = ["ssh", *_SSH_DEFAULTS]
    if ssh_port is not None:
        argv += ["-p", str(ssh_port)]
    if identity_file is not None:
        argv += ["-i", identity_file]
    return RemoteShell(tuple(argv), python or sys.executable)


def parse_exports(items: Sequence[str]) -> list[tuple[str, str | None]]:
    """-x VAR (its value here) and -x VAR=value, as (name, value or None)."""
    exports = []
    for item in items:
        name, sep, value = item.partition("=")
        if (
            not name
            or not (name[0].isalpha() or name[0] == "_")
            or not all(c.isalnum() or c == "_" for c in name)
        ):
            raise ValueError(f"-x {item!r}: expected VAR or VAR=value")
        exports.append((name, value if sep else None))
    return exports


def forwarded_environment(
    launcher_env: Mapping[str, str], exports: Sequence[tuple[str, str | None]]
) -> dict[str, str]:
    """What a remote rank gets on top of its login environment (before the
    job's and the rank's own CRING_* variables): PATH, PYTHONPATH,
    LD_LIBRARY_PATH and every CRING_* variable of the launcher, and the -x ones.
    A `-x VAR` that is not set here is skipped."""
    env = {k: v for k, v in launcher_env.items() if k.startswith(FORWARDED_PREFIX)}
    for name in DEFAULT_FORWARDED:
        if name in launcher_env:
            env[name] = launcher_env[name]
    for name, value in exports:
        if value is not None:
            env[name] = value
        elif name in launcher_env:
            env[name] = launcher_env[name]
    env.setdefault("PYTHONUNBUFFERED", launcher_env.get("PYTHONUNBUFFERED", "1"))
    return env


def spec_line(env: Mapping[str, str], cwd: str, grace_s: float) -> bytes:
    """The first line remote_wrapper.py reads from its stdin."""
    spec = {"env": dict(env), "cwd": cwd, "grace_s": grace_s}
    return json.dumps(spec, separators=(",", ":")).encode() + b"\n"


class ControlChannel:
    """The write end of a remote rank's stdin: its spec, then signals; closing
    it tells the wrapper the launcher is gone (it stops the rank)."""

    def __init__(self, pipe: IO[bytes]) -> None:
        self._pipe: IO[bytes] | None = pipe

    def send(self, data: bytes) -> bool:
        if self._pipe is None:
            return False
        try:
            self._pipe.write(data)
            self._pipe.flush()
            return True
        except (OSError, ValueError):  # the ssh client has exited
            self.close()
            return False

    def signal(self, signum: int) -> None:
        self.send(f"signal {int(signum)}\n".encode())
        if signum == signal.SIGKILL:
            self.close()

    def close(self) -> None:
        if self._pipe is not None:
            pipe, self._pipe = self._pipe, None
            try:
                pipe.close()
            except OSError:
                pass

# The remote side of a cringrun rank on another host, run over ssh as a plain
# script (`python .../remote_wrapper.py -- command ...`): standard library only,
# it must import nothing from cring (the remote PYTHONPATH is not set yet).
"""Runs one rank's command on a remote host for cringrun and ties its life to
the launcher's.

Protocol on standard input (the ssh channel, never a command line, so that no
value shows in `ps` on the remote host):

- the first line is a JSON object {"env": {...}, "cwd": "...", "grace_s": S}:
  variables added to the login environment, the directory to run in, and how
  long the command gets between SIGTERM and SIGKILL;
- then lines 'signal N': send signal N to the command's process group;
- end of file: the launcher is gone (it closed the channel, died, or the
  connection dropped): SIGTERM the command's group, SIGKILL after grace_s.

The command runs in its own session with /dev/null as stdin; its stdout and
stderr are this process's (the ssh channel). Signals this wrapper receives
(SIGHUP from sshd when a terminal closes, SIGINT, SIGTERM) are forwarded to
the command's group. When the command exits, what is left in its group is
killed and the wrapper exits with the command's code (128+N for signal N).
"""

import json
import os
import selectors
import signal
import subprocess
import sys
import time

_FORWARDED = (signal.SIGHUP, signal.SIGINT, signal.SIGTERM)
_READ_BYTES = 4096


def _say(text):
    try:
        os.write(2, f"cringrun (remote): {text}\n".encode("utf-8", "replace"))
    except OSError:
        pass


def _read_spec(buffer):
    """Read stdin up to the first newline; return (spec, rest) or (None, b'')."""
    while b"\n" not in buffer:
        chunk = os.read(0, _READ_BYTES)
        if not chunk:
            return None, b""
        buffer += chunk
    line, _, rest = buffer.partition(b"\n")
    return json.loads(line.decode("utf-8")), rest


def _status_nowait(pid):
    """Exit status as Popen.returncode, without reaping (the pid, which is also
    the group id, stays ours until the end); None while it runs."""
    info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    if info is None or info.si_pid == 0:
        return None
    if info.si_code == os.CLD_EXITED:
        return info.si_status
    return -info.si_status


def _killpg(pid, signum):
    try:
        os.killpg(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def main(argv):
    if not argv or argv[0] != "--" or len(argv) < 2:
        _say("usage: remote_wrapper.py -- command [args ...] (spec on stdin)")
        return 2
    command = argv[1:]
    try:
        spec, pending = _read_spec(b"")
    except (ValueError, OSError) as exc:
        _say(f"cannot read the launcher's spec on stdin: {exc}")
        return 1
    if spec is None:
        return 1  # the launcher went away before it sent anything
    env = dict(os.environ)
    env.update({str(k): str(v) for k, v in spec.get("env", {}).items()})
    grace_s = float(spec.get("grace_s", 5.0))
    cwd = spec.get("cwd")
    if cwd:
        try:
            os.chdir(cwd)
        except OSError as exc:
            _say(f"warning: cannot cd to {cwd} ({exc.strerror}); running in {os.getcwd()}")

    received = []
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write, warn_on_full_buffer=False)
    for signum in _FORWARDED:
        signal.signal(signum, lambda s, f: received.append(s))
    signal.signal(signal.SIGCHLD, lambda s, f: None)

    try:
        child = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
    except (OSError, ValueError) as exc:
        _say(f"cannot start {command[0]}: {getattr(exc, 'strerror', None) or exc}")
        if isinstance(exc, FileNotFoundError):
            return 127
        return 126 if isinstance(exc, PermissionError) else 1

    selector = selectors.DefaultSelector()
    selector.register(0, selectors.EVENT_READ)
    selector.register(wake_read, selectors.EVENT_READ)
    kill_deadline = None
    stdin_open = True
    while True:
        status = _status_nowait(child.pid)
        if status is not None:
            break
        for signum in received:
            _killpg(child.pid, signum)
        del received[:]
        while b"\n" in pending:
            line, _, pending = pending.partition(b"\n")
            words = line.split()
            if len(words) == 2 and words[0] == b"signal" and words[1].isdigit():
                _killpg(child.pid, int(words[1]))
        timeout_s = None
        if kill_deadline is not None:
            timeout_s = kill_deadline - time.monotonic()
            if timeout_s <= 0:
                _killpg(child.pid, signal.SIGKILL)
                kill_deadline, timeout_s = None, None
        for key, _ in selector.select(timeout_s):
            if key.fd == wake_read:
                try:
                    while os.read(wake_read, _READ_BYTES):
                        pass
                except BlockingIOError:
                    pass
                continue
            try:
                chunk = os.read(0, _READ_BYTES)
            except OSError:
                chunk = b""
            if chunk:
                pending += chunk
            elif stdin_open:  # the launcher is gone: stop the command
                stdin_open = False
                selector.unregister(0)
                _killpg(child.pid, signal.SIGTERM)
                kill_deadline = time.monotonic() + grace_s
    _killpg(child.pid, signal.SIGKILL)  # whatever the command left in its group
    child.wait()
    return status if status >= 0 else 128 - status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

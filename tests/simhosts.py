"""Simulated hosts on this one machine, for multi-host tests and benchmarks.

A host is a long-lived holder process in its own UTS and mount namespaces with
its own host name and a private tmpfs on /dev/shm: cring's host identity tells
such groups apart while all traffic stays on loopback. `SimHosts.popen` starts a
command inside a host (nsenter); `SimHosts.ssh` is the path of a fake `ssh` that
does the same for a launcher, with a login-like environment (PATH, HOME, LANG
only), so a launcher that forgets to forward a variable fails as over real ssh.
Needs root (or user namespaces) and util-linux; `unavailable()` says why not.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

_FAKE_SSH = r'''#!{python}
"""Fake ssh: `ssh [options] HOST COMMAND...` runs COMMAND with sh -c inside
HOST's namespaces (a simulated host from tests/simhosts.py)."""
import os, sys
HOSTS = {hosts!r}
args = sys.argv[1:]
takes_value = set("bcDEeFIiJLlmOopQRSWw")
while args and args[0].startswith("-"):
    opt = args.pop(0)
    if opt == "--":
        break
    if len(opt) == 2 and opt[1] in takes_value and args:
        args.pop(0)
if not args:
    sys.exit("fake ssh: no host given")
host = args.pop(0).split("@")[-1]
pidfile = os.path.join(HOSTS, host + ".pid")
if not os.path.exists(pidfile):
    sys.stderr.write("ssh: Could not resolve hostname %s: Name or service not known\n" % host)
    sys.exit(255)
log = os.path.join(HOSTS, "ssh.log")
with open(log, "a") as f:
    f.write(host + "\t" + " ".join(args) + "\n")
pid = open(pidfile).read().strip()
env = {{k: os.environ[k] for k in ("PATH", "HOME", "LANG") if k in os.environ}}
os.execvpe("nsenter", ["nsenter", "-t", pid, "--uts", "--mount", "--",
                       "sh", "-c", " ".join(args) or "true"], env)
'''


def unavailable() -> Optional[str]:
    """None when simulated hosts can be made here, else the reason they cannot."""
    for tool in ("unshare", "nsenter", "mount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    try:
        proc = subprocess.run(
            [
                "unshare",
                "--uts",
                "--mount",
                "--fork",
                "sh",
                "-c",
                "hostname cring-probe && mount -t tmpfs tmpfs /dev/shm",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare failed: {e}"
    if proc.returncode != 0:
        return f"unshare --uts --mount is refused here: {proc.stderr.strip()}"
    return None


class SimHosts:
    """`with SimHosts(["hostA", "hostB"]) as hosts:` starts the holders and
    removes them on exit. `hosts.ssh` is the fake ssh; `hosts.ssh_log` lists the
    commands it ran (host<TAB>command per line)."""

    def __init__(self, names: Sequence[str], workdir: Optional[str] = None):
        self.names = list(names)
        self._own_dir = workdir is None
        self.dir = Path(workdir or tempfile.mkdtemp(prefix="cring-hosts-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.ssh = str(self.dir / "ssh")
        self.ssh_log = self.dir / "ssh.log"
        self._holders: dict[str, subprocess.Popen] = {}
        self.pids: dict[str, int] = {}

    def __enter__(self) -> SimHosts:
        try:
            for name in self.names:
                self._start(name)
            Path(self.ssh).write_text(_FAKE_SSH.format(python=sys.executable, hosts=str(self.dir)))
            os.chmod(self.ssh, 0o755)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self, name: str) -> None:
        pidfile = self.dir / f"{name}.pid"
        script = (
            f"hostname {name} && mount -t tmpfs tmpfs /dev/shm && "
            f"echo $$ > {pidfile}.tmp && mv {pidfile}.tmp {pidfile} && exec sleep 86400"
        )
        holder = subprocess.Popen(
            ["unshare", "--uts", "--mount", "--fork", "sh", "-c", script],
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self._holders[name] = holder
        deadline = time.monotonic() + 30
        while not pidfile.exists():
            if holder.poll() is not None:
                raise RuntimeError(
                    f"simulated host {name} did not start (exit {holder.returncode})"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"simulated host {name} did not start within 30 s")
            time.sleep(0.02)
        self.pids[name] = int(pidfile.read_text())

    def argv(self, host: str, argv: Sequence[str]) -> list[str]:
        """argv that runs `argv` inside `host` (keeps the caller's environment)."""
        return ["nsenter", "-t", str(self.pids[host]), "--uts", "--mount", "--", *argv]

    def popen(self, host: str, argv: Sequence[str], **kw) -> subprocess.Popen:
        """Start `argv` inside `host`; keyword arguments go to subprocess.Popen."""
        return subprocess.Popen(self.argv(host, argv), **kw)

    def close(self) -> None:
        for holder in self._holders.values():
            if holder.poll() is None:
                try:
                    os.killpg(holder.pid, 9)
                except ProcessLookupError:
                    pass
                holder.wait(timeout=10)
        self._holders.clear()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

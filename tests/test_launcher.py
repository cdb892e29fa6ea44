# Tests of cringrun (python/cring/run.py): real processes started through
# `python -m cring.run`, each call under a hard timeout. They need an installed
# cring with its C extension built: the launcher serves the real store.
"""End-to-end tests of the cringrun launcher."""

from __future__ import annotations

import json
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

LAUNCHER = [sys.executable, "-m", "cring.run"]
TIMEOUT_S = 60
# A stopped job must end far sooner than its ranks' 60 s sleeps.
QUICK_S = 20


def launch(*args: str, timeout: float = TIMEOUT_S, **kwargs) -> subprocess.CompletedProcess[bytes]:
    """Run cringrun to completion and capture its output."""
    return subprocess.run(
        [*LAUNCHER, *args], check=False, capture_output=True, timeout=timeout, **kwargs
    )


def script(tmp_path: Path, name: str, source: str) -> list[str]:
    """Write a Python child program; return the command that runs it."""
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    return [sys.executable, str(path)]


def stdout_lines(result: subprocess.CompletedProcess[bytes]) -> list[str]:
    return result.stdout.decode().splitlines()


def pid_alive(pid: int) -> bool:
    """True if pid names a live (not zombie) process."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc: trust kill(0)
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_until_gone(pids: Sequence[int], timeout_s: float = 10.0) -> list[int]:
    """Processes reparented to init are reaped asynchronously; allow for it."""
    deadline = time.monotonic() + timeout_s
    alive = [pid for pid in pids if pid_alive(pid)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [pid for pid in alive if pid_alive(pid)]
    return alive


def restore_default_signals() -> None:
    # If the test runner was started with these ignored (nohup, a background
    # job), the launcher would rightly keep ignoring them; undo that here.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)


def start_launcher(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [*LAUNCHER, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=restore_default_signals,
    )


def read_until(
    process: subprocess.Popen[bytes],
    done: Callable[[bytes, bytes], bool],
    timeout_s: float = TIMEOUT_S,
) -> tuple[bytes, bytes]:
    """Read the launcher's stdout and stderr until done(stdout, stderr) holds."""
    assert process.stdout is not None and process.stderr is not None
    collected = {process.stdout.fileno(): b"", process.stderr.fileno(): b""}
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as selector:
        for fd in collected:
            selector.register(fd, selectors.EVENT_READ)
        while not done(collected[process.stdout.fileno()], collected[process.stderr.fileno()]):
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0 or not selector.get_map():
                process.kill()
                pytest.fail(f"launcher output never reached the expected state: {collected!r}")
            for key, _ in selector.select(remaining_s):
                chunk = os.read(key.fd, 65536)
                if chunk:
                    collected[key.fd] += chunk
                else:
                    selector.unregister(key.fd)
    return collected[process.stdout.fileno()], collected[process.stderr.fileno()]


def finish(
    process: subprocess.Popen[bytes], stdout: bytes, stderr: bytes
) -> tuple[int, bytes, bytes]:
    more_stdout, more_stderr = process.communicate(timeout=TIMEOUT_S)
    return process.returncode, stdout + more_stdout, stderr + more_stderr


# ---------------------------------------------------------------------------
# Success: environment, prefixes, streams
# ---------------------------------------------------------------------------

ENV_REPORTER = """
    import json, os, socket
    names = ["CRING_RANK", "CRING_SIZE", "CRING_LOCAL_RANK", "CRING_LOCAL_SIZE", "CRING_ADDR",
             "CRING_PORT", "CRING_SECRET", "CRING_STORE_EXTERNAL", "CRING_JOB_ID",
             "PYTHONUNBUFFERED", "CRING_TEST_INHERITED"]
    report = {name: os.environ.get(name) for name in names}
    # The launcher serves the store for the whole job: it must accept connections.
    store = (os.environ["CRING_ADDR"], int(os.environ["CRING_PORT"]))
    with socket.create_connection(store, timeout=10):
        report["store_reachable"] = True
    print(json.dumps(report))
"""


def run_env_reporter(tmp_path: Path, num_proc: int) -> list[dict]:
    env = dict(os.environ, CRING_TEST_INHERITED="from-the-launcher")
    env.pop("PYTHONUNBUFFERED", None)
    result = launch("-np", str(num_proc), *script(tmp_path, "env", ENV_REPORTER), env=env)
    assert result.returncode == 0, result.stderr.decode()
    reports = {}
    for line in stdout_lines(result):
        match = re.fullmatch(r"\[(\d+)\] (\{.*\})", line)
        assert match, f"line without a rank prefix: {line!r}"
        reports[int(match.group(1))] = json.loads(match.group(2))
    assert sorted(reports) == list(range(num_proc))
    return [reports[rank] for rank in range(num_proc)]


def test_all_ranks_succeed_with_prefixed_output_and_rank_environment(tmp_path: Path) -> None:
    reports = run_env_reporter(tmp_path, 3)
    for rank, report in enumerate(reports):
        assert report["CRING_RANK"] == str(rank)
        assert report["CRING_SIZE"] == "3"
        assert report["CRING_LOCAL_RANK"] == str(rank)
        assert report["CRING_LOCAL_SIZE"] == "3"
        assert report["CRING_ADDR"] == "127.0.0.1"
        assert report["CRING_STORE_EXTERNAL"] == "1"
        assert report["PYTHONUNBUFFERED"] == "1"
        assert report["CRING_TEST_INHERITED"] == "from-the-launcher"
        assert report["store_reachable"] is True
    port, secret, job_id = (
        reports[0]["CRING_PORT"],
        reports[0]["CRING_SECRET"],
        reports[0]["CRING_JOB_ID"],
    )
    assert 0 < int(port) < 65536
    assert re.fullmatch(r"[0-9a-f]{32}", secret)
    assert job_id
    for report in reports:  # one store, one secret, one job
        assert (report["CRING_PORT"], report["CRING_SECRET"], report["CRING_JOB_ID"]) == (
            port,
            secret,
            job_id,
        )


def test_every_job_gets_a_fresh_secret_and_job_id(tmp_path: Path) -> None:
    first, second = run_env_reporter(tmp_path, 1)[0], run_env_reporter(tmp_path, 1)[0]
    assert first["CRING_SECRET"] != second["CRING_SECRET"]
    assert first["CRING_JOB_ID"] != second["CRING_JOB_ID"]


def test_pythonunbuffered_set_by_the_user_is_kept(tmp_path: Path) -> None:
    child = script(tmp_path, "child", "import os; print(os.environ['PYTHONUNBUFFERED'])")
    result = launch("-np", "1", *child, env=dict(os.environ, PYTHONUNBUFFERED="user-value"))
    assert result.returncode == 0
    assert stdout_lines(result) == ["[0] user-value"]


def test_stderr_lines_are_prefixed_and_stay_on_stderr(tmp_path: Path) -> None:
    child = script(
        tmp_path,
        "child",
        """
        import os, sys
        rank = os.environ["CRING_RANK"]
        print(f"out {rank}")
        print(f"err {rank} a", file=sys.stderr)
        print(f"err {rank} b", file=sys.stderr)
        """,
    )
    result = launch("-np", "2", *child)
    assert result.returncode == 0
    assert sorted(stdout_lines(result)) == ["[0] out 0", "[1] out 1"]
    assert sorted(result.stderr.decode().splitlines()) == [
        "[0] err 0 a",
        "[0] err 0 b",
        "[1] err 1 a",
        "[1] err 1 b",
    ]


def test_lines_of_different_ranks_never_mix(tmp_path: Path) -> None:
    lines_per_rank = 2000
    child = script(
        tmp_path,
        "child",
        f"""
        import os, sys
        rank = os.environ["CRING_RANK"]
        for i in range({lines_per_rank}):
            # Several writes per line: the launcher must reassemble them.
            sys.stdout.write(f"rank={{rank}} ")
            sys.stdout.write(f"i={{i}} ")
            sys.stdout.write("y" * 300 + "\\n")
        """,
    )
    result = launch("-np", "4", *child)
    assert result.returncode == 0
    seen: dict[int, list[int]] = {rank: [] for rank in range(4)}
    for line in stdout_lines(result):
        match = re.fullmatch(r"\[(\d)\] rank=(\d) i=(\d+) y{300}", line)
        assert match, f"mixed or damaged line: {line[:120]!r}"
        assert match.group(1) == match.group(2)
        seen[int(match.group(1))].append(int(match.group(3)))
    for rank in range(4):
        assert seen[rank] == list(range(lines_per_rank))


def test_partial_last_line_is_printed(tmp_path: Path) -> None:
    child = script(
        tmp_path, "child", "import sys; sys.stdout.write('first\\nno newline at the end')"
    )
    result = launch("-np", "1", *child)
    assert result.returncode == 0
    assert result.stdout == b"[0] first\n[0] no newline at the end\n"


def test_bytes_that_are_not_utf8_pass_through(tmp_path: Path) -> None:
    child = script(
        tmp_path, "child", "import sys; sys.stdout.buffer.write(b'\\xff\\xfe\\x00 raw\\n')"
    )
    result = launch("-np", "1", *child)
    assert result.returncode == 0
    assert result.stdout == b"[0] \xff\xfe\x00 raw\n"


def test_large_output_on_both_streams_does_not_deadlock(tmp_path: Path) -> None:
    # 5 MB on rank 0's stdout and on rank 1's stderr, far beyond a pipe's buffer.
    lines = 50_000
    child = script(
        tmp_path,
        "child",
        f"""
        import os, sys
        rank = int(os.environ["CRING_RANK"])
        stream = sys.stdout.buffer if rank == 0 else sys.stderr.buffer
        line = (b"%d" % rank) * 99 + b"\\n"
        for _ in range({lines} // 1000):
            stream.write(line * 1000)
        stream.flush()
        """,
    )
    started = time.monotonic()
    result = launch("-np", "2", *child)
    assert result.returncode == 0
    assert result.stdout == (b"[0] " + b"0" * 99 + b"\n") * lines
    assert result.stderr == (b"[1] " + b"1" * 99 + b"\n") * lines
    assert time.monotonic() - started < TIMEOUT_S


def test_very_long_line_is_split_into_prefixed_pieces(tmp_path: Path) -> None:
    payload_bytes = 3 * 1024 * 1024 + 17
    child = script(
        tmp_path, "child", f"import sys; sys.stdout.write('z' * {payload_bytes} + '\\n')"
    )
    result = launch("-np", "1", *child)
    assert result.returncode == 0
    pieces = result.stdout.split(b"\n")
    assert pieces[-1] == b""
    assert all(piece.startswith(b"[0] ") for piece in pieces[:-1])
    assert b"".join(piece[4:] for piece in pieces[:-1]) == b"z" * payload_bytes


def test_no_prefix_relays_output_unchanged(tmp_path: Path) -> None:
    child = script(
        tmp_path,
        "child",
        "import os, sys; print('hello', os.environ['CRING_RANK']); sys.stdout.write('tail')",
    )
    result = launch("-np", "2", "--no-prefix", *child)
    assert result.returncode == 0
    text = result.stdout.decode()
    assert "[" not in text
    assert sorted(re.findall(r"hello \d", text)) == ["hello 0", "hello 1"]
    assert text.count("tail") == 2
    assert len(result.stdout) == 2 * len(b"hello 0\ntail")


def test_stdin_goes_to_rank_0_only(tmp_path: Path) -> None:
    child = script(tmp_path, "child", "import sys; print('read', repr(sys.stdin.read()))")
    result = launch("-np", "2", *child, input=b"hello")
    assert result.returncode == 0
    assert sorted(stdout_lines(result)) == ["[0] read 'hello'", "[1] read ''"]


def test_flags_after_the_command_belong_to_the_command(tmp_path: Path) -> None:
    child = script(tmp_path, "argv", "import json, sys; print(json.dumps(sys.argv[1:]))")
    child_args = ["-np", "5", "--no-prefix", "-h", "--grace-seconds", "x", "--", "-H", "a"]
    for launcher_args in (
        ["-np", "1"],
        ["-np", "1", "--"],
        ["--grace-seconds", "2", "-np=1", "--"],
    ):
        result = launch(*launcher_args, *child, *child_args)
        assert result.returncode == 0, result.stderr.decode()
        assert stdout_lines(result) == ["[0] " + json.dumps(child_args)]


def test_ranks_rendezvous_through_the_launchers_store(tmp_path: Path) -> None:
    # The launcher's store is the one cring.init() uses (CRING_STORE_EXTERNAL=1).
    child = script(
        tmp_path,
        "child",
        """
        import cring
        cring.init()
        cring.barrier()
        print("joined", cring.rank(), cring.size(), cring.local_rank(), cring.local_size())
        cring.shutdown()
        """,
    )
    result = launch("-np", "3", *child)
    assert result.returncode == 0, result.stderr.decode()
    assert sorted(stdout_lines(result)) == [f"[{r}] joined {r} 3 {r} 3" for r in range(3)]


# ---------------------------------------------------------------------------
# Failures: a rank dies, the others are stopped
# ---------------------------------------------------------------------------


def test_exit_code_of_a_single_failing_rank_is_returned(tmp_path: Path) -> None:
    child = script(tmp_path, "child", "import sys; sys.exit(5)")
    result = launch("-np", "1", *child)
    assert result.returncode == 5
    assert "cringrun: rank 0 exited with code 5" in result.stderr.decode()


FAIL_ONE_RANK = """
    import os, subprocess, sys, time
    rank = int(os.environ["CRING_RANK"])
    size = int(os.environ["CRING_SIZE"])
    directory = sys.argv[1]

    def publish(name, value):
        tmp = os.path.join(directory, name + ".tmp")
        with open(tmp, "w") as f:
            f.write(str(value))
        os.rename(tmp, os.path.join(directory, name))

    if rank != 1:
        if rank == 0:  # a child of a rank must be stopped too
            grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            publish("grandchild", grandchild.pid)
        publish(f"pid.{rank}", os.getpid())
        time.sleep(60)
        sys.exit(0)

    # Rank 1 fails once the others are known to be running.
    wanted = [f"pid.{r}" for r in range(size) if r != 1] + ["grandchild"]
    deadline = time.monotonic() + 30
    while not all(os.path.exists(os.path.join(directory, n)) for n in wanted):
        if time.monotonic() > deadline:
            sys.exit("the other ranks never started")
        time.sleep(0.01)
    print("rank 1 gives up", file=sys.stderr)
    sys.exit(3)
"""


def test_failing_rank_stops_the_others_quickly(tmp_path: Path) -> None:
    started = time.monotonic()
    result = launch("-np", "3", *script(tmp_path, "fail", FAIL_ONE_RANK), str(tmp_path))
    elapsed_s = time.monotonic() - started
    stderr = result.stderr.decode()
    assert result.returncode == 3, stderr
    assert elapsed_s < QUICK_S
    assert "[1] rank 1 gives up" in stderr.splitlines()
    assert (
        "cringrun: rank 1 exited with code 3; stopping the other 2 processes" in stderr.splitlines()
    )
    # The failing rank's own output comes before the summary.
    assert stderr.index("rank 1 gives up") < stderr.index("cringrun: rank 1 exited")
    pids = [int((tmp_path / name).read_text()) for name in ("pid.0", "pid.2", "grandchild")]
    assert wait_until_gone(pids) == []


def test_rank_killed_by_sigkill_gives_137(tmp_path: Path) -> None:
    child = script(
        tmp_path,
        "child",
        """
        import os, signal, time
        if os.environ["CRING_RANK"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
        """,
    )
    started = time.monotonic()
    result = launch("-np", "2", *child)
    assert result.returncode == 137
    assert time.monotonic() - started < QUICK_S
    assert "cringrun: rank 1 was killed by signal 9 (SIGKILL)" in result.stderr.decode()


def test_command_not_found_gives_127(tmp_path: Path) -> None:
    result = launch("-np", "2", str(tmp_path / "no-such-program"))
    assert result.returncode == 127
    assert "cannot start rank 0" in result.stderr.decode()


def test_command_not_executable_gives_126(tmp_path: Path) -> None:
    path = tmp_path / "not-executable"
    path.write_text("#!/bin/sh\n")
    path.chmod(0o644)
    result = launch("-np", "1", str(path))
    assert result.returncode == 126
    assert "cannot start rank 0" in result.stderr.decode()


# ---------------------------------------------------------------------------
# Signals sent to the launcher
# ---------------------------------------------------------------------------

SIGNAL_RECORDER = """
    import os, signal, sys, time
    rank = os.environ["CRING_RANK"]

    def record(signum, frame):
        with open(os.path.join(sys.argv[1], f"got.{rank}"), "w") as f:
            f.write(signal.Signals(signum).name)
        sys.exit(0)

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, record)
    print("ready", flush=True)
    time.sleep(60)
"""


def ranks_ready(count: int) -> Callable[[bytes, bytes], bool]:
    return lambda stdout, stderr: stdout.count(b"] ready\n") == count


@pytest.mark.parametrize(
    ("signum", "expected_code"),
    [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGHUP, 129)],
    ids=["SIGTERM", "SIGINT", "SIGHUP"],
)
def test_signal_to_launcher_is_forwarded_to_every_rank(
    tmp_path: Path, signum: int, expected_code: int
) -> None:
    # A generous grace period: this test is about forwarding. CI once found
    # rank 1's file missing with the right exit code; the likeliest cause is a
    # loaded machine where the rank did not run its handler within the default
    # 5 s before the launcher's SIGKILL (the message below would now say).
    process = start_launcher(
        "-np",
        "3",
        "--grace-seconds",
        "30",
        *script(tmp_path, "recorder", SIGNAL_RECORDER),
        str(tmp_path),
    )
    stdout, stderr = read_until(process, ranks_ready(3))
    process.send_signal(signum)
    code, stdout, stderr = finish(process, stdout, stderr)
    assert code == expected_code, stderr.decode()
    name = signal.Signals(signum).name
    for rank in range(3):
        got = tmp_path / f"got.{rank}"
        assert got.exists(), f"rank {rank} recorded no signal; launcher stderr:\n{stderr.decode()}"
        assert got.read_text() == name
    assert f"cringrun: received {name}; forwarding it to 3 processes" in stderr.decode()


IGNORES_SIGTERM = """
    import os, signal, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("ready", os.getpid(), flush=True)
    time.sleep(60)
"""


def ready_pids(stdout: bytes) -> list[int]:
    return [int(pid) for pid in re.findall(rb"\] ready (\d+)\n", stdout)]


def test_ranks_ignoring_sigterm_are_killed_after_the_grace_period(tmp_path: Path) -> None:
    process = start_launcher(
        "-np", "2", "--grace-seconds", "1", *script(tmp_path, "stubborn", IGNORES_SIGTERM)
    )
    stdout, stderr = read_until(process, lambda out, err: len(ready_pids(out)) == 2)
    started = time.monotonic()
    process.send_signal(signal.SIGTERM)
    code, stdout, stderr = finish(process, stdout, stderr)
    assert code == 143
    assert 1 <= time.monotonic() - started < QUICK_S
    assert "still running 1 s after SIGTERM; killing them" in stderr.decode()
    assert wait_until_gone(ready_pids(stdout)) == []


def test_second_signal_kills_at_once(tmp_path: Path) -> None:
    process = start_launcher(
        "-np", "2", "--grace-seconds", "50", *script(tmp_path, "stubborn", IGNORES_SIGTERM)
    )
    stdout, stderr = read_until(process, lambda out, err: len(ready_pids(out)) == 2)
    started = time.monotonic()
    process.send_signal(signal.SIGTERM)
    more_stdout, more_stderr = read_until(process, lambda out, err: b"forwarding" in err)
    stdout, stderr = stdout + more_stdout, stderr + more_stderr
    process.send_signal(signal.SIGINT)
    code, stdout, stderr = finish(process, stdout, stderr)
    assert code == 143  # the first cause decides the status
    assert time.monotonic() - started < QUICK_S
    assert "received SIGINT while stopping; killing 2 processes" in stderr.decode()
    assert wait_until_gone(ready_pids(stdout)) == []


def test_signal_during_a_failure_stop_keeps_the_failing_ranks_code(tmp_path: Path) -> None:
    child = script(
        tmp_path,
        "child",
        """
        import os, signal, sys, time
        if os.environ["CRING_RANK"] == "0":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            print("ready", flush=True)
            time.sleep(60)
        sys.exit(4)
        """,
    )
    process = start_launcher("-np", "2", "--grace-seconds", "50", *child)
    stdout, stderr = read_until(
        process, lambda out, err: b"ready" in out and b"exited with code 4" in err
    )
    process.send_signal(signal.SIGINT)
    code, stdout, stderr = finish(process, stdout, stderr)
    assert code == 4


# ---------------------------------------------------------------------------
# Usage errors
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-np", "2"], "missing the command"),
        (["-np", "2", "--"], "missing the command"),
        (["-np", "0", "true"], "expected an integer >= 1"),
        (["-np", "two", "true"], "expected an integer >= 1"),
        (["true"], "-np N"),
        (["-np", "2", "--grace-seconds", "-1", "true"], "seconds >= 0"),
        (["--bogus", "-np", "2", "true"], "unrecognized arguments: --bogus"),
    ],
    ids=[
        "no-command",
        "no-command-after-dashes",
        "np-zero",
        "np-not-a-number",
        "np-missing",
        "negative-grace",
        "unknown-option",
    ],
)
def test_usage_errors_exit_2(args: list[str], message: str) -> None:
    result = launch(*args)
    assert result.returncode == 2
    stderr = result.stderr.decode()
    assert "usage: cringrun -np N" in stderr
    assert message in stderr


@pytest.mark.parametrize("option", ["--hosts", "-H"])
def test_more_ranks_than_host_slots_is_a_usage_error(option: str) -> None:
    # Multi-host launch itself is tested in test_launcher_hosts.py.
    result = launch(option, "a:2,b:2", "-np", "5", "true")
    assert result.returncode == 2
    assert "-np 5 is more than the 4 slots of the hosts (a:2, b:2)" in result.stderr.decode()


def test_help_exits_0() -> None:
    result = launch("--help")
    assert result.returncode == 0
    assert "usage: cringrun -np N" in result.stdout.decode()


# ---------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------


def test_console_script(tmp_path: Path) -> None:
    cringrun = shutil.which("cringrun")
    if cringrun is None:
        pytest.skip("the cringrun console script is not installed")
    child = script(tmp_path, "child", "import os; print('rank', os.environ['CRING_RANK'])")
    result = subprocess.run(
        [cringrun, "-np", "2", *child], check=False, capture_output=True, timeout=TIMEOUT_S
    )
    assert result.returncode == 0, result.stderr.decode()
    assert sorted(stdout_lines(result)) == ["[0] rank 0", "[1] rank 1"]
    failing = subprocess.run(
        [cringrun, "-np", "2", sys.executable, "-c", "raise SystemExit(7)"],
        check=False,
        capture_output=True,
        timeout=TIMEOUT_S,
    )
    assert failing.returncode == 7


# ---------------------------------------------------------------------------
# Pieces of the launcher, in-process
# ---------------------------------------------------------------------------


def test_split_command_stops_at_the_first_non_option() -> None:
    from cring.launch.cli import split_command as _split_command

    assert _split_command(["-np", "2", "python", "-np", "3"]) == (
        ["-np", "2"],
        ["python", "-np", "3"],
    )
    assert _split_command(["-np", "2", "--", "-x"]) == (["-np", "2"], ["-x"])
    assert _split_command(["-np=2", "--no-prefix", "cmd"]) == (["-np=2", "--no-prefix"], ["cmd"])
    assert _split_command(["--grace-seconds", "3", "-n", "1", "cmd", "--"]) == (
        ["--grace-seconds", "3", "-n", "1"],
        ["cmd", "--"],
    )
    assert _split_command(["-np", "2"]) == (["-np", "2"], [])


def test_line_buffer_prefixes_whole_lines_only() -> None:
    from cring.launch.output import LineBuffer as _LineBuffer

    lines = _LineBuffer(b"[7] ", max_pending_bytes=8)
    assert lines.feed(b"ab") == b""
    assert lines.feed(b"c\nde\nf") == b"[7] abc\n[7] de\n"
    assert lines.feed(b"0123456789") == b"[7] f0123456789\n"  # over the cap: split
    assert lines.feed(b"tail") == b""
    assert lines.finish() == b"[7] tail\n"
    assert lines.finish() == b""

    raw = _LineBuffer(b"")
    assert raw.feed(b"a\nb") == b"a\n"
    assert raw.finish() == b"b"

"""cring.run(fn, ...), Horovod's horovod.run: results in rank order at 2 and 3
processes, a failing rank (the error names it and carries its exception),
a rank that dies, usage errors, `import cring as horovod`, remote hosts
(tests/simhosts.py), and `python -m cring.run` still the launcher. Every
scenario runs in a driver process (tests/workers/run_api.py, whose functions
live in __main__ as a script's do) under a hard timeout."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import simhosts

from conftest import WORKERS

TIMEOUT_S = 120


def drive(scenario: str, np_: int, *extra: str) -> tuple[dict, subprocess.CompletedProcess]:
    env = dict(os.environ, CRING_TIMEOUT_SECONDS="30")
    try:
        proc = subprocess.run(
            [sys.executable, str(WORKERS / "run_api.py"), scenario, str(np_), *extra],
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"cring.run hung for {TIMEOUT_S} s\nstdout:\n{e.stdout}\nstderr:\n{e.stderr}")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("OUTCOME ")]
    assert lines, f"no outcome\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return json.loads(lines[-1][len("OUTCOME ") :]), proc


@pytest.mark.parametrize("np_", [2, 3])
def test_results_come_back_in_rank_order(np_):
    outcome, _ = drive("ranks", np_)
    assert "error" not in outcome, outcome
    results = outcome["results"]
    total = np_ * (np_ + 1) / 2
    assert [r["rank"] for r in results] == list(range(np_))
    assert all(r["size"] == np_ and r["sum"] == total * 10 + 1 for r in results)
    assert len({r["pid"] for r in results} | {os.getpid()}) == np_ + 1, "one process a rank"


@pytest.mark.parametrize("np_", [2, 3])
def test_a_failing_rank_is_named_with_its_exception(np_):
    outcome, proc = drive("fail", np_)
    error = outcome["error"]
    assert error["type"] == "RunError" and error["rank"] == 1, error
    assert f"rank 1 of {np_} failed: ValueError: boom on rank 1 of {np_}" in error["message"]
    assert "fail_on_rank_1" in error["message"], "the worker's traceback"
    assert error["exception"] == f"ValueError('boom on rank 1 of {np_}')"
    assert error["cause"] == error["exception"]
    assert "[1]" in proc.stderr and "boom on rank 1" in proc.stderr, "the rank's own output"


def test_a_rank_that_dies_without_an_exception_is_named():
    outcome, _ = drive("exit", 3)
    error = outcome["error"]
    assert error["type"] == "RunError" and error["rank"] == 2, error
    assert (
        error["exit_code"] == 7 and "rank 2 failed without a Python exception" in error["message"]
    )


def test_import_cring_as_horovod_and_import_cring_run():
    outcome, _ = drive("horovod", 2)
    assert [r["sum"] for r in outcome["results"]] == [6.0, 6.0], outcome
    outcome, _ = drive("module", 2)
    assert [r["rank"] for r in outcome["results"]] == [0, 1] and outcome["main"], outcome


def test_elastic_options_run_cringrun_elastic_and_return_the_final_ranks():
    # worker 2 of 3 SIGKILLs itself before step 3; the two others finish on 2 ranks
    outcome, proc = drive("elastic", 3)
    assert "error" not in outcome, (outcome, proc.stderr[-3000:])
    results = outcome["results"]
    assert [(r["rank"], r["size"]) for r in results] == [(0, 2), (1, 2)]
    assert all(r["sizes"] == [3, 3, 3, 2, 2, 2] for r in results), results


def test_bad_options_are_a_value_error():
    outcome, _ = drive("usage", 3)
    assert outcome["error"]["type"] == "ValueError", outcome
    assert "slots" in outcome["error"]["message"], outcome


def test_python_m_cring_run_is_still_the_launcher():
    proc = subprocess.run(
        [sys.executable, "-m", "cring.run", "-np", "2", sys.executable, "-c", "print('hi')"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == ["[0] hi", "[1] hi"]
    assert "RuntimeWarning" not in proc.stderr, proc.stderr


@pytest.mark.skipif(simhosts.unavailable() is not None, reason=f"{simhosts.unavailable()}")
def test_hosts_run_ranks_over_the_remote_shell():
    with simhosts.SimHosts(["hostA", "hostB"]) as sim:
        outcome, _ = drive("hosts", 3, "hostA:1,hostB:2", sim.ssh)
    assert "error" not in outcome, outcome
    assert [(r["rank"], r["host"]) for r in outcome["results"]] == [
        (0, "hostA"),
        (1, "hostB"),
        (2, "hostB"),
    ]

"""Shared pytest helpers: run a worker script on N ranks under cringrun with a
hard timeout, so a hang fails the test instead of blocking the suite; the
GPU test doubles (`fakes`, built once per session; tests/fake_gpu.py) with
their seed in the header and in every failed test's report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import fake_gpu
import pytest

WORKERS = Path(__file__).parent / "workers"
DEFAULT_TIMEOUT_S = 240


def run_ranks(
    np_: int,
    script: str,
    *args: str,
    env: Optional[dict] = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """Run tests/workers/<script> on np_ ranks through `python -m cring.run`."""
    full_env = dict(os.environ)
    full_env.setdefault("CRING_TIMEOUT_SECONDS", "60")
    if env:
        full_env.update(env)
    cmd = [
        sys.executable,
        "-m",
        "cring.run",
        "-np",
        str(np_),
        sys.executable,
        str(WORKERS / script),
        *args,
    ]
    try:
        proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(
            f"{script} on {np_} ranks hung for {timeout} s\nstdout:\n{e.stdout}\n"
            f"stderr:\n{e.stderr}"
        )
    if check and proc.returncode != 0:
        pytest.fail(
            f"{script} on {np_} ranks exited {proc.returncode}\nstdout:\n"
            f"{proc.stdout[-6000:]}\nstderr:\n{proc.stderr[-6000:]}"
        )
    return proc


def rank_results(tmp_path: Path, np_: int) -> list[dict]:
    """The JSON each rank wrote to <tmp_path>/rank<R>.json."""
    out = []
    for r in range(np_):
        with open(tmp_path / f"rank{r}.json") as f:
            out.append(json.load(f))
    return out


# ---- the GPU test doubles ------------------------------------------------------------------


@pytest.fixture(scope="session")
def fakes(tmp_path_factory) -> fake_gpu.FakeGPU:
    """libfake_nccl.so, libfake_nccl_no_allgather.so and libfake_cudart.so
    (csrc/tests/fake_*.c), compiled once per session: fakes["nccl"] etc. are
    their paths, fakes.env(**extra) an environment for a process on them
    (seeded as the session is)."""
    try:
        return fake_gpu.FakeGPU(fake_gpu.build(tmp_path_factory.mktemp("fakes")))
    except RuntimeError as e:
        pytest.skip(str(e))


def pytest_report_header(config) -> str:
    return fake_gpu.FakeGPU().describe()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and "fakes" in getattr(item, "fixturenames", ()):
        report.sections.append(("fake GPU", fake_gpu.FakeGPU().describe()))

"""Shared pytest helpers: run a worker script on N ranks under cringrun with a
hard timeout, so a hang fails the test instead of blocking the suite."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

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

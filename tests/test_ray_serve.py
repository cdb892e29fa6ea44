"""examples/serve_ray.py end to end: CRingTrainer trains on a local Ray
instance, Ray Serve serves the checkpoint on 127.0.0.1, the example queries
it over HTTP and checks the answers against the checkpoint's model. Skipped,
with the reason printed, where ray[serve] cannot be imported. Hard timeout;
Serve and Ray are shut down (no process of that Ray instance is left)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

try:
    import ray.serve  # noqa: F401
except Exception as e:  # ImportError, or a Serve dependency that fails to load
    REASON = f"ray[serve] cannot be imported ({type(e).__name__}: {e}); pip install 'ray[serve]'"
    print(f"test_ray_serve: skipped: {REASON}")
    pytest.skip(REASON, allow_module_level=True)

from ray_cluster import (  # noqa: E402
    CRING_PATH,
    MARKER_VARIABLE,
    RAY_CLEANUP_TIMEOUT_S,
    RAY_SETTINGS,
    ray_processes,
)

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "serve_ray.py"
TIMEOUT_S = 600  # training, Serve's start and one query on a loaded 2-core machine (~3 min)


def test_serve_example_trains_serves_and_answers_over_http(tmp_path):
    marker = f"{os.getpid()}-{uuid.uuid4().hex}"
    env = {**RAY_SETTINGS, **os.environ, MARKER_VARIABLE: marker}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(CRING_PATH), env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLE), "--storage-path", str(tmp_path / "results")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(
            f"examples/serve_ray.py ran past {TIMEOUT_S} s:\n{stdout[-4000:]}\n{stderr[-4000:]}"
        )
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, stdout[-4000:] + stderr[-6000:]
    served = re.search(
        r"served 200 predictions over HTTP at http://127\.0\.0\.1:(\d+)/classify: "
        r"accuracy ([0-9.]+), equal to the checkpoint's model run locally",
        stdout,
    )
    assert served, stdout[-4000:]
    assert float(served.group(2)) > 0.5  # 4 classes: chance is 0.25
    assert re.search(r"trained: loss [0-9.]+; checkpoint ", stdout)
    deadline = time.monotonic() + RAY_CLEANUP_TIMEOUT_S
    while (left := ray_processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"Ray/Serve processes left after the example ended: {left}"

"""precision="16-mixed" (Lightning's GradScaler) with strategy="cring", on 2
CPU processes against strategy="ddp" (gloo): the strategy averages the scaled
gradients during backward, before Lightning unscales, clips and steps them.

Lightning picks MixedPrecision("16-mixed", "cuda") with a GradScaler by name
on a GPU (tests/test_lightning_cuda.py checks that); here the same plugin is
given for the CPU (fp16 autocast and GradScaler("cpu") exist in torch), so the
interplay runs for real: one step where rank 1's loss is infinite must be
skipped on both ranks, with the scale halved on both, exactly as DDP does,
and the final weights must equal DDP's. Both jobs run at once under one hard
timeout (tests/workers/lightning_amp.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("lightning")

WORKER = str(Path(__file__).parent / "workers" / "lightning_amp.py")
TIMEOUT_S = 300
ATOL = 1e-6
INF_STEP = 3  # as in the worker
INIT_SCALE = 2.0**12


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("amp")
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        CRING_TIMEOUT_SECONDS="120",
        PYTHONWARNINGS="ignore",
        PYTHONUNBUFFERED="1",
    )
    for name in ("MASTER_PORT", "LOCAL_RANK", "RANK", "WORLD_SIZE", "CRING_RANK", "CRING_SIZE"):
        env.pop(name, None)
    procs = {}
    for label in ("cring", "ddp"):
        log = open(out / f"{label}.log", "w")
        procs[label] = (
            subprocess.Popen(
                [sys.executable, WORKER, str(out), label, "--strategy", label],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            ),
            log,
        )
    deadline = time.monotonic() + TIMEOUT_S
    results = {}
    for label, (proc, log) in procs.items():
        try:
            status = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            status = "hung"
        log.close()
        ranks = []
        for r in range(2):
            path = out / f"{label}.rank{r}.json"
            ranks.append(json.loads(path.read_text()) if path.exists() else None)
        results[label] = {
            "status": status,
            "ranks": ranks,
            "log": (out / f"{label}.log").read_text()[-6000:],
        }
    return results


def _ranks(runs, label):
    entry = runs[label]
    assert entry["status"] == 0, entry["log"]
    assert all(r is not None for r in entry["ranks"]), entry["log"]
    return entry["ranks"]


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(max(abs(x - y) for x, y in zip(a[k], b[k])) for k in a)


def test_both_ranks_skip_the_overflowing_step_together(runs):
    for label in ("cring", "ddp"):
        ranks = _ranks(runs, label)
        assert [r["plugin"] for r in ranks] == ["MixedPrecision"] * 2
        assert ranks[0]["scales"] == ranks[1]["scales"], label
        scales = ranks[0]["scales"]
        # the scale stays until the infinite step, which halves it (the step is skipped)
        assert scales[:INF_STEP] == [INIT_SCALE] * INF_STEP, (label, scales)
        assert scales[INF_STEP] == INIT_SCALE / 2, (label, scales)
        assert all(r["finite"] for r in ranks), label


def test_weights_equal_ddp_and_across_ranks(runs):
    cring_ranks, ddp_ranks = _ranks(runs, "cring"), _ranks(runs, "ddp")
    assert _max_diff(cring_ranks[0]["params"], cring_ranks[1]["params"]) == 0
    assert _max_diff(cring_ranks[0]["params"], ddp_ranks[0]["params"]) <= ATOL
    assert cring_ranks[0]["scales"] == ddp_ranks[0]["scales"]
    assert cring_ranks[0]["global_step"] == ddp_ranks[0]["global_step"]

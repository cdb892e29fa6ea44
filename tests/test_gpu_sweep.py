"""Issue 26's sweep on a machine without a GPU: every dtype the CPU path
takes x every collective (allreduce in and out of place with Sum, Average,
Min, Max and scale factors on integers and floats; grouped allreduce and
allgather; broadcast; uneven allgather; uneven reducescatter; alltoall with
uneven splits) x shapes (17**3, 2**20 + 3, 1, odd 2-d) on FakeCudaTensor
inputs through the engine's CUDA backend and the test doubles, compared
byte for byte with the same calls on NumPy arrays in the same job
(tests/gpu/sweep.py). One worker process per rank runs the whole sweep:

- at world sizes 1, 2 and 3 (with a process set of one rank per rank at 2
  and 3), with the fake's one-rank reduce defect switched on
  (CRING_FAKE_NCCL_ONE_RANK_DEFECT=1) and an affected NCCL version reported
  (2.28.9): cring's guard keeps every result exact (without it the world
  size 1 Average and scaled results lose their last elements; docs/gpu.md,
  "NCCL versions"; csrc/tests/test_gpu_nccl.c shows the fake's defect on a
  version cring trusts).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import test_gpu_loader as loader

from test_bootstrap import free_port

GPU_TESTS = loader.GPU_TESTS
TIMEOUT_S = 300


def run_sweep(fakes: dict, world_size: int, **extra: str) -> list[dict]:
    env = loader.clean_env(
        CRING_NCCL_LIBRARY=fakes["nccl"],
        CRING_CUDART_LIBRARY=fakes["cudart"],
        CRING_FAKE_NCCL_TIMEOUT_S="60",
        CRING_FAKE_NCCL_SLOT_BYTES=str(16 << 20),
        **extra,
    )
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(GPU_TESTS / "sweep_worker.py")],
            env=dict(
                env,
                CRING_RANK=str(r),
                CRING_SIZE=str(world_size),
                CRING_ADDR="127.0.0.1",
                CRING_PORT=port,
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world_size)
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=TIMEOUT_S))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"sweep_worker.py on {world_size} ranks hung")
    reports = []
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        lines = out.strip().splitlines()
        if p.returncode != 0 or not lines or not lines[-1].startswith("{"):
            pytest.fail(f"rank {r} exited {p.returncode}\nstdout:\n{out[-3000:]}\n{err[-6000:]}")
        reports.append(json.loads(lines[-1]))
    return reports


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_every_dtype_and_collective_on_cuda_equals_the_cpu_path(fakes, world_size):
    """The fake reproduces NCCL 2.28.9's one-rank defect (it matters at world
    size 1 and on the one-rank process sets the sweep adds at 2 and 3)."""
    reports = run_sweep(
        fakes, world_size, CRING_FAKE_NCCL_ONE_RANK_DEFECT="1", CRING_FAKE_NCCL_VERSION="22809"
    )
    for rep in reports:
        assert rep["failures"] == [], "\n".join(rep["failures"])
        assert rep["cases"] > 900
        assert rep["nccl"]["version"] == "2.28.9" and rep["nccl"]["one_rank_guard"] is True
        # the reductions NCCL cannot do went through host memory, the rest through NCCL
        assert rep["stats"]["staged_bytes"] > 0 and rep["stats"]["nccl_calls"] > 100


def test_one_rank_on_a_fixed_nccl_gives_what_the_guard_gives(fakes):
    """On an NCCL without the defect (2.29.7+) one rank's scaled reductions go
    through NCCL's pre-multiplied sum, not the staged route: the same sweep,
    the float16 factor rounding included, gives the same results."""
    (rep,) = run_sweep(fakes, 1, CRING_FAKE_NCCL_VERSION="22907")
    assert rep["failures"] == [], "\n".join(rep["failures"])
    assert rep["nccl"]["one_rank_guard"] is False
    assert rep["cases"] > 900

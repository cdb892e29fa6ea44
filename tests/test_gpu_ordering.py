"""Ordering and lifetime on cring's CUDA path (issue 33), against the test
doubles' fake GPU (csrc/tests/fake_*.c: every stream's work runs late, on a
thread of its own; only events and the legacy default stream order streams)
and the stand-ins for torch's caching allocator (tests/gpu/fake_cuda.py,
fake_torch_cuda.py: a freed block serves the next allocation on its stream
at once). Each case keeps cring's stream busy first, so a tensor whose
memory cring lets go too early is handed out again and overwritten by
cring's late work: wrong values (tests/gpu/order_worker.py), at 2 and 3
ranks, every process under a hard timeout:

- a torch CUDA allgather inside use_stream() takes no room from torch's
  current stream, whose earlier kernels may still write a block it freed
  (finding 1);
- a tensor allocated on a side stream and freed right after synchronize(),
  or with its handle dropped, keeps its memory until cring's stream has run
  the work (finding 2);
- a batch that fails after queueing work keeps its tensors until that work
  has run (finding 8);
and the stand-in allocator itself: reuse on the same stream at once, on no
other, and record_stream's deferral; and tests/gpu/ordering_check.py (the
first step of tests/gpu/device_check.sh on a GPU lease) on the doubles.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import test_gpu_engine as engine_tests

TIMEOUT_S = 90


def run_mode(fakes, world_size: int, mode: str, **extra: str) -> list[dict]:
    env = fakes.env(CRING_FAKE_NCCL_TIMEOUT_S="20", **extra)
    ranks = engine_tests.start_ranks(world_size, mode, env, script="order_worker.py")
    for r in ranks:
        assert r["returncode"] == 0, r["stderr"]
    return ranks


@pytest.mark.parametrize("world_size", [2, 3])
def test_allgather_inside_use_stream_takes_no_room_of_torchs_stream(fakes, world_size):
    pytest.importorskip("torch")
    for r in run_mode(fakes, world_size, "room"):
        assert r["bad"] == [], r["bad"]


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_tensor_of_a_side_stream_lives_until_crings_stream_is_done(fakes, world_size):
    for r in run_mode(fakes, world_size, "third_stream"):
        assert r["bad"] == [], r["bad"]


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_failed_batch_keeps_its_tensors_until_its_queued_work_ran(fakes, world_size):
    ranks = run_mode(
        fakes,
        world_size,
        "failed_batch",
        CRING_FUSION_THRESHOLD="4096",
        CRING_FAKE_NCCL_SLOT_BYTES=str(64 << 10),
    )
    for r in ranks:
        assert r["raised"] == "ValueError", r  # NCCL refused the second tensor
        assert "CRING_FAKE_NCCL_SLOT_BYTES" in r["message"], r["message"]
        assert r["bad"] == [], r["bad"]
        assert r["after"] == [float(world_size)] * 3


def test_the_caching_allocator_stand_in(fakes):
    """A freed block serves the next allocation on its stream at once and no
    allocation on another; after record_stream(s) it waits until s has run
    what s had queued when the block was freed (torch's rules)."""
    code = textwrap.dedent(
        """
        import gc, json
        import numpy as np
        import fake_cuda as fc
        from fake_cuda import FakeCudaTensor as F
        from cring import _gpu

        out = {}
        with _gpu.use_stream(0x100):
            a = F(np.zeros(100, np.float32))
        first = a.data_ptr()
        del a
        gc.collect()
        with _gpu.use_stream(0x200):
            other = F(np.zeros(100, np.float32))  # another stream: not the freed block
        with _gpu.use_stream(0x100):
            same = F(np.zeros(100, np.float32))  # the same stream: the freed block at once
        out["other_stream_reuses"] = other.data_ptr() == first
        out["same_stream_reuses"] = same.data_ptr() == first
        # record_stream: freed while 0x300 still has 0.3 s of work queued
        same.record_stream(0x300)
        fc.busy(0x300, 300_000)
        del same
        gc.collect()
        with _gpu.use_stream(0x100):
            early = F(np.zeros(100, np.float32))
        out["reused_while_recorded_stream_busy"] = early.data_ptr() == first
        fc.drain(0x300)
        with _gpu.use_stream(0x100):
            late = F(np.zeros(100, np.float32))
        out["reused_after_recorded_stream_ran"] = late.data_ptr() == first
        print(json.dumps(out))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=fakes.env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr
    out = engine_tests.json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {
        "other_stream_reuses": False,
        "same_stream_reuses": True,
        "reused_while_recorded_stream_busy": False,
        "reused_after_recorded_stream_ran": True,
    }


def run_ordering_check(fakes, tmp_path, world_size: int, *args: str, **extra: str) -> list:
    """tests/gpu/ordering_check.py --fake on world_size ranks: each rank's checks."""
    cmd = [sys.executable, "-m", "cring.run", "-np", str(world_size), sys.executable]
    cmd += [str(engine_tests.GPU_TESTS / "ordering_check.py"), "--fake", "--out", str(tmp_path)]
    env = fakes.env(CRING_FAKE_NCCL_TIMEOUT_S="20", **extra)
    try:
        proc = subprocess.run(
            cmd + list(args), env=env, capture_output=True, text=True, timeout=3 * TIMEOUT_S
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"ordering_check.py on {world_size} ranks hung\n{e.stdout}\n{e.stderr}")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return [
        engine_tests.json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world_size)
    ]


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_gpu_leases_ordering_check_on_the_fakes_through_host_staging(
    fakes, tmp_path, world_size
):
    """The first step of tests/gpu/device_check.sh (two processes on one GPU
    through host staging) runs here against the doubles: side streams,
    tensors freed right after synchronize(), a process set added, used and
    removed between global calls: every check passes, exactly."""
    pytest.importorskip("torch")
    for checks in run_ordering_check(fakes, tmp_path, world_size, CRING_GPU_OPERATIONS="host"):
        assert [c["check"] for c in checks] == ["side_streams", "freed_after_sync", "process_sets"]
        assert all(c["ok"] for c in checks), checks


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_gpu_leases_ordering_check_on_the_fakes_through_nccl(fakes, tmp_path, world_size):
    """Its NCCL run (one process per GPU there), here at 2 and 3 ranks on the
    doubles: side streams, freed tensors and a bucket with other traffic
    through the engine's CUDA backend."""
    pytest.importorskip("torch")
    checks = "side_streams,freed_after_sync,bucket_with_traffic"
    for ranks in run_ordering_check(fakes, tmp_path, world_size, "--checks", checks):
        assert [c["check"] for c in ranks] == checks.split(",")
        assert all(c["ok"] for c in ranks), ranks


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_process_set_through_nccl_then_global_calls_on_the_fakes(fakes, tmp_path, world_size):
    """A set of every rank but the last, added, used on CUDA (through NCCL,
    on the set's own communicator) and removed between global CUDA calls,
    then 20 global allreduces: exact, < 10 s (finding 3: before, removing the
    set destroyed the members' global communicator and the ranks hung)."""
    pytest.importorskip("torch")
    for ranks in run_ordering_check(fakes, tmp_path, world_size, "--checks", "process_sets"):
        assert all(c["ok"] for c in ranks), ranks

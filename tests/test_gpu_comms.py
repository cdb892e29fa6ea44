"""NCCL communicators belong to the engine that made them (issue 33, findings
3 and 7), on a machine without a GPU, against the test doubles
(csrc/tests/fake_*.c) and FakeCudaTensor inputs, every process under a hard
timeout (tests/gpu/comms_worker.py):

- at 2 ranks, set {0}: rank 0 runs every collective of CUDA tensors on it
  through NCCL on the set's own communicator (nothing staged through host
  memory), exact; removing it destroys that communicator only, and 20 CUDA
  allreduces on the global set then complete, exact, within 10 s;
- at 3 ranks, set {0, 1}: the same collectives, and the set's allreduces
  between global ones while rank 2 runs only global ones; after the set is
  removed 20 global CUDA allreduces complete on every rank (before, the
  members' stop destroyed the global set's communicator too, so the ranks
  fell out of step and hung);
- while the engine is held inside ncclCommInitRank (the fake's init gate, for
  a second device's communicator), synchronize() of a handle that completed
  on the first device returns and another Python thread keeps running
  (before, synchronize took the lock the engine held across the set-up, with
  the GIL held, and every thread stopped).
"""

from __future__ import annotations

import test_gpu_engine as engine


def test_a_process_set_added_used_and_removed_leaves_the_global_set_working(fakes):
    """2 ranks, set {0}: rank 0 runs every collective on it through NCCL on
    the set's own communicator; after its removal 20 global CUDA allreduces
    complete, exact, within 10 s on both ranks."""
    ranks = engine.start_ranks(2, "set", engine.fake_env(fakes), script="comms_worker.py")
    for r in ranks:
        assert r["returncode"] == 0, r["stderr"]
        assert r["exact"] and r["seconds"] < 10, r
        assert r["staged"] == 0  # nothing went through host memory
        assert r["live_after"] == 1  # removing the set destroyed its communicator only
        assert r["live_at_exit"] == 0
    r0, r1 = ranks
    assert r0["set_allreduce"] == [1.0] * 6 and r0["set_broadcast"] == [0.0] * 3
    assert r0["set_allgather"] == [[0, 0]]
    assert r0["set_reducescatter"] == [[0.0, 1.0], [2.0, 3.0]]
    assert r0["set_alltoall"] == [[0], [1]]
    assert r0["made"] == 1 and r0["live"] == [1, 2] and r0["nccl_calls"] >= 5
    assert r1["made"] == 0 and r1["live"] == [1, 1] and "set_allreduce" not in r1


def test_a_strict_subset_and_the_others_keep_working(fakes):
    """3 ranks, set {0, 1}: every collective on it through NCCL, its
    allreduces between global ones while rank 2 runs only global ones; after
    its removal 20 global CUDA allreduces complete on every rank."""
    ranks = engine.start_ranks(3, "subset", engine.fake_env(fakes), script="comms_worker.py")
    for r in ranks:
        assert r["returncode"] == 0, r["stderr"]
        assert r["during"], r
        assert r["staged"] == 0
        assert r["live_during"] == (2 if r["rank"] < 2 else 1)
        assert r["live_after"] == 1
        assert r["exact"] and r["seconds"] < 10, r
    for r in ranks[:2]:
        assert r["set_allreduce"] == [3.0] * 6
        assert r["set_broadcast"] == [10.0] * 3  # from global rank 1
        assert r["set_allgather"] == [[0, 0], [1, 1], [1, 1]]
        rows = (0, 1) if r["rank"] == 0 else (2, 3)
        assert r["set_reducescatter"] == [[4.0 * k, 4.0 * k + 2] for k in rows]
        assert r["set_alltoall"] == [[0, 1], [1, 1]]


def test_synchronize_never_waits_for_an_engine_inside_nccl_set_up(fakes, tmp_path):
    env = dict(
        engine.fake_env(fakes, CRING_FAKE_CUDA_DEVICES="2"),
        CRING_FAKE_NCCL_LOG=str(tmp_path / "nccl.log"),
        CRING_FAKE_NCCL_TIMEOUT_S="15",  # the gate's bound: without the fix it fails, not hangs
    )
    ranks = engine.start_ranks(2, ["gate", str(tmp_path / "open")], env, script="comms_worker.py")
    for r in ranks:
        assert r["returncode"] == 0, r["stderr"]
        assert r["held"], r  # synchronize returned while cuda:1's set-up was still held
        assert r["counted"] >= 50, r  # and the other thread ran meanwhile
        assert r["y"] == [1.0] * 4 and r["z"] == [3.0] * 4
        assert r["live"] == 2

"""The out-of-place async allreduce (cring.allreduce_async and
cring.torch.allreduce_async; issue 29: queued in C for NumPy arrays and CPU
torch tensors) on real processes, over shared memory and TCP at 2 and 3
ranks: exact results into new tensors, inputs unchanged, fused bursts in
any order, mixed with in-place calls. The checks are in
tests/workers/out_of_place.py."""

import pytest

from conftest import rank_results, run_ranks

TIMEOUT_S = 300  # one job normally ends within a few seconds


@pytest.mark.parametrize("transport", ["auto", "tcp"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_out_of_place_async_exact(tmp_path, world_size, transport):
    proc = run_ranks(
        world_size,
        "out_of_place.py",
        str(tmp_path),
        env={"CRING_TRANSPORT": transport},
        timeout=TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]
    results = rank_results(tmp_path, world_size)
    for r, res in enumerate(results):
        assert res["rank"] == r and res["size"] == world_size
        assert res["transport"] == ("shm" if transport == "auto" else "tcp")
        assert res["failures"] == [], res["failures"]
        assert res["cases"] >= 60, res["cases"]

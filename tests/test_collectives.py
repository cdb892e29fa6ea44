"""Every collective x dtype x op x element count (0, 1, 7, 1_000_003) at world
sizes 1-4, over shared memory and over TCP, against NumPy references."""

import pytest

from conftest import rank_results, run_ranks


@pytest.mark.parametrize("transport", ["auto", "tcp"])
@pytest.mark.parametrize(
    "world_size",
    [1, 2, pytest.param(3, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)],
)
def test_matrix(tmp_path, world_size, transport):
    proc = run_ranks(
        world_size, "matrix.py", str(tmp_path), env={"CRING_TRANSPORT": transport}, check=False
    )
    results = rank_results(tmp_path, world_size) if proc.returncode == 0 else None
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]
    expected_transport = "self" if world_size == 1 else ("shm" if transport == "auto" else "tcp")
    for r, res in enumerate(results):
        assert res["rank"] == r and res["size"] == world_size
        assert res["transport"] == expected_transport
        assert res["failures"] == []
        assert res["cases"] > 400


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_unnamed_calls_match_in_order_and_hit_the_cache(tmp_path, transport):
    """Unnamed calls reuse a cycle of names: values right in long loops, more
    in flight than the cycle, sync and async mixed, mismatches still raise."""
    proc = run_ranks(2, "unnamed.py", env={"CRING_TRANSPORT": transport}, timeout=120)
    for r in range(2):
        assert f"rank {r}: unnamed ok" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("world_size", [2, 3])
def test_small_broadcast_and_allgather_fast_path(tmp_path, world_size):
    """broadcast_ and allgather bound in C, the small ones riding the
    negotiation round once cached: values, uneven first dimensions, limits."""
    proc = run_ranks(world_size, "small_moves.py", timeout=180)
    for r in range(world_size):
        assert f"rank {r}: small moves ok" in proc.stdout, proc.stdout + proc.stderr

"""Every collective x dtype x op x element count (0, 1, 7, 1_000_003) at world
sizes 1-4, over shared memory and over TCP, against NumPy references."""

import pytest

from conftest import rank_results, run_ranks


@pytest.mark.parametrize("transport", ["auto", "tcp"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
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

"""op=cring.Adasum against a NumPy reference of the pairwise tree at 2, 4 and 8
ranks (float64, float32, bfloat16, float16; single, grouped and fused
tensors, each with its own coefficients), through cring, cring.torch,
DistributedOptimizer and Lightning's reduce; orthogonal gradients sum, equal
ones average; a world size that is not a power of two is refused on every
rank."""

import numpy as np
import pytest

from conftest import rank_results, run_ranks


@pytest.mark.parametrize(
    "world_size,transport",
    [
        (2, "auto"),
        (2, "tcp"),
        pytest.param(4, "auto", marks=pytest.mark.slow),
        pytest.param(8, "auto", marks=pytest.mark.slow),
    ],
    ids=["np2-shm", "np2-tcp", "np4-shm", "np8-shm"],
)
def test_adasum_matches_pairwise_reference(tmp_path, world_size, transport):
    proc = run_ranks(
        world_size,
        "adasum.py",
        str(tmp_path),
        "reference",
        env={"CRING_TRANSPORT": transport},
        timeout=420,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]
    for r, res in enumerate(rank_results(tmp_path, world_size)):
        assert res["rank"] == r and res["size"] == world_size
        assert res["failures"] == []
        assert res["cases"] >= 28


def test_adasum_refuses_non_power_of_two_on_every_rank(tmp_path):
    proc = run_ranks(3, "adasum.py", str(tmp_path), "not_power", timeout=180, check=False)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]
    for res in rank_results(tmp_path, 3):
        assert res["failures"] == [] and res["cases"] == 3


def test_adasum_single_process_is_identity():
    """One rank: Adasum returns the tensor itself (no job needed)."""
    import cring

    cring.init(rank=0, size=1)
    try:
        x = np.array([1.5, -2.0, 0.0], np.float32)
        assert cring.allreduce(x, op=cring.Adasum).tolist() == [1.5, -2.0, 0.0]
    finally:
        cring.shutdown()

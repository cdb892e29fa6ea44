"""cring.alltoall and cring.join through the NumPy API, over shared memory
and TCP, at 2 and 3 ranks (workers/alltoall_join.py)."""

import pytest

from conftest import rank_results, run_ranks


@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_alltoall_and_join(tmp_path, np_, transport):
    run_ranks(
        np_, "alltoall_join.py", str(tmp_path), env={"CRING_TRANSPORT": transport}, timeout=120
    )
    results = rank_results(tmp_path, np_)
    assert [r["problems"] for r in results] == [[]] * np_
    assert {r["last"] for r in results} == {np_ - 1}

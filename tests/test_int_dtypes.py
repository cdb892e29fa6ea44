"""int16, uint16, uint32 and uint64 in every collective (allreduce with each op,
grouped, reducescatter, broadcast, allgather, alltoall), on NumPy arrays and
CPU torch tensors, at 2 ranks over shared memory and over TCP, against NumPy
references with the same wrap-around."""

import numpy as np
import pytest

from conftest import rank_results, run_ranks


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_int_dtypes_every_collective(tmp_path, transport):
    proc = run_ranks(
        2, "int_dtypes.py", str(tmp_path), env={"CRING_TRANSPORT": transport}, check=False
    )
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]
    for r, res in enumerate(rank_results(tmp_path, 2)):
        assert res["rank"] == r
        assert res["failures"] == []
        assert res["cases"] > 300


def test_int_dtypes_single_process_names():
    """The dtype names the C core reads from NumPy and torch (DLPack) tensors."""
    import cring._C as C

    torch = pytest.importorskip("torch")
    for name in ("int16", "uint16", "uint32", "uint64"):
        for x in (np.zeros(3, dtype=name), torch.zeros(3, dtype=getattr(torch, name))):
            shape, dtype_name, _ = C.tensor_info(x, "x")
            assert tuple(shape) == (3,) and dtype_name == name

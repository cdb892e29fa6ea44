"""Bad input gets a Python exception naming the problem, never a crash or a
hang (issue: core, item 6). Single-process cases run in this process; the
cross-rank ones on real processes with a hard timeout."""

import inspect

import numpy as np
import pytest

import cring

from conftest import run_ranks
from fake_dlpack import FakeTensor


@pytest.fixture
def single():
    cring.init(rank=0, size=1)
    yield
    cring.shutdown()


def test_call_before_init_raises():
    assert not cring.is_initialized()
    with pytest.raises(cring.NotInitializedError, match="init"):
        cring.allreduce(np.ones(3))
    with pytest.raises(ValueError):  # Horovod raised ValueError here; so do we
        cring.barrier()
    with pytest.raises(cring.CRingError):
        cring.rank()


def test_non_contiguous_tensor(single):
    # out of place: copied, as Horovod does; in place: the caller's memory, refused
    x = np.arange(16, dtype=np.float32).reshape(4, 4)[:, ::2]
    assert np.array_equal(cring.allreduce(x, op=cring.Sum, name="grads"), x)
    with pytest.raises(ValueError, match=r"'grads_' is not contiguous"):
        cring.allreduce_(x, name="grads_")
    with pytest.raises(ValueError, match="not contiguous"):
        cring.broadcast_(np.ones((3, 3)).T, 0)


@pytest.mark.parametrize("dtype", [np.complex64, np.complex128, np.float128])
def test_unsupported_dtype(single, dtype):
    with pytest.raises((TypeError, ValueError), match=r"'w'.*dtype|'w'.*DLPack"):
        cring.allreduce(np.zeros(3, dtype=dtype), name="w")


def test_bool_cannot_be_reduced(single):
    with pytest.raises(TypeError, match=r"'mask'.*bool"):
        cring.allreduce(np.zeros(3, dtype=bool), op=cring.Sum, name="mask")
    # ...but moves fine
    assert cring.broadcast(np.array([True, False]), 0).tolist() == [True, False]


def test_cuda_tensor_without_nccl(single, monkeypatch):
    """No NCCL on this machine: the error names the tensor and what to install."""
    monkeypatch.setenv("CRING_NCCL_LIBRARY", "/nonexistent/libnccl.so.2")
    fake = FakeTensor(np.zeros(4, dtype=np.float32), device_type=2)
    with pytest.raises(cring.CRingError, match=r"'g' is on cuda:0.*nvidia-nccl"):
        cring.allreduce_(fake, name="g")


def test_not_a_tensor(single):
    with pytest.raises(TypeError, match="DLPack"):
        cring.allreduce([1.0, 2.0])


def test_root_rank_out_of_range(single):
    with pytest.raises(ValueError, match=r"root_rank 1 is out of range for size 1"):
        cring.broadcast(np.ones(2), root_rank=1)
    with pytest.raises(ValueError, match="out of range"):
        cring.broadcast_(np.ones(2), root_rank=-1)


def test_read_only_output(single):
    x = np.ones(3)
    x.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        cring.allreduce_(x)
    assert cring.allreduce(x).tolist() == [1.0, 1.0, 1.0]  # reading is fine


def test_unknown_op_and_adasum(single):
    with pytest.raises(ValueError, match="unknown reduction op"):
        cring.allreduce(np.ones(2), op=42)
    # Adasum on one rank is the identity; it reduces floating tensors only
    assert cring.allreduce(np.array([1.0, -2.0]), op=cring.Adasum).tolist() == [1.0, -2.0]
    with pytest.raises(TypeError, match=r"'ints'.*Adasum.*int64"):
        cring.allreduce(np.ones(2, np.int64), op=cring.Adasum, name="ints")
    with pytest.raises(NotImplementedError, match=r"'rs'.*reducescatter does not support Adasum"):
        cring.reducescatter(np.ones(2), op=cring.Adasum, name="rs")


def test_named_numpy_allreduce_in_place_checks_like_the_general_path(single):
    """cring.allreduce_ on a NumPy array with a name is bound and run in C
    (no Python frame); it must refuse what the general path refuses, with the
    same messages, and hand every other call to the general path."""
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert cring.allreduce_(x, cring.Sum, "pos") is x  # positional arguments
    assert x.tolist() == [[0, 1, 2], [3, 4, 5]]
    scalar = np.array(2.5)
    assert cring.allreduce_(scalar, name="scalar") is scalar and float(scalar) == 2.5
    assert cring.allreduce_(np.zeros(0, np.int64), op=cring.Max, name="empty").shape == (0,)
    with pytest.raises(ValueError, match=r"'strided' is not contiguous"):
        cring.allreduce_(np.ones((4, 4), np.float32)[:, ::2], name="strided")
    ro = np.ones(3)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match=r"'ro' is read-only"):
        cring.allreduce_(ro, name="ro")
    with pytest.raises(ValueError, match="'swapped'"):  # non-native byte order
        cring.allreduce_(np.ones(3, dtype=">f4"), name="swapped")
    with pytest.raises((TypeError, ValueError), match=r"'c'.*dtype|'c'.*DLPack"):
        cring.allreduce_(np.ones(3, np.complex64), name="c")
    with pytest.raises(TypeError, match=r"'mask'.*bool"):
        cring.allreduce_(np.zeros(3, bool), op=cring.Sum, name="mask")
    for bad in (42, -1, "sum", 1.5):
        with pytest.raises(ValueError, match="unknown reduction op"):
            cring.allreduce_(np.ones(2), op=bad, name="op")
    with pytest.raises(TypeError, match=r"'op'.*Adasum"):
        cring.allreduce_(np.ones(2, np.int32), op=cring.Adasum, name="op")
    with pytest.raises(TypeError, match="unexpected keyword argument 'nmae'"):
        cring.allreduce_(np.ones(2), nmae="typo")
    with pytest.raises(TypeError, match="multiple values for argument 'op'"):
        cring.allreduce_(np.ones(2), cring.Sum, op=cring.Sum, name="twice")
    # the general path: generated names, scaling, compression
    y = np.ones(4, np.float32)
    assert cring.allreduce_(y, op=cring.Sum, prescale_factor=2.0, name="scaled") is y
    assert y.tolist() == [2.0] * 4
    assert cring.allreduce_(y, compression=cring.Compression.fp16).tolist() == [2.0] * 4
    assert "tensor" in str(inspect.signature(cring.allreduce_))


def test_mismatches_raise_on_every_rank(tmp_path):
    """Ranks that disagree on shape, dtype, op or root all raise MismatchError,
    and the next collective still works."""
    proc = run_ranks(3, "mismatch.py", str(tmp_path), timeout=120)
    for r in range(3):
        assert f"rank {r}: all mismatches raised" in proc.stdout

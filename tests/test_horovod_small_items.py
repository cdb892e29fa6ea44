"""Horovod's behaviour on the smaller items of issue 27, at 2 ranks
(tests/workers/horovod_small_items.py, hard timeout): the Horovod-knob
warning points at the user's init() line; out-of-place collectives copy a
non-contiguous input, in-place ones refuse it; in-place collectives refuse a
leaf that requires grad as torch does (not under no_grad); the
unsupported-dtype error lists every supported dtype; broadcast_object's
pickling failures raise on every rank."""

import pytest

from conftest import rank_results, run_ranks

pytest.importorskip("torch")


def test_horovod_small_items(tmp_path):
    proc = run_ranks(
        2,
        "horovod_small_items.py",
        str(tmp_path),
        env={"HOROVOD_NOT_A_KNOB": "1"},
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]
    for r, res in enumerate(rank_results(tmp_path, 2)):
        assert res["rank"] == r and res["size"] == 2
        assert res["cases"] == 5
        assert res["failures"] == [], res["failures"]


def test_out_of_place_input_copy_is_not_the_callers(tmp_path):
    """The contiguous copy is cring's own: the caller's strided NumPy array and
    torch tensor are returned to them untouched, and contiguous ones are not copied."""
    import numpy as np
    import torch

    from cring._tensors import contiguous

    a = np.arange(12.0).reshape(3, 4)
    assert contiguous(a) is a
    s = contiguous(a.T)
    assert s.flags.c_contiguous and np.array_equal(s, a.T) and not np.shares_memory(s, a)
    t = torch.arange(12.0).reshape(3, 4)
    assert contiguous(t) is t
    u = contiguous(t.t())
    assert u.is_contiguous() and torch.equal(u, t.t())

"""DistributedOptimizer(gradient_as_bucket_view=True) at 2 ranks over shared
memory: the same training as the usual path under zero_grad(set_to_none=True
and False), gradient accumulation and a parameter group added later, with
gradients as views into the shared buckets (tests/workers/torch_bucket_view.py;
the in-place allreduce itself: csrc/tests/test_regions.c)."""

import pytest

from conftest import run_ranks

pytest.importorskip("torch")


def test_bucket_view_trains_like_the_usual_path():
    proc = run_ranks(2, "torch_bucket_view.py", timeout=120)
    assert proc.stdout.count(": ok") == 2, proc.stdout[-4000:]

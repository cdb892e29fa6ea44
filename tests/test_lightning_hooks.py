"""CRingStrategy(comm_hook=powerSGD_hook, comm_state=PowerSGDState(...)):
a fit, a checkpoint holding the hook's state, a resume that starts from it,
and shard_state=1 with the hook (tests/workers/lightning_hooks.py, 2 ranks
under cringrun, one job, hard timeout); the arguments it refuses, without
processes."""

import pytest

from conftest import rank_results, run_ranks

pytest.importorskip("lightning")

from cring.lightning import CRingStrategy  # noqa: E402
from cring.torch import hooks  # noqa: E402


def test_fit_checkpoint_and_resume_with_the_hook_state(tmp_path):
    proc = run_ranks(2, "lightning_hooks.py", str(tmp_path), timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]
    for r, res in enumerate(rank_results(tmp_path, 2)):
        assert res["rank"] == r and res["failures"] == [], res["failures"]
        assert res["cases"] == 3


def test_strategy_refuses_what_a_hook_cannot_do():
    with pytest.raises(ValueError, match="shard_state=2"):
        CRingStrategy(comm_hook=hooks.powerSGD_hook, shard_state=2)
    with pytest.raises(TypeError, match="comm_hook must be callable"):
        CRingStrategy(comm_hook="powerSGD")
    with pytest.raises(ValueError, match="without a comm_hook"):
        CRingStrategy(comm_state=hooks.PowerSGDState())

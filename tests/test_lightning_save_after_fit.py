"""trainer.save_checkpoint() after fit() with CRingStrategy(shard_state=1 | 2)
when the strategy joined cring itself (so fit() ends by shutting it down):
the checkpoint holds the whole optimizer state, equal to an unsharded run's,
and a new Trainer resumes from it (tests/workers/lightning_save_after_fit.py,
2 ranks under cringrun, hard timeout)."""

import pytest

from conftest import rank_results, run_ranks

pytest.importorskip("lightning")

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("stage", [1, 2])
def test_sharded_save_checkpoint_after_fit_resumes(tmp_path, stage):
    proc = run_ranks(
        2, "lightning_save_after_fit.py", str(tmp_path), str(stage), timeout=240, check=False
    )
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]
    for r, res in enumerate(rank_results(tmp_path, 2)):
        assert res["rank"] == r and res["failures"] == [], res["failures"]
        assert res["cases"] == 2
        assert res["moved"] > 1e-4  # the resumed epochs trained
        assert res["adam_steps"] and all(s > 0 for s in res["adam_steps"])

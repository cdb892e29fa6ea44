"""cring.torch.SyncBatchNorm on 2 and 3 real ranks with uneven batch sizes
(3, 5, 4): outputs, input/weight/bias gradients and running statistics equal
torch's BatchNorm1d/2d/3d on the concatenated batch; eval mode matches;
convert_sync_batchnorm converts nested layers keeping their tensors
(tests/workers/sync_batchnorm.py). Lightning's sync_batchnorm=True is in
test_lightning.py."""

import pytest

from conftest import rank_results, run_ranks

torch = pytest.importorskip("torch")

TOL = 1e-5


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def results(request, tmp_path_factory):
    np_ = request.param
    tmp = tmp_path_factory.mktemp(f"syncbn{np_}")
    run_ranks(np_, "sync_batchnorm.py", str(tmp), timeout=180)
    return rank_results(tmp, np_)


@pytest.mark.parametrize("case", ["1d", "1d_seq", "2d", "3d_cma", "2d_noaffine"])
def test_equals_one_process_batchnorm(results, case):
    for res in results:
        errors = res["cases"][case]
        bad = {k: v for k, v in errors.items() if not v <= TOL}
        assert not bad, f"rank {res['rank']}: {bad}"
        assert "dx1" in errors and "rv1" in errors


def test_convert_keeps_tensors(results):
    for res in results:
        names = res["converted"]
        assert names.count("SyncBatchNorm") == 2
        assert "BatchNorm2d" not in names and "BatchNorm1d" not in names
        assert res["same_tensors"]


def test_rank_with_empty_batch(results):
    assert results[0]["empty_rank_out_shape"] == [0, 4]
    assert results[1]["empty_rank_out_shape"] == [3, 4]


def test_single_process_and_bad_input():
    from cring.torch import SyncBatchNorm

    bn = SyncBatchNorm(3)  # not initialised: plain batch norm
    ref = torch.nn.BatchNorm1d(3)
    x = torch.randn(5, 3)
    assert torch.allclose(bn(x), ref(x), atol=TOL)
    with pytest.raises(ValueError, match="at least 2D"):
        bn(torch.randn(3))
    with pytest.raises(ValueError, match="process_group"):
        SyncBatchNorm(3, process_group=object())


@pytest.mark.slow
def test_lightning_sync_batchnorm(tmp_path):
    """Trainer(strategy="cring", sync_batchnorm=True) on 2 ranks with different
    data per rank: batch norm is cring's SyncBatchNorm during fit (plain
    BatchNorm1d again after it), and both ranks end with the same running
    statistics and weights."""
    pytest.importorskip("lightning")
    run_ranks(2, "lightning_syncbn.py", str(tmp_path), timeout=240)
    a, b = rank_results(tmp_path, 2)
    for res in (a, b):
        assert res["size"] == 2
        assert res["classes_in_fit"] == ["SyncBatchNorm"]
        assert res["class_after_fit"] == "BatchNorm1d"
    assert a["running_mean"] == pytest.approx(b["running_mean"], abs=1e-6)
    assert a["running_var"] == pytest.approx(b["running_var"], abs=1e-6)
    assert max(abs(v) for v in a["running_mean"]) > 0.05  # the statistics moved
    for wa, wb in zip(a["weights"], b["weights"]):
        assert wa == pytest.approx(wb, abs=1e-6)

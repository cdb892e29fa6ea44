"""Sharded optimizer state, DistributedOptimizer(shard_state=1 | 2), on real
processes at 1, 2 and 3 ranks (tests/workers/zero_*.py): equal to the
unsharded optimizer, each rank keeping 1/P of the state (and, stage 2, of the
gradients), consolidated state dicts equal to the unsharded ones, and a
checkpoint saved at 3 ranks resuming at 2 exactly as an unsharded resume.
Every job has a hard timeout."""

import json

import pytest

from conftest import rank_results, run_ranks

pytest.importorskip("torch")

TIMEOUT_S = 240  # per job; each normally ends within 30 s on a quiet machine


def run_worker(tmp_path, np_, script, *args):
    proc = run_ranks(np_, script, str(tmp_path), *args, timeout=TIMEOUT_S, check=False)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="module", params=[1, 2, 3], ids=["1rank", "2ranks", "3ranks"])
def trained(request, tmp_path_factory):
    np_ = request.param
    tmp = tmp_path_factory.mktemp(f"zero{np_}")
    run_worker(tmp, np_, "zero_train.py")
    results = rank_results(tmp, np_)
    for r, res in enumerate(results):
        assert res["rank"] == r and res["size"] == np_
    return np_, results


def failures(results, label):
    return [f for res in results for f in res["failures"] if f.startswith(label + ":")]


@pytest.mark.parametrize("kind", ["adam", "sgd"])
@pytest.mark.parametrize("stage", [1, 2])
def test_equals_unsharded(trained, kind, stage):
    """20 steps, two param groups with different lr, a parameter count that
    neither 2 nor 3 divides (a large parameter sent alone, small ones packed,
    a 0-d and a transposed one, a frozen one, one only rank 0 uses):
    parameters within 1e-6 of the unsharded DistributedOptimizer's, equal on
    every rank; state_dict() equals the unsharded state dict, also through
    consolidate_state_dict(to=0) (other ranks then get a clear error); a new
    optimizer loading it continues identically."""
    np_, results = trained
    label = f"{kind} stage {stage}"
    assert failures(results, label) == []
    for res in results:
        s = res["scenarios"][label]
        assert s["diff"] <= 1e-6 and s["ranks_differ"] == 0.0, s


@pytest.mark.parametrize("stage", [1, 2])
def test_each_rank_keeps_its_share(trained, stage):
    """Adam's two moments exist for this rank's slices only: at most 1/P of
    the parameters plus one element per parameter (the uneven split); with
    stage 2 the reduced gradient too, and no full gradient is left."""
    np_, results = trained
    for res in results:
        s = res["scenarios"][f"adam stage {stage}"]
        share = s["trainable_numel"] / np_ + s["count"]
        assert s["shard_numel"] <= share, s
        assert s["state_numel"] == 2 * s["shard_numel"], s
        if stage == 2 and np_ > 1:  # (one rank: its share is all of .grad)
            assert s["grad_numel"] <= share and s["full_grad_numel"] == 0, s
            assert s["grad_numel"] > 0
    total = sum(res["scenarios"]["adam stage 1"]["shard_numel"] for res in results)
    assert total == results[0]["scenarios"]["adam stage 1"]["trainable_numel"]


@pytest.mark.parametrize("stage", [1, 2])
def test_collectives_the_cuda_backend_runs(trained, stage):
    """A step uses only collectives that the engine's CUDA backend runs
    through NCCL (allreduce, reducescatter, allgather, broadcast; never
    alltoall): stage 1 allreduces, stage 2 reduce-scatters; both send the
    updated slices of a large parameter as one in-place broadcast per rank
    and those of the small ones as an allgather of a packed row."""
    np_, results = trained
    calls = results[0]["scenarios"][f"sgd stage {stage}"]["calls"]
    if np_ == 1:
        assert calls == {}, calls
        return
    assert not any(name.startswith("alltoall") for name in calls), calls
    assert calls.get("allgather_async") == 1, calls  # the packed small parameters
    assert calls.get("broadcast_async_") == np_, calls  # one large parameter, P slices
    if stage == 1:
        assert set(calls) <= {
            "allreduce_async_",
            "grouped_allreduce_async_",
            "allgather_async",
            "broadcast_async_",
        }, calls
    else:
        assert set(calls) == {"reducescatter_async", "allgather_async", "broadcast_async_"}, calls


@pytest.mark.parametrize(
    "label",
    [
        "closure and accumulation",
        "skip_synchronize and clip_grad_norm_",
        "scheduler made before wrapping",
        "refusals",
    ],
)
def test_controls(trained, label):
    """step(closure), backward_passes_per_step=2, synchronize() +
    clip_grad_norm_ + step() in skip_synchronize() give the unsharded
    results, and so does an LR scheduler made before the wrapping (its patch
    of the original's step must not bypass the wrapper's); LBFGS, an unknown
    optimizer (until it opts in), a bad shard_state, groups with stage 2 and
    add_param_group are refused."""
    _, results = trained
    assert failures(results, label) == []


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_checkpoint_saved_at_3_ranks_resumes_at_2(tmp_path, stage):
    """Saved at 3 ranks (state_dict() is the unsharded state), loaded at 2
    ranks into a sharded and into an unsharded optimizer: 10 more steps give
    the same parameters (within 1e-6) and the same state."""
    run_worker(tmp_path, 3, "zero_checkpoint.py", "save", str(stage))
    run_worker(tmp_path, 2, "zero_checkpoint.py", "resume", str(stage))
    for r in range(2):
        res = json.loads((tmp_path / "resume" / f"rank{r}.json").read_text())
        assert res["failures"] == [], res["failures"]
        assert res["diff"] <= 1e-6 and res["moved"] > 1e-4, res


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_lightning_trainer_fits_saves_and_resumes(tmp_path, stage):
    """CRingStrategy(shard_state=stage) at 3 ranks (Adam, StepLR, accumulation;
    stage 1 also gradient clipping) fits like shard_state=0, and its
    checkpoint holds the same unsharded optimizer state; at 2 ranks both
    checkpoints resume to the same weights."""
    pytest.importorskip("lightning")
    run_worker(tmp_path, 3, "zero_lightning.py", "fit", str(stage))
    run_worker(tmp_path, 2, "zero_lightning.py", "resume", str(stage))
    for phase, np_ in (("fit", 3), ("resume", 2)):
        for r in range(np_):
            res = json.loads((tmp_path / phase / f"rank{r}.json").read_text())
            assert res["failures"] == [], res["failures"]
            assert res["moved"] > 1e-3, res


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_lightning_fabric_saves_and_loads(tmp_path, stage):
    """CRingFabricStrategy(shard_state=stage) at 2 ranks, with no_backward_sync,
    fabric.clip_gradients, fabric.save and fabric.load into new objects:
    the same weights as shard_state=0."""
    pytest.importorskip("lightning")
    run_worker(tmp_path, 2, "zero_lightning.py", "fabric", str(stage))
    for r in range(2):
        res = json.loads((tmp_path / "fabric" / f"rank{r}.json").read_text())
        assert res["failures"] == [], res["failures"]


def test_lightning_refusals_without_processes():
    """The strategies' shard_state must be 0, 1 or 2, and stage 2 refuses a
    gradient scaler (precision '16-mixed' on GPUs), which reads .grad."""
    pytest.importorskip("lightning")
    from types import SimpleNamespace

    from cring.lightning import _sharded

    for bad in (3, -1, True, "2"):
        with pytest.raises(ValueError, match="shard_state"):
            _sharded.check_shard_state(bad)
    with pytest.raises(ValueError, match="16-mixed"):
        _sharded._refuse_scaler(2, SimpleNamespace(scaler=object()))
    _sharded._refuse_scaler(1, SimpleNamespace(scaler=object()))
    _sharded._refuse_scaler(2, SimpleNamespace(scaler=None))

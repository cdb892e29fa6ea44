"""CRingTrainer with Ray Data and Ray Tune on the Ray tests' shared local
cluster (tests/ray_cluster.py, 4 CPUs):
every row of ray.data.range(1000) reaches exactly one worker through
get_dataset_shard; a run whose workers would hold every CPU (nothing left for
the read tasks, which used to hang) is refused before it starts; Tune runs
two grid trials of a function that fits a CRingTrainer with
TuneReportCallback, and Tuner(CRingTrainer(...)) names that pattern."""

from __future__ import annotations

import json
import sys
import time

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.train")
pytest.importorskip("ray.data")
pytest.importorskip("ray.tune")

import ray_cluster  # noqa: E402  (after the importorskips)
from test_ray import _fit, _run_config  # noqa: E402

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

ROWS = 1000
CLUSTER_CPUS = ray_cluster.SHARED_CPUS


@pytest.fixture
def cluster():
    return ray_cluster.shared()


def count_rows(config):
    """Each worker sums its shard; rank 0 writes the allreduced totals."""
    import json
    import os

    import numpy as np
    import ray.train

    import cring

    cring.init()
    seen = []
    for batch in ray.train.get_dataset_shard("train").iter_batches(batch_size=128):
        seen.extend(int(i) for i in batch["id"])
    totals = cring.allreduce(np.array([len(seen), sum(seen)], np.int64), op=cring.Sum)
    with open(os.path.join(config["outdir"], f"rows{cring.rank()}.json"), "w") as f:
        json.dump({"ids": seen, "rows": int(totals[0]), "sum": int(totals[1])}, f)
    ray.train.report({"rows": int(totals[0])})


def test_dataset_shards_cover_every_row_once(cluster, tmp_path):
    from cring.ray import CRingTrainer

    t0 = time.monotonic()
    result = _fit(
        CRingTrainer(
            count_rows,
            train_loop_config={"outdir": str(tmp_path)},
            scaling_config=ray.train.ScalingConfig(num_workers=2),
            datasets={"train": ray.data.range(ROWS)},
            run_config=_run_config(tmp_path, "data"),
        )
    )
    assert result.error is None
    seen = [json.loads((tmp_path / f"rows{r}.json").read_text()) for r in range(2)]
    assert all(s["ids"] for s in seen)  # both workers got rows
    assert sorted(seen[0]["ids"] + seen[1]["ids"]) == list(range(ROWS))  # each row once
    assert {(s["rows"], s["sum"]) for s in seen} == {(ROWS, ROWS * (ROWS - 1) // 2)}
    print(f"data: 2 workers read {ROWS} rows in {time.monotonic() - t0:.1f} s")


def test_workers_holding_every_cpu_are_refused_before_fit(cluster, tmp_path):
    """4 workers of 1 CPU on 4 CPUs would leave the read tasks none and wait
    forever; fit() refuses at once and says what to change."""
    from cring.ray import CRingTrainer

    def trainer(scaling, **kwargs):
        return CRingTrainer(
            count_rows,
            train_loop_config={"outdir": str(tmp_path)},
            scaling_config=scaling,
            datasets={"train": ray.data.range(ROWS)},
            run_config=_run_config(tmp_path, f"starved{time.monotonic_ns()}"),
            **kwargs,
        )

    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"hold 4 of the cluster's 4 CPUs") as info:
        trainer(ray.train.ScalingConfig(num_workers=CLUSTER_CPUS)).fit()
    assert time.monotonic() - t0 < 10
    message = str(info.value)
    assert "resources_per_worker={'CPU': 0.5}" in message and "check_data_cpus=False" in message
    # elastic scaling counts the most workers it may start
    with pytest.raises(ValueError, match="hold 4 of"):
        trainer(ray.train.ScalingConfig(num_workers=(2, CLUSTER_CPUS))).fit()


def test_data_cpu_check_arithmetic(cluster):
    """The check alone: spare CPUs below one refuse; workers that do not fit
    at all (a cluster that must autoscale) or no datasets pass."""
    from cring.ray._trainer import check_data_cpus

    datasets = {"train": object()}
    ScalingConfig = ray.train.ScalingConfig
    check_data_cpus(ScalingConfig(num_workers=3), datasets)  # 1 CPU left
    check_data_cpus(ScalingConfig(num_workers=4), {})  # nothing to read
    check_data_cpus(ScalingConfig(num_workers=8), datasets)  # must autoscale anyway
    check_data_cpus(ScalingConfig(num_workers=2, use_gpu=True), datasets)  # GPU workers: 0 CPU
    with pytest.raises(ValueError, match="leaving 0.5"):
        check_data_cpus(ScalingConfig(num_workers=5, resources_per_worker={"CPU": 0.7}), datasets)


def tune_driver(config):
    """The V2 pattern: a Tune function trainable that fits a CRingTrainer."""
    import ray.train
    from ray.tune.integration.ray_train import TuneReportCallback

    from cring.ray import CRingTrainer

    CRingTrainer(
        scaled_sum,
        train_loop_config=config,
        # half a CPU each: both trials (0.5 CPU each) and their workers fit in 4 CPUs
        scaling_config=ray.train.ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}),
        run_config=ray.train.RunConfig(
            name=f"trial_{config['scale']}",
            storage_path=config["storage"],
            callbacks=[TuneReportCallback()],
        ),
    ).fit()


def scaled_sum(config):
    import numpy as np
    import ray.train

    import cring

    cring.init()
    total = cring.allreduce(np.array([config["scale"] * (cring.rank() + 1.0)]), op=cring.Sum)
    ray.train.report({"total": float(total[0]), "size": cring.size()})


def test_tune_grid_over_a_function_that_fits_the_trainer(cluster, tmp_path):
    from ray import tune

    t0 = time.monotonic()
    tuner = tune.Tuner(
        tune.with_resources(tune_driver, {"CPU": 0.5}),  # the trial only waits for its workers
        param_space={
            "scale": tune.grid_search([1.0, 10.0]),
            "storage": str(tmp_path / "train_runs"),
        },
        tune_config=tune.TuneConfig(max_concurrent_trials=2),
        run_config=tune.RunConfig(name="grid", storage_path=str(tmp_path / "tune_runs")),
    )
    results = _fit(tuner)
    assert not results.errors, results.errors
    totals = sorted((r.config["scale"], r.metrics["total"], r.metrics["size"]) for r in results)
    assert totals == [(1.0, 3.0, 2), (10.0, 30.0, 2)]  # scale * (1 + 2) from 2 ranks
    best = results.get_best_result(metric="total", mode="max")
    assert best.config["scale"] == 10.0
    print(f"tune: 2 trials of 2 workers in {time.monotonic() - t0:.1f} s")


def test_tuner_given_the_trainer_names_the_pattern(cluster):
    from ray import tune

    from cring.ray import TRAIN_V2, CRingTrainer

    if not TRAIN_V2:
        pytest.skip("Train V1 trainers are Tune trainables themselves")
    trainer = CRingTrainer(scaled_sum, scaling_config=ray.train.ScalingConfig(num_workers=2))
    with pytest.raises(TypeError, match="TuneReportCallback") as info:
        tune.Tuner(trainer)
    assert "def train_driver(config)" in str(info.value)
    assert "docs/ray.md" in str(info.value)

"""Driver for tests/test_ray.py under Ray Train V1: joins the running test
cluster (argv[1]: its address) with RAY_TRAIN_V2_ENABLED=0 in this process and
in every worker, and runs ray_loops.train_linear with CRingTrainer, rank 1
dying once at epoch 3 and FailureConfig(max_failures=1) restarting the group.
argv[2] is the output directory; prints one line "SUMMARY <json>" with what
the driver saw."""

import json
import os
import sys

assert os.environ.get("RAY_TRAIN_V2_ENABLED") == "0", "run with RAY_TRAIN_V2_ENABLED=0"

import ray  # noqa: E402
import ray.train  # noqa: E402

from cring.ray import TRAIN_V2, CRingConfig, CRingTrainer  # noqa: E402

import ray_loops  # noqa: E402

address, outdir = sys.argv[1], sys.argv[2]
ray.init(
    address=address, runtime_env={"env_vars": {"RAY_TRAIN_V2_ENABLED": "0"}}, log_to_driver=True
)
try:
    result = CRingTrainer(
        ray_loops.train_linear,
        train_loop_config={
            "outdir": outdir,
            "lr": 0.05,
            "epochs": 6,
            "steps_per_epoch": 3,
            "die_at_epoch": 3,
        },
        cring_config=CRingConfig(timeout_s=60),
        scaling_config=ray.train.ScalingConfig(num_workers=2),
        run_config=ray.train.RunConfig(
            name="v1_linear",
            storage_path=os.path.join(outdir, "ray_results"),
            failure_config=ray.train.FailureConfig(max_failures=1),
        ),
    ).fit()
    summary = {
        "train_v2": TRAIN_V2,
        "base": CRingTrainer.__mro__[1].__module__,
        "error": repr(result.error) if result.error else None,
        "metrics": {k: result.metrics.get(k) for k in ("epoch", "loss")},
        "checkpoint": result.checkpoint is not None,
    }
    print("SUMMARY " + json.dumps(summary), flush=True)
finally:
    ray.shutdown()

"""cring.ray on a local Ray cluster: CRingTrainer gives every worker its rank
and rendezvous, DistributedOptimizer trains identically on all workers, a
worker group that loses a worker is restarted, re-rendezvouses and resumes
from the last checkpoint, Lightning's "cring" strategy runs inside the loop,
Ray Train V1 (with a restart) works too, use_gpu=True workers each get their
own GPU (declared, not real: see test_gpu_workers_each_get_their_own_gpu), and
nothing of Ray is left running afterwards.

The Ray tests' shared cluster (tests/ray_cluster.py: 4 logical CPUs, 2
declared GPUs that this CPU machine does not have, no dashboard) serves the
module; every run uses 2 workers of 1 CPU and a storage path under tmp_path.
test_no_ray_processes_left, which conftest runs after every other Ray test,
stops it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.train")
torch = pytest.importorskip("torch")

import ray_cluster  # noqa: E402
from ray_cluster import CRING_PATH, WORKERS, ray_processes  # noqa: E402

import cring  # noqa: E402  (after the importorskips)

RUN_TIMEOUT_S = 240  # one fit(), generous for a loaded 2-core machine; a hang fails


# -------------------------------------------------------------------------------------- helpers


@pytest.fixture
def cluster():
    return ray_cluster.shared()


def _fit(trainer):
    """trainer.fit() with a hard time limit (a hung run fails the test)."""
    import threading

    box: dict = {}

    def run():
        try:
            box["result"] = trainer.fit()
        except BaseException as exc:  # noqa: BLE001  (re-raised in the test thread)
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(RUN_TIMEOUT_S)
    if t.is_alive():
        pytest.fail(f"CRingTrainer.fit() did not finish within {RUN_TIMEOUT_S} s")
    if "error" in box:
        raise box["error"]
    return box["result"]


def _loops():
    """tests/workers/ray_loops.py, imported as the workers import it."""
    import importlib

    if str(WORKERS) not in sys.path:
        sys.path.append(str(WORKERS))
    return importlib.import_module("ray_loops")


def _run_config(tmp_path: Path, name: str, **kwargs):
    return ray.train.RunConfig(name=name, storage_path=str(tmp_path / "ray_results"), **kwargs)


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _reference_params(lr: float, momentum: float, steps: int) -> list[list[float]]:
    """What 2-rank data-parallel training of ray_loops.train_linear must end
    with: one process, rank 0's initial weights, the gradient averaged over
    both ranks' data at every step."""
    ray_loops = _loops()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    data = [ray_loops._data(r) for r in range(2)]
    for _ in range(steps):
        grads = []
        for x, y in data:
            model.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, g0, g1 in zip(model.parameters(), *grads):
            p.grad = (g0 + g1) / 2
        opt.step()
    return [p.detach().double().flatten().tolist() for p in model.parameters()]


def _assert_params_close(got, want, tol=1e-5):
    for g, w in zip(got, want):
        assert len(g) == len(w)
        for a, b in zip(g, w):
            assert abs(a - b) <= tol * max(1.0, abs(b)), (got, want)


# ------------------------------------------------------------------- tests without Ray running


def test_import_cring_does_not_import_ray():
    code = (
        "import sys, cring, cring.torch; "
        "bad = sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    env = dict(os.environ, PYTHONPATH=str(CRING_PATH))
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, f"import cring imported Ray: {proc.stdout} {proc.stderr}"


def test_bad_configuration_is_rejected():
    from cring.ray import CRingConfig, CRingTrainer

    with pytest.raises(ValueError, match="timeout_s"):
        CRingConfig(timeout_s=0)
    with pytest.raises(TypeError, match="timeout_s"):
        CRingConfig(timeout_s="60")
    with pytest.raises(ValueError, match="shutdown_timeout_s"):
        CRingConfig(shutdown_timeout_s=float("nan"))
    with pytest.raises(ValueError, match="transport"):
        CRingConfig(transport="udp")
    with pytest.raises(TypeError, match="cring_config"):
        CRingTrainer(lambda: None, cring_config={"timeout_s": 5})
    with pytest.raises(TypeError, match="backend_config"):
        CRingTrainer(lambda: None, backend_config=CRingConfig())


def test_local_ranks_count_workers_per_node():
    from cring.ray._backend import CRingConfig, worker_environments

    envs = worker_environments(
        ["a", "b", "a", "a", "b"],
        "10.0.0.1",
        4242,
        "s3cret",
        "job7",
        CRingConfig(timeout_s=30, transport="tcp"),
    )
    assert [e["CRING_RANK"] for e in envs] == ["0", "1", "2", "3", "4"]
    assert [e["CRING_LOCAL_RANK"] for e in envs] == ["0", "0", "1", "2", "1"]
    assert [e["CRING_LOCAL_SIZE"] for e in envs] == ["3", "2", "3", "3", "2"]
    assert [e["CRING_NODE_RANK"] for e in envs] == ["0", "1", "0", "0", "1"]
    assert {e["CRING_SIZE"] for e in envs} == {"5"}
    assert {
        (
            e["CRING_ADDR"],
            e["CRING_PORT"],
            e["CRING_SECRET"],
            e["CRING_JOB_ID"],
            e["CRING_STORE_EXTERNAL"],
            e["CRING_TIMEOUT_SECONDS"],
            e["CRING_TRANSPORT"],
        )
        for e in envs
    } == {("10.0.0.1", "4242", "s3cret", "job7", "1", "30.0", "tcp")}


# ------------------------------------------------------------------------------- on the cluster


def test_worker_shutdown_leaves_cring_and_stops_the_store(cluster):
    """What the backend runs in each worker when the group stops (here in the
    test process): cring is left and rank 0's store stops serving."""
    import socket

    import numpy as np

    from cring.ray import _worker

    addr, port = _worker.start_store("secret-for-this-test")
    with socket.create_connection((addr, port), timeout=5):
        pass  # serving
    cring.init(rank=0, size=1)
    assert cring.allreduce(np.ones(2)).tolist() == [1.0, 1.0]
    _worker.shutdown()
    assert not cring.is_initialized()
    with pytest.raises(OSError):
        socket.create_connection((addr, port), timeout=5).close()
    _worker.shutdown()  # again, and with nothing to do: no error


def test_two_workers_get_ranks_and_allreduce(cluster, tmp_path):
    ray_loops = _loops()
    from cring.ray import CRingConfig, CRingTrainer

    result = _fit(
        CRingTrainer(
            ray_loops.ranks_and_allreduce,
            train_loop_config={"outdir": str(tmp_path)},
            cring_config=CRingConfig(timeout_s=60),
            scaling_config=ray.train.ScalingConfig(num_workers=2),
            run_config=_run_config(tmp_path, "ranks"),
        )
    )
    assert result.error is None
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [s["rank"] for s in seen] == [0, 1]
    assert [s["ray_world_rank"] for s in seen] == [0, 1]  # cring's rank is Ray's world rank
    assert {s["size"] for s in seen} == {2}
    assert [s["local_rank"] for s in seen] == [0, 1]  # both on this one node
    assert {s["local_size"] for s in seen} == {2}
    assert [s["env"]["CRING_LOCAL_RANK"] for s in seen] == ["0", "1"]
    assert {s["transport"] for s in seen} == {"shm"}
    assert seen[0]["pid"] != seen[1]["pid"]
    for s in seen:
        assert s["sum"] == [3.0 * i for i in range(7)]  # i*1 + i*2
        assert s["average"] == [0.5, 0.5, 0.5]
        assert s["gathered"] == [[0, 0], [1, 1], [1, 1]]
        assert s["env"]["CRING_TIMEOUT_SECONDS"] == "60.0"
    assert seen[0]["env"]["CRING_JOB_ID"] == seen[1]["env"]["CRING_JOB_ID"]


def test_distributed_optimizer_trains_identically_on_both_workers(cluster, tmp_path):
    ray_loops = _loops()
    from cring.ray import CRingTrainer

    config = {"outdir": str(tmp_path), "lr": 0.05, "epochs": 4, "steps_per_epoch": 5}
    result = _fit(
        CRingTrainer(
            ray_loops.train_linear,
            train_loop_config=config,
            scaling_config=ray.train.ScalingConfig(num_workers=2),
            run_config=_run_config(tmp_path, "optimizer"),
        )
    )
    losses = [_read_jsonl(tmp_path / f"losses{r}.jsonl") for r in range(2)]
    assert losses[0] == losses[1]  # the allreduced loss, the same on both workers
    curve = [m["loss"] for m in losses[0]]
    assert [m["epoch"] for m in losses[0]] == [0, 1, 2, 3]
    assert all(b < a for a, b in zip(curve, curve[1:])), curve
    assert curve[-1] < 0.2 * curve[0], curve
    final = [json.loads((tmp_path / f"final{r}.json").read_text())["params"] for r in range(2)]
    assert final[0] == final[1]  # bit-identical parameters
    _assert_params_close(final[0], _reference_params(0.05, 0.5, 4 * 5))
    assert result.metrics["epoch"] == 3
    assert result.metrics["loss"] == curve[-1]
    assert result.checkpoint is not None


def test_killed_worker_restarts_and_resumes_from_checkpoint(cluster, tmp_path):
    ray_loops = _loops()
    from cring.ray import CRingConfig, CRingTrainer

    config = {
        "outdir": str(tmp_path),
        "lr": 0.05,
        "epochs": 6,
        "steps_per_epoch": 3,
        "die_at_epoch": 3,
    }
    t0 = time.time()
    result = _fit(
        CRingTrainer(
            ray_loops.train_linear,
            train_loop_config=config,
            cring_config=CRingConfig(timeout_s=60),
            scaling_config=ray.train.ScalingConfig(num_workers=2),
            run_config=_run_config(
                tmp_path, "restart", failure_config=ray.train.FailureConfig(max_failures=1)
            ),
        )
    )
    assert (tmp_path / "died_once").exists()  # rank 1 really died once
    starts = [_read_jsonl(tmp_path / f"starts{r}.jsonl") for r in range(2)]
    for s in starts:
        assert len(s) == 2, starts  # the first attempt and one restart
        assert s[0]["start_epoch"] == 0 and s[0]["restored_from"] is None
        # The restart resumed from the last checkpoint taken before the crash
        # (the loop let rank 1 die only once Ray had committed epoch 2's).
        assert s[1]["restored_from"] == 2 and s[1]["start_epoch"] == 3, starts
        assert s[0]["pid"] != s[1]["pid"]  # a fresh worker process
        assert s[0]["job_id"] != s[1]["job_id"]  # and a fresh rendezvous
    assert starts[0][1]["job_id"] == starts[1][1]["job_id"]
    died = json.loads((tmp_path / "died_once").read_text())
    assert died["pid"] == starts[1][0]["pid"]
    print(
        f"restart: worker group back {starts[1][1]['time'] - died['time']:.1f} s after the "
        f"crash; run started {starts[0][0]['time'] - t0:.1f} s after fit()"
    )
    # Training went on to the end and, restored exactly, ends where an
    # uninterrupted run would.
    assert result.metrics["epoch"] == 5
    final = [json.loads((tmp_path / f"final{r}.json").read_text())["params"] for r in range(2)]
    assert final[0] == final[1]
    _assert_params_close(final[0], _reference_params(0.05, 0.5, 6 * 3))
    epochs = [m["epoch"] for m in _read_jsonl(tmp_path / "losses0.jsonl")]
    assert epochs == [0, 1, 2, 3, 4, 5], epochs  # epochs 0-2, then 3-5 after the restart


def test_train_v1(cluster, tmp_path):
    """RAY_TRAIN_V2_ENABLED=0: CRingTrainer is V1's DataParallelTrainer, and
    the same backend sets the workers up, tears them down and re-rendezvouses
    a restarted group (a driver in a subprocess joins this cluster, since the
    Train version is fixed when ray.train is imported)."""
    env = dict(os.environ, RAY_TRAIN_V2_ENABLED="0")
    try:
        proc = subprocess.run(
            [sys.executable, str(WORKERS / "ray_v1.py"), cluster.address, str(tmp_path)],
            env=env,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the Train V1 run hung for {RUN_TIMEOUT_S} s\n{e.stdout}\n{e.stderr}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("SUMMARY ")]
    assert proc.returncode == 0 and lines, f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    summary = json.loads(lines[-1][len("SUMMARY ") :])
    assert summary["train_v2"] is False
    assert summary["base"] == "ray.train.data_parallel_trainer"
    assert summary["error"] is None
    assert summary["metrics"]["epoch"] == 5
    assert summary["checkpoint"]
    assert (tmp_path / "died_once").exists()
    starts = [_read_jsonl(tmp_path / f"starts{r}.jsonl") for r in range(2)]
    for rank, s in enumerate(starts):
        assert len(s) == 2, starts
        assert [(a["rank"], a["ray_world_rank"], a["size"]) for a in s] == [(rank, rank, 2)] * 2
        assert s[0]["restored_from"] is None
        # V1 gives no way to wait for the checkpoint to be registered: the
        # restart resumes from the last one Ray had when the worker died.
        assert s[1]["restored_from"] is not None and s[1]["start_epoch"] <= 3, starts
        assert s[1]["start_epoch"] == s[1]["restored_from"] + 1
        assert s[0]["job_id"] != s[1]["job_id"]
    # Restored exactly: an epoch run twice gives the same loss, and training
    # ends where an uninterrupted run would.
    records = _read_jsonl(tmp_path / "losses0.jsonl")
    by_epoch = {}
    for m in records:
        assert by_epoch.setdefault(m["epoch"], m["loss"]) == m["loss"]
    curve = [by_epoch[e] for e in range(6)]
    assert all(b < a for a, b in zip(curve, curve[1:])), curve
    assert summary["metrics"]["loss"] == curve[-1]
    final = [json.loads((tmp_path / f"final{r}.json").read_text())["params"] for r in range(2)]
    assert final[0] == final[1]
    _assert_params_close(final[0], _reference_params(0.05, 0.5, 6 * 3))


def test_lightning_fit_inside_the_loop(cluster, tmp_path):
    pytest.importorskip("lightning")
    pytest.importorskip("cring.lightning")
    ray_loops = _loops()
    from cring.ray import CRingTrainer

    result = _fit(
        CRingTrainer(
            ray_loops.lightning_fit,
            train_loop_config={"outdir": str(tmp_path), "epochs": 3},
            scaling_config=ray.train.ScalingConfig(num_workers=2),
            run_config=_run_config(tmp_path, "lightning"),
        )
    )
    assert result.error is None
    seen = [json.loads((tmp_path / f"lightning{r}.json").read_text()) for r in range(2)]
    assert [(s["global_rank"], s["ray_world_rank"], s["world_size"]) for s in seen] == [
        (0, 0, 2),
        (1, 1, 2),
    ]
    assert {s["strategy"] for s in seen} == {"CRingStrategy"}
    # Each rank trained on its own half of the data, every epoch.
    first = [set(s["seen"][: len(s["seen"]) // 3]) for s in seen]
    assert len(first[0]) == len(first[1]) == 48 and not first[0] & first[1]
    # Gradients were averaged: both ranks end with the same weights (they
    # started from different seeds) and the synced loss went down.
    assert seen[0]["params"] == seen[1]["params"]
    assert seen[0]["epoch_losses"] == seen[1]["epoch_losses"]
    losses = seen[0]["epoch_losses"]
    assert len(losses) == 3 and losses[-1] < 0.5 * losses[0], losses
    assert not any(s["cring_initialized_after_fit"] for s in seen)


# ---- GPUs ---------------------------------------------------------------------------------------


def test_worker_cuda_device_index():
    """A worker's GPU among its visible devices: 0 with its own
    CUDA_VISIBLE_DEVICES, its position when the node's workers share them."""
    from cring.ray import _worker

    assert _worker.cuda_device_index([], "0,1") is None
    assert _worker.cuda_device_index([3], "3") == 0
    assert _worker.cuda_device_index([1], "0,1") == 1
    assert _worker.cuda_device_index(["5"], "4, 5,6") == 1
    assert _worker.cuda_device_index([2], None) == 2  # RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES
    assert _worker.cuda_device_index([0], "NoDevFiles") == 0
    assert _worker.cuda_device_index([7], "0,1") is None  # overridden by the user: not guessed
    assert _worker.cuda_device_index(["GPU-1a2b"], "GPU-0f0f,GPU-1a2b") == 1


def test_set_torch_device_in_the_loops_thread(monkeypatch):
    """train_func_context (entered in the loop's thread) makes the worker's GPU
    current; nothing happens without CRING_CUDA_DEVICE or on a torch without CUDA."""
    from cring.ray import CRingConfig, _worker

    calls: list = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    monkeypatch.delenv("CRING_CUDA_DEVICE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert _worker.set_torch_device() is None and calls == []
    monkeypatch.setenv("CRING_CUDA_DEVICE", "1")
    with CRingConfig().train_func_context():
        assert calls == [1]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU build
    assert _worker.set_torch_device() is None and calls == [1]


def test_gpu_workers_each_get_their_own_gpu(cluster, tmp_path):
    """ScalingConfig(use_gpu=True) on a cluster declaring 2 GPUs: Ray accepts it
    without real GPUs, gives each worker one GPU id and shares
    CUDA_VISIBLE_DEVICES on the node; cring's setup exports each worker's own
    index (CRING_CUDA_DEVICE) and the Lightning strategy trains there."""
    pytest.importorskip("lightning")
    ray_loops = _loops()
    from cring.ray import CRingConfig, CRingTrainer

    result = _fit(
        CRingTrainer(
            ray_loops.gpu_devices,
            train_loop_config={"outdir": str(tmp_path)},
            cring_config=CRingConfig(timeout_s=60),
            scaling_config=ray.train.ScalingConfig(num_workers=2, use_gpu=True),
            run_config=_run_config(tmp_path, "gpu"),
        )
    )
    assert result.error is None
    seen = [json.loads((tmp_path / f"gpu{r}.json").read_text()) for r in range(2)]
    assert [s["sum_of_ranks"] for s in seen] == [1.0, 1.0]
    gpu_ids = [s["ray_gpu_ids"] for s in seen]
    assert all(len(ids) == 1 for ids in gpu_ids) and gpu_ids[0] != gpu_ids[1], gpu_ids
    for s in seen:
        visible = s["cuda_visible_devices"].split(",")
        assert sorted(visible) == sorted(i for ids in gpu_ids for i in ids), s  # shared
        index = visible.index(s["ray_gpu_ids"][0])
        assert s["cring_cuda_device"] == str(index), s
        assert s["set_at_start"] is None  # the CPU build: nothing to make current
        assert s["set_by_setup"] == index and s["set_device_calls"] == [str(index)], s
        assert s["lightning_root_device"] == f"cuda:{index}", s
    assert {s["cring_cuda_device"] for s in seen} == {"0", "1"}


def test_no_ray_processes_left(cluster):
    assert ray.is_initialized()
    running = ray_processes(cluster.marker)
    assert running, "expected the cluster's processes to be visible while it runs"
    left = cluster.shutdown()
    assert not left, f"Ray processes left after ray.shutdown(): {left}"
    assert not ray.is_initialized()

"""cring.ray.RayExecutor on a local Ray cluster: Horovod-on-Ray's executor API
(create_settings, start, run, run_remote, execute, execute_single, shutdown)
gives each actor its rank and rendezvous; results come back in rank order; a
worker that dies raises RayWorkerError naming it within seconds; the
placement group and actors are gone after shutdown().

The Ray tests' shared cluster (tests/ray_cluster.py: 4 CPUs, 2 declared GPUs,
no dashboard) serves the module."""

from __future__ import annotations

import sys
import time

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.train")

import ray_cluster  # noqa: E402  (after the importorskips)
from test_ray import RUN_TIMEOUT_S  # noqa: E402

import cring  # noqa: E402

# the functions below travel to the workers by value (this module is not importable there)
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

DEATH_NOTICE_LIMIT_S = 30  # a dead worker must be reported well within this


@pytest.fixture
def cluster():
    return ray_cluster.shared()


@pytest.fixture
def executor(cluster):
    from cring.ray import RayExecutor

    ex = RayExecutor(RayExecutor.create_settings(timeout_s=30), num_workers=2, cpus_per_worker=1)
    yield ex
    ex.shutdown()


def _within(seconds: float, call, *args, **kwargs):
    """call(*args, **kwargs) in a thread; fail the test if it takes longer."""
    import threading

    box: dict = {}

    def target():
        try:
            box["value"] = call(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001  (re-raised in the test thread)
            box["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        pytest.fail(f"{getattr(call, '__name__', call)} did not return within {seconds} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


# ---- functions run on the workers ---------------------------------------------------------------


def ranks_and_sum(scale, offset=0.0):
    import os

    import numpy as np

    import cring

    cring.init()
    total = cring.allreduce(np.full(3, scale * (cring.rank() + 1) + offset), op=cring.Sum)
    return {
        "rank": cring.rank(),
        "size": cring.size(),
        "local_rank": cring.local_rank(),
        "local_size": cring.local_size(),
        "sum": total.tolist(),
        "pid": os.getpid(),
        "job": os.environ["CRING_JOB_ID"],
        "extra": os.environ.get("MY_SETTING"),
        "timeout": os.environ.get("CRING_TIMEOUT_SECONDS"),
    }


class Counter:
    def __init__(self, start, step=1):
        self.value, self.step = start, step

    def bump(self):
        import cring

        cring.init()
        self.value += self.step * (cring.rank() + 1)
        return self.value


def fail_on_rank_1():
    import cring

    cring.init()
    if cring.rank() == 1:
        raise ValueError("bad batch on rank 1")
    return "ok"


def die_on_rank_1():
    import os
    import time

    import numpy as np

    import cring

    cring.init()
    if cring.rank() == 1:
        time.sleep(0.5)
        os._exit(7)
    for _ in range(100):  # rank 0 waits in a collective for the dead rank
        cring.allreduce(np.ones(4))
        time.sleep(0.1)
    return "rank 0 was never told"


def gpu_view():
    import os

    import ray

    return {
        "ids": [str(i) for i in ray.get_gpu_ids()],
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "cring_cuda_device": os.environ.get("CRING_CUDA_DEVICE"),
    }


# ---- tests --------------------------------------------------------------------------------------


def test_bad_arguments_are_rejected(cluster):
    from cring.ray import RayExecutor, RaySettings

    settings = RayExecutor.create_settings(timeout_s=10)
    assert isinstance(settings, RaySettings) and settings.timeout_s == 10
    with pytest.raises(ValueError, match="timeout_s"):
        RayExecutor.create_settings(timeout_s=0)
    with pytest.raises(ValueError, match="transport"):
        RayExecutor.create_settings(transport="udp")
    with pytest.warns(UserWarning, match="ssh_identity_file"):
        RayExecutor.create_settings(ssh_identity_file="/nonexistent")
    with pytest.raises(ValueError, match="exactly one of num_workers and num_hosts"):
        RayExecutor(settings)
    with pytest.raises(ValueError, match="exactly one"):
        RayExecutor(settings, num_workers=2, num_hosts=1)
    with pytest.raises(ValueError, match="num_workers"):
        RayExecutor(settings, num_workers=0)
    with pytest.raises(ValueError, match="gpus_per_worker needs use_gpu"):
        RayExecutor(settings, num_workers=1, gpus_per_worker=1)
    with pytest.raises(TypeError, match="create_settings"):
        RayExecutor({"timeout_s": 5}, num_workers=1)
    ex = RayExecutor(settings, num_workers=1)
    with pytest.raises(RuntimeError, match="call start"):
        ex.run(ranks_and_sum, args=[1])


def test_run_returns_results_in_rank_order(executor):
    t0 = time.monotonic()
    _within(RUN_TIMEOUT_S, executor.start, extra_env_vars={"MY_SETTING": 42})
    started = time.monotonic() - t0
    results = _within(RUN_TIMEOUT_S, executor.run, ranks_and_sum, args=[2.0], kwargs={"offset": 1})
    assert [r["rank"] for r in results] == [0, 1]
    assert [r["local_rank"] for r in results] == [0, 1]
    assert {(r["size"], r["local_size"]) for r in results} == {(2, 2)}
    assert {tuple(r["sum"]) for r in results} == {(8.0, 8.0, 8.0)}  # (2+1) + (4+1)
    assert results[0]["pid"] != results[1]["pid"]
    assert {r["job"] for r in results} == {results[0]["job"]}
    assert {r["extra"] for r in results} == {"42"}
    assert {r["timeout"] for r in results} == {"30.0"}
    # run_remote: the same, as ObjectRefs; a second run reuses the same job
    refs = executor.run_remote(ranks_and_sum, args=[1.0])
    again = ray.get(refs, timeout=RUN_TIMEOUT_S)
    assert [r["sum"] for r in again] == [[3.0] * 3] * 2
    assert [r["pid"] for r in again] == [r["pid"] for r in results]
    with pytest.raises(RuntimeError, match="already started"):
        executor.start()
    print(f"executor: 2 workers started in {started:.1f} s")


def test_execute_on_the_executable(executor):
    _within(
        RUN_TIMEOUT_S, executor.start, Counter, executable_args=[10], executable_kwargs={"step": 5}
    )
    assert _within(RUN_TIMEOUT_S, executor.execute, lambda c: c.bump()) == [15, 20]
    assert _within(RUN_TIMEOUT_S, executor.execute, lambda c: c.value) == [15, 20]
    assert _within(RUN_TIMEOUT_S, executor.execute_single, lambda c: c.value) == 15
    # Horovod's ray_logger: what the workers log reaches the driver's callbacks
    got: list = []

    def log_value(c):
        from cring.ray import ray_logger

        ray_logger.log({"value": c.value})
        return c.value

    assert _within(RUN_TIMEOUT_S, executor.execute, log_value, callbacks=[got.append]) == [15, 20]
    assert sorted(item["value"] for item in got) == [15, 20]
    with pytest.raises(TypeError, match="callable"):
        executor.execute(log_value, callbacks=[42])


def test_user_exception_keeps_its_type(executor):
    _within(RUN_TIMEOUT_S, executor.start)
    with pytest.raises(ValueError, match="bad batch on rank 1"):
        _within(RUN_TIMEOUT_S, executor.run, fail_on_rank_1)
    # the workers are alive: the executor still runs
    assert [r["rank"] for r in _within(RUN_TIMEOUT_S, executor.run, ranks_and_sum, args=[1])] == [
        0,
        1,
    ]


def test_dead_worker_raises_naming_it(executor):
    from cring.ray import RayWorkerError

    _within(RUN_TIMEOUT_S, executor.start)
    t0 = time.monotonic()
    with pytest.raises(RayWorkerError, match="worker 1 of 2 died") as info:
        _within(DEATH_NOTICE_LIMIT_S, executor.run, die_on_rank_1)
    noticed = time.monotonic() - t0
    assert info.value.rank == 1
    assert isinstance(info.value, cring.PeerFailureError)
    with pytest.raises(RuntimeError, match="worker 1 died; call shutdown"):
        executor.run(ranks_and_sum, args=[1])
    executor.shutdown()
    # and the executor starts again, with a fresh job
    _within(RUN_TIMEOUT_S, executor.start)
    assert [r["rank"] for r in _within(RUN_TIMEOUT_S, executor.run, ranks_and_sum, args=[1])] == [
        0,
        1,
    ]
    print(f"executor: dead worker reported {noticed:.1f} s after run()")


def test_hosts_api_and_gpus(cluster):
    """num_hosts/num_workers_per_host on this one node, with declared GPUs."""
    from cring.ray import RayExecutor

    with RayExecutor(
        RayExecutor.create_settings(timeout_s=30),
        num_hosts=1,
        num_workers_per_host=2,
        cpus_per_worker=1,
        use_gpu=True,
    ) as ex:
        _within(RUN_TIMEOUT_S, ex.start)
        ranks = _within(RUN_TIMEOUT_S, ex.run, ranks_and_sum, args=[1])
        assert [(r["rank"], r["local_rank"]) for r in ranks] == [(0, 0), (1, 1)]
        seen = _within(RUN_TIMEOUT_S, ex.run, gpu_view)
        assert all(len(s["ids"]) == 1 for s in seen) and seen[0]["ids"] != seen[1]["ids"], seen
        for s in seen:  # each actor sees only its own GPU, as index 0
            assert s["visible"] == s["ids"][0] and s["cring_cuda_device"] == "0", s


def test_unplaceable_workers_time_out_clearly(cluster):
    from cring.ray import RayExecutor

    too_many = cluster.num_cpus + 1
    ex = RayExecutor(
        RayExecutor.create_settings(placement_group_timeout_s=2),
        num_workers=too_many,
        cpus_per_worker=1,
    )
    with pytest.raises(TimeoutError, match=f"could not place {too_many} bundles"):
        _within(RUN_TIMEOUT_S, ex.start)
    assert not ex.workers
    # the failed placement group was removed: two workers still fit
    with RayExecutor(RayExecutor.create_settings(), num_workers=2) as ok:
        _within(RUN_TIMEOUT_S, ok.start)
        assert len(_within(RUN_TIMEOUT_S, ok.run, ranks_and_sum, args=[1])) == 2


def test_shutdown_frees_the_cluster(cluster):
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if ray.available_resources().get("CPU", 0) == cluster.num_cpus:
            break
        time.sleep(0.5)
    assert ray.available_resources().get("CPU", 0) == cluster.num_cpus, ray.available_resources()

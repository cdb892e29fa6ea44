"""cring.ray.ElasticRayExecutor on a local Ray cluster of 2 CPUs (the Ray tests'
shared cluster, tests/ray_cluster.py, with the rest of its CPUs held): a worker
actor killed mid-training leaves the job, the survivor rolls back to its last
commit and goes on alone while another placement group holds the freed CPU,
and a new worker joins (and receives the state) as soon as Ray can place it
again: 2 -> 1 -> 2 workers. Too few workers left ends run() with
RayWorkerError instead of a hang."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.train")

import ray_cluster  # noqa: E402  (after the importorskips)
from test_ray import RUN_TIMEOUT_S  # noqa: E402

import cring  # noqa: E402

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


ELASTIC_CPUS = 2  # what the tests below leave the executors


@pytest.fixture(scope="module")
def cluster():
    """The shared cluster with all but ELASTIC_CPUS of its CPUs held by a
    placement group: as a 2-CPU cluster, a killed worker's CPU is the only
    one free, so the blocker below can take it."""
    from ray.util.placement_group import placement_group, remove_placement_group

    c = ray_cluster.shared()
    held = placement_group([{"CPU": 1}] * (c.num_cpus - ELASTIC_CPUS))
    ray.get(held.ready(), timeout=RUN_TIMEOUT_S)
    try:
        yield c
    finally:
        remove_placement_group(held)


def elastic_train(min_steps: int, outdir: str, max_steps: int = 3000, log: bool = False) -> dict:
    """Counts the workers at every step into the elastic state; after the job
    has shrunk it goes on until it has grown back (or max_steps)."""
    import json
    import os
    import time

    import numpy as np

    import cring
    import cring.elastic

    cring.init()

    @cring.elastic.run
    def loop(state):
        while state.step < min_steps or (
            1 in state.sizes and state.sizes[-1] == 1 and state.step < max_steps
        ):
            count = cring.allreduce(np.ones(1), op=cring.Sum)
            state.sizes.append(int(count[0]))
            state.step += 1
            state.commit()
            if cring.rank() == 0:
                with open(os.path.join(outdir, "progress.jsonl"), "a") as f:
                    f.write(json.dumps({"step": state.step, "size": cring.size()}) + "\n")
                if log:
                    from cring.ray import ray_logger

                    ray_logger.log({"step": state.step, "size": cring.size()})
            time.sleep(0.1)
        return {
            "sizes": state.sizes,
            "rank": cring.rank(),
            "size": cring.size(),
            "worker": int(os.environ["CRING_ELASTIC_WORKER_ID"]),
        }

    return loop(cring.elastic.ObjectState(step=0, sizes=[]))


def _progress(outdir: Path) -> list[dict]:
    path = outdir / "progress.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _wait_for(condition, what: str, timeout_s: float = RUN_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.1)


def _run_in_thread(executor, *args, **kwargs) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def target():
        try:
            box["result"] = executor.run(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001  (checked by the test)
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, box


def test_bad_arguments_are_rejected():
    from cring.ray import ElasticRayExecutor, RayExecutor

    settings = RayExecutor.create_settings(timeout_s=10)
    with pytest.raises(ValueError, match="max_workers"):
        ElasticRayExecutor(settings, min_workers=3, max_workers=2)
    with pytest.raises(ValueError, match="min_workers"):
        ElasticRayExecutor(settings, min_workers=0)
    with pytest.raises(ValueError, match="reset_limit"):
        ElasticRayExecutor(settings, min_workers=1, reset_limit=-1)
    with pytest.raises(RuntimeError, match="call start"):
        ElasticRayExecutor(settings).run(elastic_train, args=[1, "/nonexistent"])


def test_horovods_elastic_spellings_build_the_same_executor():
    from cring.ray import ElasticRayExecutor, ElasticRaySettings, RayExecutor

    settings = RayExecutor.create_settings(timeout_s=10)
    # Horovod's RayExecutor elastic spelling (elastic_v2) and its argument rules
    v2 = RayExecutor(settings, min_workers=1, max_workers=3, cpus_per_worker=2, reset_limit=4)
    assert isinstance(v2, ElasticRayExecutor)
    assert (v2.min_workers, v2.max_workers, v2.cpus_per_worker, v2.reset_limit) == (1, 3, 2, 4)
    with pytest.raises(ValueError, match="not both"):
        RayExecutor(settings, num_workers=2, min_workers=1)
    with pytest.raises(ValueError, match="positive min_workers"):
        RayExecutor(settings, max_workers=2)
    with pytest.raises(ValueError, match="positive min_workers"):
        RayExecutor(settings, min_workers=0, max_workers=2)
    assert isinstance(RayExecutor(settings, num_workers=2), RayExecutor)
    # Horovod's ElasticRayExecutor.create_settings + ElasticRayExecutor(settings, ...slot)
    hs = ElasticRayExecutor.create_settings(min_num_proc=2, max_num_proc=3, timeout_s=10)
    assert isinstance(hs, ElasticRaySettings) and hs.timeout_s == 10
    v1 = ElasticRayExecutor(hs, use_gpu=False, cpus_per_slot=2)
    assert (v1.min_workers, v1.max_workers, v1.cpus_per_worker, v1.gpus_per_worker) == (2, 3, 2, 0)
    assert ElasticRayExecutor(hs, min_workers=1).min_workers == 1, "explicit arguments win"
    with pytest.warns(DeprecationWarning, match="min_np"):
        assert ElasticRayExecutor.create_settings(min_np=2, verbose=True).min_num_proc == 2
    with pytest.raises(ValueError, match="cpus_per_slot, not both"):
        ElasticRayExecutor(hs, cpus_per_worker=1, cpus_per_slot=1)
    with pytest.raises(ValueError, match="use_gpu=True"):
        ElasticRayExecutor(hs, gpus_per_slot=1)
    with pytest.raises(ValueError, match="max_workers"):
        ElasticRayExecutor(ElasticRayExecutor.create_settings(min_num_proc=3, max_num_proc=2))
    hs.discovery = object()
    with pytest.raises(ValueError, match="find_available_hosts_and_slots"):
        ElasticRayExecutor(hs, override_discovery=False)
    hs.discovery = _Hosts({})
    with pytest.warns(UserWarning, match="discovery is ignored"):
        assert ElasticRayExecutor(hs).max_workers == 3, "override_discovery=True ignores it"
    assert ElasticRayExecutor(hs, override_discovery=False)._discovery is hs.discovery


def _executor(spelling: str):
    """An elastic executor for 1 to 2 workers, spelt as cring, Horovod's
    ElasticRayExecutor (create_settings + *_per_slot) or its RayExecutor."""
    from cring.ray import ElasticRayExecutor, RayExecutor

    if spelling == "cring":
        return ElasticRayExecutor(
            RayExecutor.create_settings(timeout_s=30), min_workers=1, max_workers=2
        )
    if spelling == "horovod-elastic-executor":
        settings = ElasticRayExecutor.create_settings(min_num_proc=1, timeout_s=30, verbose=True)
        return ElasticRayExecutor(settings, use_gpu=False, cpus_per_slot=1)  # max: 2 CPUs
    return RayExecutor(RayExecutor.create_settings(timeout_s=30), min_workers=1, max_workers=2)


@pytest.mark.parametrize("spelling", ["cring", "horovod-elastic-executor", "horovod-ray-executor"])
def test_killed_worker_leaves_and_a_new_one_joins(cluster, tmp_path, spelling):
    from ray.util.placement_group import placement_group, remove_placement_group

    t0 = time.monotonic()
    executor = _executor(spelling)
    blocker = None
    try:
        executor.start()
        assert len(executor.workers) == 2 and executor.generation == 0
        started = time.monotonic() - t0
        # Horovod's spelling also passes callbacks: rank 0 logs every step (ray_logger)
        logged: list = []
        horovods = spelling != "cring"
        thread, box = _run_in_thread(
            executor,
            elastic_train,
            [20, str(tmp_path), 3000, horovods],
            callbacks=[logged.append] if horovods else None,
        )
        _wait_for(lambda: len(_progress(tmp_path)) >= 5 or box, "5 steps on 2 workers")
        # Something else asks for a CPU; it gets the one the killed worker frees.
        blocker = placement_group([{"CPU": 1}])
        killed_at = time.monotonic()
        ray.kill(executor.workers[1])
        _wait_for(
            lambda: sum(p["size"] == 1 for p in _progress(tmp_path)) >= 5 or box,
            "5 steps on the survivor",
        )
        alone_at = time.monotonic()
        assert executor.generation == 1 and len(executor.workers) == 1
        remove_placement_group(blocker)
        blocker = None
        thread.join(RUN_TIMEOUT_S)
        assert not thread.is_alive(), "run() did not return"
        if "error" in box:
            raise box["error"]
        results = box["result"]
    finally:
        if blocker is not None:
            remove_placement_group(blocker)
        executor.shutdown()
    # generation 0: workers 0 and 1; 1: worker 0 alone; 2: worker 0 and the new worker 2
    assert executor.generation == -1  # after shutdown
    assert [(r["rank"], r["size"], r["worker"]) for r in results] == [(0, 2, 0), (1, 2, 2)]
    sizes = results[0]["sizes"]
    assert results[1]["sizes"] == sizes  # the new worker received the committed state
    shrink = sizes.index(1)
    grow = len(sizes) - sizes[::-1].index(1)
    assert shrink >= 5 and set(sizes[:shrink]) == {2}, sizes
    assert grow - shrink >= 5 and set(sizes[shrink:grow]) == {1}, sizes
    assert set(sizes[grow:]) == {2} and len(sizes) >= 20, sizes
    if horovods:  # rank 0 logged what it wrote to progress.jsonl, and it reached the driver
        pairs = sorted((item["step"], item["size"]) for item in logged)
        assert pairs == sorted((p["step"], p["size"]) for p in _progress(tmp_path))
        assert {size for _, size in pairs} == {1, 2}
    print(
        f"elastic: started in {started:.1f} s; alone {alone_at - killed_at:.1f} s after the "
        f"kill (steps {shrink}-{grow}); {len(sizes)} steps in {time.monotonic() - t0:.1f} s"
    )


def test_too_few_workers_left_raises(cluster, tmp_path):
    from cring.ray import ElasticRayExecutor, RayExecutor, RayWorkerError

    with ElasticRayExecutor(
        RayExecutor.create_settings(timeout_s=30), min_workers=2, max_workers=2
    ) as executor:
        executor.start()
        thread, box = _run_in_thread(executor, elastic_train, [10_000, str(tmp_path)])
        _wait_for(lambda: len(_progress(tmp_path)) >= 2 or box, "2 steps")
        ray.kill(executor.workers[0])
        thread.join(RUN_TIMEOUT_S)
        assert not thread.is_alive(), "run() did not return after a worker died"
        error = box.get("error")
        assert isinstance(error, RayWorkerError), box
        assert isinstance(error, cring.PeerFailureError)
        assert "worker 0 (rank 0 of 2) died" in str(error)
        assert "fewer than min_workers=2" in str(error)
        assert error.rank == 0
        with pytest.raises(RuntimeError, match="call shutdown"):
            executor.run(elastic_train, args=[1, str(tmp_path)])


def test_reset_limit_ends_the_run(cluster, tmp_path):
    from cring.ray import ElasticRayExecutor, RayExecutor, RayWorkerError

    with ElasticRayExecutor(
        RayExecutor.create_settings(timeout_s=30), min_workers=1, max_workers=2, reset_limit=0
    ) as executor:
        executor.start()
        thread, box = _run_in_thread(executor, elastic_train, [10_000, str(tmp_path)])
        _wait_for(lambda: len(_progress(tmp_path)) >= 2 or box, "2 steps")
        ray.kill(executor.workers[1])
        thread.join(RUN_TIMEOUT_S)
        assert not thread.is_alive(), "run() did not return after a worker died"
        error = box.get("error")
        assert isinstance(error, RayWorkerError), box
        assert "worker 1 (rank 1 of 2) died; reset_limit=0 reached" in str(error)


# ---- host discovery (settings.discovery with override_discovery=False) -------------------------


class _Hosts:
    """A discovery whose {host: slots} the test changes while the job runs."""

    def __init__(self, hosts: dict) -> None:
        self.hosts = dict(hosts)
        self.calls = 0

    def find_available_hosts_and_slots(self) -> dict:
        self.calls += 1
        return dict(self.hosts)


def test_discovery_plan_and_ray_host_discovery(monkeypatch):
    from cring.ray import _hosts
    from cring.ray.elastic import RayHostDiscovery, TestDiscovery
    from cring.ray.elastic_v2 import RayHostDiscovery as RayHostDiscoveryV2

    plan = _hosts.plan
    # free slots filled in discovery order, up to max_workers
    assert plan({"a": 2, "b": 1}, [], [], None) == ([], [], ["a", "a", "b"])
    assert plan({"a": 2, "b": 1}, [("w0", "a")], [("r0", "b")], 2) == ([], [], [])
    assert plan({"a": 2, "b": 2}, [("w0", "a")], [], 3) == ([], [], ["a", "b"])
    # a host with fewer slots: its requests go first, then its newest workers
    assert plan({"a": 1}, [("w0", "a"), ("w1", "a")], [("r0", "a")], None) == (["w1"], ["r0"], [])
    assert plan({}, [("w0", "a")], [("r0", "b")], None) == (["w0"], ["r0"], [])
    assert RayHostDiscoveryV2 is RayHostDiscovery
    nodes = [
        {"alive": True, "NodeManagerAddress": "10.0.0.1", "Resources": {"CPU": 8, "GPU": 2}},
        {"alive": True, "NodeManagerAddress": "10.0.0.2", "Resources": {"CPU": 3}},
        {"alive": False, "NodeManagerAddress": "10.0.0.3", "Resources": {"CPU": 8}},
    ]
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    assert RayHostDiscovery().find_available_hosts_and_slots() == {"10.0.0.1": 8, "10.0.0.2": 3}
    assert RayHostDiscovery(cpus_per_slot=2).find_available_hosts_and_slots() == {
        "10.0.0.1": 4,
        "10.0.0.2": 1,
    }
    gpu = RayHostDiscovery(use_gpu=True, gpus_per_worker=2)
    assert gpu.find_available_hosts_and_slots() == {"10.0.0.1": 1}
    with pytest.raises(NotImplementedError, match="graceful"):
        TestDiscovery(1, 2, 1.0, _graceful=False)


def discovery_train(outdir: str) -> dict:
    """Steps (counting the workers at each) until the test writes `stop`."""
    import json
    import os
    import time

    import numpy as np

    import cring
    import cring.elastic

    cring.init()

    @cring.elastic.run
    def loop(state):
        while not os.path.exists(os.path.join(outdir, "stop")):
            count = cring.allreduce(np.ones(1), op=cring.Sum)
            state.sizes.append(int(count[0]))
            state.step += 1
            state.commit()
            if cring.rank() == 0:
                with open(os.path.join(outdir, "progress.jsonl"), "a") as f:
                    f.write(json.dumps({"step": state.step, "size": cring.size()}) + "\n")
            time.sleep(0.05)
        return {"sizes": state.sizes, "worker": int(os.environ["CRING_ELASTIC_WORKER_ID"])}

    return loop(cring.elastic.ObjectState(step=0, sizes=[]))


def test_discovery_places_grows_and_shrinks_the_job(cluster, tmp_path, monkeypatch):
    """The discovery's slots on this node (Ray's node:<ip> resource) decide the
    workers: 1, then 2 (one added), then 1 (the newest stopped, the survivor
    goes on from its commit), then 2 again; start() waits for min_workers."""
    from cring.ray import _hosts
    from cring.ray.elastic import ElasticRayExecutor

    monkeypatch.setattr(_hosts, "DISCOVER_HOSTS_FREQUENCY_SECS", 0.2)
    ip = ray.util.get_node_ip_address()
    hosts = _Hosts({ip: 1})
    settings = ElasticRayExecutor.create_settings(min_num_proc=1, timeout_s=30)
    settings.discovery = hosts
    executor = ElasticRayExecutor(settings, cpus_per_slot=1, override_discovery=False)
    try:
        executor.start()
        assert len(executor.workers) == 1 and [m.host for m in executor.members] == [ip]
        thread, box = _run_in_thread(executor, discovery_train, [str(tmp_path)])

        def steps_at(size, n):
            _wait_for(
                lambda: sum(p["size"] == size for p in _progress(tmp_path)) >= n or box,
                f"{n} steps on {size} workers",
            )

        steps_at(1, 5)
        hosts.hosts = {ip: 2}
        steps_at(2, 5)
        assert executor.generation == 1 and len(executor.workers) == 2
        hosts.hosts = {ip: 1}
        _wait_for(lambda: executor.generation == 2 or box, "the newest worker stopped")
        steps_at(1, 10)
        assert len(executor.workers) == 1
        hosts.hosts = {ip: 2}
        _wait_for(lambda: executor.generation == 3 or box, "a worker added again")
        steps_at(2, 10)
        (tmp_path / "stop").write_text("")
        thread.join(RUN_TIMEOUT_S)
        assert not thread.is_alive(), "run() did not return"
        if "error" in box:
            raise box["error"]
        results = box["result"]
    finally:
        executor.shutdown()
    # workers 0 (all along), 1 (added, then stopped), 2 (added): the last two remain
    assert [r["worker"] for r in results] == [0, 2]
    sizes = results[0]["sizes"]
    assert results[1]["sizes"] == sizes  # the new worker received the committed state
    runs = [sizes[0]] + [b for a, b in zip(sizes, sizes[1:]) if a != b]
    assert runs == [1, 2, 1, 2], sizes


def test_start_time_out_names_what_each_worker_asks_for(cluster):
    """Too few workers placed within the time-out: the error names the
    request of each worker (and, with a discovery, what it offered), not only
    what the cluster has."""
    from cring.ray import ElasticRayExecutor, RayExecutor

    settings = RayExecutor.create_settings(timeout_s=10, placement_group_timeout_s=2)
    executor = ElasticRayExecutor(settings, min_workers=2, cpus_per_worker=1.5)
    with pytest.raises(TimeoutError) as caught:
        executor.start()
    message = str(caught.value)
    assert "placed 1 of min_workers=2" in message
    assert "each worker asks for {'CPU': 1.5}" in message and "available of" in message
    # the worker it did place is given back: nothing of the failed start is left
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU", 0) != ELASTIC_CPUS:  # the rest is held
        assert time.monotonic() < deadline, ray.available_resources()
        time.sleep(0.2)
    hs = ElasticRayExecutor.create_settings(min_num_proc=1, elastic_timeout=1)
    hs.discovery = _Hosts({})
    executor = ElasticRayExecutor(hs, override_discovery=False)
    with pytest.raises(TimeoutError) as caught:
        executor.start()
    message = str(caught.value)
    assert "within 1 s (elastic_timeout)" in message and "the discovery offered no hosts" in message
    assert hs.discovery.calls >= 1

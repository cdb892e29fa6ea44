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
    with pytest.raises(NotImplementedError, match="discovery"):
        ElasticRayExecutor(hs, override_discovery=False)
    assert ElasticRayExecutor(hs).max_workers == 3, "override_discovery=True ignores it"


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

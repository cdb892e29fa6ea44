"""Elastic training: cringrun --elastic with cring.elastic.run and
ObjectState / cring.torch.elastic.TorchState. Workers are killed (SIGKILL by
themselves at a chosen step), added by a host-discovery script, or ask for a
new generation; the final values are checked against a replay computed here
from the committed state the semantics imply. Every launch has a hard timeout
and leaves nothing in /dev/shm."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import WORKERS

TIMEOUT_S = 120


def cring_shm_files() -> set:
    """cring's shared-memory files in /dev/shm whose creator has exited (named
    cring-[region-]<pid>-<nonce>): what a job left behind. A file whose creator
    still runs belongs to a job in progress, this machine's other tests' too,
    and is not counted."""
    if not os.path.isdir("/dev/shm"):
        return set()
    left = set()
    for path in Path("/dev/shm").glob("cring-*"):
        m = re.match(r"cring-(?:region-)?(\d+)-", path.name)
        if m is None or not os.path.exists(f"/proc/{m.group(1)}"):
            left.add(path.name)
    return left


def launch(
    launcher_args: list,
    worker: str,
    worker_args: list,
    *,
    env: dict | None = None,
    timeout: float = TIMEOUT_S,
) -> tuple[subprocess.CompletedProcess, float]:
    full_env = dict(os.environ)
    full_env.setdefault("CRING_TIMEOUT_SECONDS", "60")
    full_env.update(env or {})
    cmd = [
        sys.executable,
        "-m",
        "cring.run",
        *launcher_args,
        sys.executable,
        str(WORKERS / worker),
        *worker_args,
    ]
    start = time.monotonic()
    try:
        proc = subprocess.run(
            cmd, env=full_env, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(
            f"cringrun --elastic hung for {timeout} s\nstdout:\n{e.stdout}\nstderr:\n{e.stderr}"
        )
    return proc, time.monotonic() - start


def results(out: Path) -> dict:
    return {
        int(p.stem[len("worker") :]): json.loads(p.read_text())
        for p in sorted(out.glob("worker*.json"))
    }


def worker_args(steps: int, commit_every: int, out: Path, *extra: str) -> list:
    """The command line of an elastic worker (tests/workers/elastic_common.py)."""
    return ["--steps", str(steps), "--commit-every", str(commit_every), *extra, "--out", str(out)]


def discovery(tmp_path: Path, slots_text: str, more: str = "") -> tuple[Path, list, Path]:
    """A slots file holding `slots_text`; cringrun's arguments for 2 to 3 workers
    with a host-discovery script that prints it (and then the shell lines
    `more`) every 0.1 s; an empty output folder."""
    slots = tmp_path / "slots"
    slots.write_text(slots_text)
    script = tmp_path / "discover.sh"
    script.write_text(f'#!/bin/sh\ncat "{slots}"\n{more}')
    script.chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    launcher_args = [
        "--elastic",
        "-np",
        "2",
        "--max-np",
        "3",
        "--host-discovery-script",
        str(script),
        "--discovery-interval",
        "0.1",
    ]
    return slots, launcher_args, out


def failure_text(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\nstdout:\n{proc.stdout[-5000:]}\nstderr:\n{proc.stderr[-5000:]}"


# ---- the plain-numbers model (tests/workers/elastic_numbers.py) ------------------------------

V = np.array([1.0, 0.5, 0.25, 0.125])


def replay_numbers(sizes: list) -> np.ndarray:
    """w after running step s on a world of sizes[s] ranks, for every s."""
    w = np.ones(4)
    for step, n in enumerate(sizes):
        average = np.mean([(r + 1) * (step + 1) * V for r in range(n)], axis=0)
        w = 0.9 * w - 0.01 * average
    return w


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_killed_worker_leaves_and_the_survivors_finish_from_the_last_commit(tmp_path, transport):
    before = cring_shm_files()
    steps, commit_every, kill_step = 20, 3, 7
    proc, _ = launch(
        ["--elastic", "-np", "3", "--min-np", "2"],
        "elastic_numbers.py",
        worker_args(steps, commit_every, tmp_path, "--kill", f"2:{kill_step}"),
        env={"CRING_TRANSPORT": transport},
    )
    assert proc.returncode == 0, failure_text(proc)
    assert (
        "worker 2 (rank 2 of 3) was killed by signal 9 (SIGKILL); continuing with 2 workers "
        "as generation 1"
    ) in proc.stderr
    got = results(tmp_path)
    assert sorted(got) == [0, 1], "only the two survivors finish"
    # Steps 0..5 ran on 3 ranks and were committed at step 6; step 6 also ran on 3
    # ranks but was not committed, so after the failure it is redone on 2 ranks.
    last_commit = kill_step // commit_every * commit_every
    expected_sizes = [3] * last_commit + [2] * (steps - last_commit)
    expected_w = replay_numbers(expected_sizes)
    # Without the restore, step 6 would count on 3 ranks: a different result.
    assert not np.allclose(expected_w, replay_numbers([3] * kill_step + [2] * (steps - kill_step)))
    for worker, result in got.items():
        assert result["size"] == 2 and result["rank"] == worker, result
        assert result["generation"] == 1
        assert result["resets"] == [[worker, 2]], "the reset callback ran once, after re-init"
        assert result["sizes"] == expected_sizes
        np.testing.assert_allclose(result["w"], expected_w, rtol=1e-12, atol=0)
    assert cring_shm_files() <= before, "shared-memory files left behind"


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_worker_killed_inside_a_collective_leaves_a_consistent_state(tmp_path, transport):
    # Where the kill lands (and so which commit the survivors hold) varies; what must
    # hold is that both survivors end identical, and that the committed history of
    # world sizes (3 ranks, then 2) explains the final values exactly.
    before = cring_shm_files()
    steps = 300
    proc, _ = launch(
        ["--elastic", "-np", "3", "--min-np", "2"],
        "elastic_numbers.py",
        worker_args(steps, 7, tmp_path, "--kill-during", "1:50", "--step-payload", "200000"),
        env={"CRING_TRANSPORT": transport},
    )
    assert proc.returncode == 0, failure_text(proc)
    got = results(tmp_path)
    assert sorted(got) == [0, 2]
    first = got[0]
    assert got[2]["w"] == first["w"] and got[2]["sizes"] == first["sizes"]
    threes = first["sizes"].count(3)
    assert 49 <= threes < steps and threes % 7 == 0, first["sizes"]
    assert first["sizes"] == [3] * threes + [2] * (steps - threes)
    np.testing.assert_allclose(first["w"], replay_numbers(first["sizes"]), rtol=1e-12, atol=0)
    assert cring_shm_files() <= before


def test_fewer_than_min_np_workers_fail_the_job_clearly(tmp_path):
    before = cring_shm_files()
    # worker 2 dies at step 4 (3 -> 2 workers: fine), worker 1 at step 9 (2 -> 1 < 2)
    proc, elapsed = launch(
        ["--elastic", "-np", "3", "--min-np", "2"],
        "elastic_numbers.py",
        worker_args(1000, 3, tmp_path, "--kill", "2:4", "--kill", "1:9"),
    )
    assert proc.returncode == 128 + 9, failure_text(proc)
    assert "continuing with 2 workers as generation 1" in proc.stderr
    assert (
        "worker 1 (rank 1 of 2) was killed by signal 9 (SIGKILL); 1 worker remains, fewer "
        "than --min-np 2: stopping the job"
    ) in proc.stderr
    assert results(tmp_path) == {}, "no worker finished"
    assert elapsed < 60, f"took {elapsed:.1f} s: the survivor was not stopped promptly"
    assert cring_shm_files() <= before, "shared-memory files left behind"


def test_reset_limit_fails_the_job(tmp_path):
    proc, _ = launch(
        ["--elastic", "-np", "2", "--min-np", "1", "--reset-limit", "0"],
        "elastic_numbers.py",
        worker_args(1000, 3, tmp_path, "--kill", "1:2"),
    )
    assert proc.returncode == 1, failure_text(proc)
    assert "--reset-limit 0" in proc.stderr
    assert results(tmp_path) == {}


@pytest.mark.parametrize("cooldown", [[], ["--blacklist-cooldown-range", "1", "2"]])
def test_a_crash_loop_ends_the_job_with_the_workers_error(tmp_path, cooldown):
    """Every worker (replacements too) crashes at step 3 while discovery keeps
    offering 2 slots: failed slots are blacklisted (for good, or for the
    cool-down) and the generation that failed as a whole ends the job with the
    workers' error and exit code, instead of replacing workers forever."""
    before = cring_shm_files()
    _, launcher_args, out = discovery(tmp_path, "localhost:2\n")
    proc, wall_s = launch(
        [*launcher_args, "--min-np", "1", *cooldown],
        "elastic_numbers.py",
        worker_args(10, 1, out, "--crash-at", "3"),
        timeout=60,
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1, failure_text(proc)  # the workers' exit code (a Python error)
    assert "RuntimeError: deterministic crash at step 3" in text, failure_text(proc)
    assert "has failed: stopping the job" in proc.stderr, failure_text(proc)
    assert "(blacklisted)" in proc.stderr, failure_text(proc)
    assert results(out) == {}
    assert wall_s < 60
    assert cring_shm_files() <= before


def test_blacklist_cooldown_range_usage():
    from cring.launch.cli import parse_args

    base = ["-np", "2", "--elastic", "--blacklist-cooldown-range"]
    assert parse_args([*base, "1", "30", "x"]).blacklist_cooldown_range == (1.0, 30.0)
    assert parse_args([*base, "1", "30", "x"]).command == ["x"]
    for bad in (["0.5", "2"], ["5", "2"], ["1", "4000"]):
        with pytest.raises(SystemExit):
            parse_args([*base, *bad, "x"])
    with pytest.raises(SystemExit):
        parse_args(["-np", "2", "--blacklist-cooldown-range", "1", "2", "x"])  # needs --elastic


def test_worker_that_times_out_gets_a_new_generation_with_the_same_workers(tmp_path):
    before = cring_shm_files()
    steps, commit_every, fail_step = 20, 3, 8
    proc, _ = launch(
        ["--elastic", "-np", "3", "--min-np", "3"],
        "elastic_numbers.py",
        worker_args(steps, commit_every, tmp_path, "--fake-timeout", str(fail_step)),
    )
    assert proc.returncode == 0, failure_text(proc)
    assert "asked for a new generation (TimeoutError: simulated time-out)" in proc.stderr
    assert "forming generation 1 with the same 3 workers" in proc.stderr
    assert "generation 2" not in proc.stderr, "one request per failure, not one per worker"
    got = results(tmp_path)
    assert sorted(got) == [0, 1, 2]
    for worker, result in got.items():
        assert (result["rank"], result["size"], result["generation"]) == (worker, 3, 1)
        assert result["sizes"] == [3] * steps  # steps 6 and 7 were redone, on 3 ranks again
        np.testing.assert_allclose(result["w"], replay_numbers([3] * steps), rtol=1e-12, atol=0)
    assert cring_shm_files() <= before


def test_discovery_script_adds_a_worker_without_restoring(tmp_path):
    before = cring_shm_files()
    slots, launcher_args, out = discovery(
        tmp_path, "localhost:2\n# comment\n", "echo other-host.example:8\n"
    )
    steps, commit_every, grow_step = 20, 3, 5
    # at step 5 the script starts reporting 4 slots here: --max-np 3 allows one more
    proc, _ = launch(
        [*launcher_args, "--min-np", "2"],
        "elastic_numbers.py",
        worker_args(steps, commit_every, out, "--grow-at", str(grow_step), str(slots)),
    )
    assert proc.returncode == 0, failure_text(proc)
    assert "host discovery: 4 slots on this host; adding 1 worker as generation 1" in proc.stderr
    assert proc.stderr.count("ignoring other-host.example") == 1, "warned once"
    got = results(out)
    assert sorted(got) == [0, 1, 2], "the new worker (id 2) finished too"
    # Step 5 had not been committed by the schedule, but the commit that noticed the
    # new worker saved it: nothing is redone, and the new worker starts from rank 0's state.
    expected_sizes = [2] * grow_step + [3] * (steps - grow_step)
    for worker, result in got.items():
        assert (result["rank"], result["size"], result["generation"]) == (worker, 3, 1)
        assert result["sizes"] == expected_sizes
        np.testing.assert_allclose(result["w"], replay_numbers(expected_sizes), rtol=1e-12, atol=0)
    assert got[2]["resets"] == [], "the new worker joined directly, without a reset"
    assert cring_shm_files() <= before


def test_workers_started_for_a_generation_nobody_joins_are_stopped(tmp_path):
    # Discovery adds a worker just as the others finish: they never join its
    # generation, so the launcher stops it and the job still succeeds.
    before = cring_shm_files()
    slots, launcher_args, out = discovery(tmp_path, "localhost:2\n")
    proc, _ = launch(
        launcher_args,
        "elastic_numbers.py",
        worker_args(10, 3, out, "--grow-at-end", str(slots)),
    )
    assert proc.returncode == 0, failure_text(proc)
    assert "adding 1 worker as generation 1" in proc.stderr
    assert (
        "stopping 1 worker (2) started for generation 1, which the others finished without joining"
    ) in proc.stderr
    got = results(out)
    assert sorted(got) == [0, 1]
    for result in got.values():
        np.testing.assert_allclose(result["w"], replay_numbers([2] * 10), rtol=1e-12, atol=0)
    assert cring_shm_files() <= before


# ---- torch: TorchState with DistributedOptimizer (tests/workers/elastic_torch.py) -----------


def _torch_worker_module():
    torch = pytest.importorskip("torch")
    spec = importlib.util.spec_from_file_location(
        "elastic_torch_worker", WORKERS / "elastic_torch.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return torch, module


def assert_matches_torch_replay(torch, worker, result: dict, sizes: list) -> None:
    """Replay the worker's training without cring: step s averages the gradients
    of ranks 0..sizes[s]-1, then takes the plain SGD-with-momentum step."""
    model = worker.make_model()
    optimizer = worker.make_optimizer(model)
    for step, n in enumerate(sizes):
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for r in range(n):
            model.zero_grad()
            worker.loss_of(model, r, step).backward()
            for g, p in zip(grads, model.parameters()):
                g += p.grad
        for g, p in zip(grads, model.parameters()):
            p.grad = g / n
        optimizer.step()
    assert result["sizes"] == sizes
    for mine, param in zip(result["params"], model.parameters()):
        np.testing.assert_allclose(mine, param.detach().numpy(), rtol=1e-5, atol=1e-6)
    for mine, param in zip(result["momentum"], model.parameters()):
        np.testing.assert_allclose(
            mine, optimizer.state[param]["momentum_buffer"].numpy(), rtol=1e-5, atol=1e-6
        )


@pytest.mark.slow
def test_torch_state_survives_a_killed_worker(tmp_path):
    torch, worker = _torch_worker_module()
    before = cring_shm_files()
    steps, commit_every, kill_step = 12, 3, 7
    proc, _ = launch(
        ["--elastic", "-np", "3", "--min-np", "2"],
        "elastic_torch.py",
        worker_args(steps, commit_every, tmp_path, "--kill", f"2:{kill_step}"),
    )
    assert proc.returncode == 0, failure_text(proc)
    got = results(tmp_path)
    assert sorted(got) == [0, 1]
    # The committed state at step 6 (3 ranks), then steps 6..11 on 2 ranks; momentum
    # buffers are part of what is committed and restored.
    last_commit = kill_step // commit_every * commit_every
    sizes = [3] * last_commit + [2] * (steps - last_commit)
    for result in got.values():
        assert_matches_torch_replay(torch, worker, result, sizes)
    assert cring_shm_files() <= before


@pytest.mark.slow
def test_torch_state_survives_a_worker_killed_inside_a_collective(tmp_path):
    # The kill lands while DistributedOptimizer's allreduces are in flight: restore()
    # must drop them, and the committed history explains the final values.
    torch, worker = _torch_worker_module()
    before = cring_shm_files()
    steps = 200
    proc, _ = launch(
        ["--elastic", "-np", "3", "--min-np", "2"],
        "elastic_torch.py",
        worker_args(steps, 7, tmp_path, "--kill-during", "1:40"),
    )
    assert proc.returncode == 0, failure_text(proc)
    got = results(tmp_path)
    assert sorted(got) == [0, 2]
    assert got[0]["params"] == got[2]["params"]
    threes = got[0]["sizes"].count(3)
    assert 35 <= threes < steps and threes % 7 == 0, got[0]["sizes"]
    assert_matches_torch_replay(torch, worker, got[0], [3] * threes + [2] * (steps - threes))
    assert cring_shm_files() <= before


def test_torch_state_commit_and_restore():
    torch = pytest.importorskip("torch")
    from cring.torch.elastic import TorchState

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    x = torch.randn(8, 3)

    def train_step():
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
        scheduler.step()

    train_step()  # creates momentum buffers and moves the BatchNorm statistics
    state = TorchState(model, optimizer, scheduler=scheduler, epoch=1, history=[1.0])
    params = copy.deepcopy(model.state_dict())
    momentum = {
        name: optimizer.state[p]["momentum_buffer"].clone() for name, p in model.named_parameters()
    }
    lr = optimizer.param_groups[0]["lr"]

    def assert_committed():
        for key, value in model.state_dict().items():
            assert torch.equal(value, params[key]), key
        for name, p in model.named_parameters():
            assert torch.equal(optimizer.state[p]["momentum_buffer"], momentum[name]), name
        assert optimizer.param_groups[0]["lr"] == lr
        assert scheduler.last_epoch == 1
        assert (state.epoch, state.history) == (1, [1.0])

    state.commit()
    for _ in range(2):
        train_step()
    state.epoch += 5
    state.history.append(2.0)  # in place: the commit must be a copy
    assert not torch.equal(model.state_dict()["0.weight"], params["0.weight"])
    weight = model[0].weight
    state.restore()
    assert_committed()
    assert model[0].weight is weight, "restore loads into the same objects"
    assert state.model is model and state.optimizer is optimizer
    # the restored optimizer state must not alias the commit: step again, restore again
    train_step()
    state.history.append(3.0)
    state.restore()
    assert_committed()

    # a new commit replaces the old one
    train_step()
    state.epoch = 7
    state.commit()
    committed_weight = model[0].weight.detach().clone()
    train_step()
    state.restore()
    assert torch.equal(model[0].weight, committed_weight)
    assert state.epoch == 7


def test_torch_state_rejects_wrong_types():
    torch = pytest.importorskip("torch")
    from cring.torch.elastic import TorchState

    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        TorchState(object())
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        TorchState(torch.nn.Linear(1, 1), optimizer=[1])


# ---- pieces, in process ---------------------------------------------------------------------


def test_object_state_commits_copies():
    import cring.elastic

    state = cring.elastic.ObjectState(step=0, w=np.zeros(3))
    state.w += 1  # in place, before any commit: restore gives the constructor's values
    state.restore()
    np.testing.assert_array_equal(state.w, np.zeros(3))
    state.w[:] = 5
    state.step = 4
    state.commit()  # outside cringrun --elastic: no host-update check
    state.w[:] = 7
    state.step = 9
    state.restore()
    assert state.step == 4
    np.testing.assert_array_equal(state.w, np.full(3, 5.0))
    state.w[:] = 8  # the restored value is a copy too
    state.restore()
    np.testing.assert_array_equal(state.w, np.full(3, 5.0))
    with pytest.raises(ValueError, match="reserved"):
        cring.elastic.ObjectState(commit=1)


def test_run_needs_a_state():
    import cring.elastic

    @cring.elastic.run
    def train(state):
        return "done"

    with pytest.raises(TypeError, match="must be a cring.elastic.State"):
        train(123)


def test_store_client_speaks_the_store_protocol():
    from cring import _C
    from cring._elastic_protocol import StoreClient as _StoreClient

    server = _C.StoreServer("127.0.0.1", 0, "s3cret")
    try:
        client = _StoreClient("127.0.0.1", server.port, "s3cret", 5.0)
        assert client.get("missing", 0.05) is None
        client.set("k", b"value")
        assert client.get("k", 1.0) == b"value"
        assert client.add("n", 2) == 2 and client.add("n", -5) == -3
        assert client.wait(["k", "n"], 1.0) is True
        assert client.wait(["k", "nope"], 0.05) is False
        # abort() from another thread ends a blocked call at once
        timer = threading.Timer(0.2, client.abort)
        timer.start()
        start = time.monotonic()
        with pytest.raises(ConnectionError, match="'never'"):
            client.get("never", 30.0)
        assert time.monotonic() - start < 10
        timer.join()
        client.close()
        with pytest.raises(ConnectionError, match="refused this process's job secret"):
            _StoreClient("127.0.0.1", server.port, "wrong", 5.0)
    finally:
        server.stop()


def test_discovery_output_parsing():
    from cring.launch.elastic_driver import parse_discovery as _parse_discovery

    hosts, problems = _parse_discovery("localhost:2\n\n# c\nnode7\nnode7:3\nbad:x\n:4\n")
    assert hosts == {"localhost": 2, "node7": 4}
    assert len(problems) == 2 and "'bad:x'" in problems[0]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-np", "2", "--min-np", "1", "true"], "--min-np needs --elastic"),
        (["-np", "2", "--elastic", "--min-np", "3", "true"], "--min-np 3 is more than -np 2"),
        (["-np", "2", "--elastic", "--max-np", "1", "true"], "--max-np 1 is less than -np 2"),
        (
            ["-np", "2", "--elastic", "--host-discovery-script", "/nonexistent/x", "true"],
            "is not an executable file",
        ),
        (["-np", "2", "--elastic", "--reset-limit", "-1", "true"], "expected an integer >= 0"),
    ],
)
def test_elastic_usage_errors(args, message):
    proc = subprocess.run(
        [sys.executable, "-m", "cring.run", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert message in proc.stderr


def test_elastic_generation_names_the_rendezvous_key():
    from cring import _discovery

    def key(generation, **env):
        plan = _discovery.plan_init(
            rank=None,
            size=None,
            addr=None,
            port=None,
            secret=None,
            transport=None,
            timeout_s=None,
            generation=generation,
            start_store=None,
            env={"CRING_RANK": "0", "CRING_SIZE": "1", "CRING_JOB_ID": "j", **env},
        )
        return plan.job_key

    assert key(3) == "j/3"
    # survivors (after several init()s) and new workers (first) meet under one key
    assert key(0, CRING_ELASTIC_GENERATION="2") == key(5, CRING_ELASTIC_GENERATION="2")
    assert key(0, CRING_ELASTIC_GENERATION="2") == "j/elastic.2"
    with pytest.raises(ValueError, match="CRING_ELASTIC_GENERATION"):
        key(0, CRING_ELASTIC_GENERATION="x")


# ---- ElasticSampler (tests/workers/elastic_sampler.py) -------------------------------------


def test_elastic_sampler_partitions_and_repartitions_the_rest():
    pytest.importorskip("torch")
    from cring.torch.elastic import ElasticSampler

    def samplers(n_ranks, state=None):
        out = []
        for r in range(n_ranks):  # cring is not initialised here: set the ranks by hand
            s = ElasticSampler(list(range(30)), shuffle=True, seed=5)
            s.num_replicas, s.rank = n_ranks, r
            if state is not None:
                s.load_state_dict(copy.deepcopy(state))
            s.reset()
            out.append(s)
        return out

    three = samplers(3)
    parts = [list(iter(s)) for s in three]
    assert sorted(sum(parts, [])) == list(range(30)), "a partition of the dataset"
    assert parts[0] != sorted(parts[0]), "shuffled"
    for s in three:  # two batches of 4 processed on every rank
        s.record_batch(0, 4)
        s.record_batch(1, 4)
    done = set(sum((p[:8] for p in parts), []))
    assert all(s.processed_indices == done for s in three), "every rank records every rank's batch"
    two = samplers(2, three[0].state_dict())
    rest = [list(iter(s)) for s in two]
    assert len(rest[0]) == len(rest[1]) == 3
    assert sorted(sum(rest, []) + sorted(done)) == list(range(30)), "the rest, once"
    # Horovod's later state_dict (a count of the order's first indices) loads too
    (s,) = samplers(1, {"epoch": 0, "processed_num": 24})
    assert sorted(iter(s)) == sorted(
        set(range(30)) - set(ElasticSampler(list(range(30)), seed=5)._order()[:24])
    )
    s.set_epoch(1)
    assert len(s) == 30 and list(iter(s)) != parts[0]
    with pytest.raises(KeyError, match="processed_indices"):
        s.load_state_dict({"epoch": 0})


def test_elastic_sampler_across_a_reset_from_3_to_2_ranks(tmp_path):
    # 60 samples, 2 a rank a step: 10 steps of 6 on 3 ranks. Worker 2 dies before
    # step 5; commits every 2 steps, so steps 0-3 are committed and step 4 is
    # redone: the 36 samples left go to 2 ranks (9 steps). Epoch 1 runs on 2 ranks.
    pytest.importorskip("torch")
    proc, _ = launch(
        ["--elastic", "-np", "3", "--min-np", "2"],
        "elastic_sampler.py",
        worker_args(0, 2, tmp_path, "--kill", "2:5", "--samples", "60", "--epochs", "2"),
    )
    assert proc.returncode == 0, failure_text(proc)
    got = results(tmp_path)
    assert sorted(got) == [0, 1]
    for result in got.values():
        seen = np.array(result["seen"])
        assert seen.shape == (2, 60)
        lost, repeated = np.flatnonzero(seen == 0), np.flatnonzero(seen > 1)
        assert lost.size == 0 and repeated.size == 0, (lost, repeated)
        assert result["sizes"] == [3] * 4 + [2] * 9 + [2] * 15

"""Rank discovery and rendezvous: CRING_*, torchrun, Open MPI (with and without
mpi4py), SLURM, Horovod variables and keyword arguments; shutdown then init
again. Each job runs real processes with a hard timeout."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cring import _discovery

from conftest import WORKERS, free_port, run_ranks

TIMEOUT_S = 120


def clean_env(**extra: str) -> dict:
    """The test's environment without any launcher variables, plus `extra`."""
    prefixes = ("CRING_", "OMPI_", "PMI_", "PMIX_", "SLURM_", "HOROVOD_", "TORCHELASTIC_")
    names = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes) and k not in names}
    env["CRING_TIMEOUT_SECONDS"] = "60"
    env.update(extra)
    return env


def topologies(out: Path) -> list[dict]:
    """The rows each rank's topology.py wrote into `out` (files, not stdout:
    mpirun and torchrun do not keep lines from different ranks whole)."""
    rows = [json.loads(p.read_text()) for p in out.glob("rank*.json")]
    return sorted(rows, key=lambda r: (r["attempt"], r["rank"]))


def spawn_each(tmp_path: Path, envs: list[dict], *args: str) -> list[dict]:
    """Start one worker per env dict (no launcher) and wait for all."""
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKERS / "topology.py"), f"--out={tmp_path}", *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for env in envs
    ]
    for p in procs:
        try:
            out, err = p.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a rank hung")
        assert p.returncode == 0, err[-4000:]
    return topologies(tmp_path)


def check_world(rows: list[dict], size: int, attempts: int = 1) -> None:
    assert len(rows) == size * attempts
    for row in rows:
        assert row["size"] == size
        assert row["local_size"] == size and row["local_rank"] == row["rank"]
        assert row["cross_size"] == 1 and row["cross_rank"] == 0
    assert sorted(r["rank"] for r in rows) == sorted(list(range(size)) * attempts)


# ---- unit tests of the discovery rules (no processes) ------------------------


def plan(env: dict, **kw):
    started = []

    def start_store(addr, secret):
        started.append(addr)
        return None, 4242

    p = _discovery.plan_init(
        rank=kw.get("rank"),
        size=kw.get("size"),
        addr=kw.get("addr"),
        port=kw.get("port"),
        secret=None,
        transport=None,
        timeout_s=None,
        generation=0,
        start_store=start_store,
        env=env,
    )
    return p, started


@pytest.mark.parametrize(
    "env,expected",
    [
        ({"CRING_RANK": "1", "CRING_SIZE": "3"}, (1, 3, "cring")),
        ({"HOROVOD_RANK": "2", "HOROVOD_SIZE": "4"}, (2, 4, "horovod")),
        ({"RANK": "1", "WORLD_SIZE": "2"}, (1, 2, "torchrun")),
        ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "5"}, (3, 5, "openmpi")),
        ({"PMI_RANK": "0", "PMI_SIZE": "2"}, (0, 2, "pmi")),
        ({"SLURM_PROCID": "7", "SLURM_NTASKS": "8"}, (7, 8, "slurm")),
        ({}, (None, None, "single process")),
        # CRING_* wins over the others
        ({"CRING_RANK": "0", "CRING_SIZE": "2", "RANK": "5", "WORLD_SIZE": "9"}, (0, 2, "cring")),
    ],
)
def test_detect_rank_size(env, expected):
    assert _discovery._detect_rank_size(env) == expected


def test_master_addr_port_and_keyword_override():
    p, _ = plan({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "2950"})
    assert (p.rank, p.size, p.addr, p.port, p.serve_store) == (0, 2, "10.1.2.3", 2950, True)
    p, _ = plan(
        {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"},
        rank=0,
        size=3,
        addr="127.0.0.1",
        port=5555,
    )
    assert (p.rank, p.size, p.addr, p.port, p.serve_store) == (0, 3, "127.0.0.1", 5555, True)
    p, _ = plan(
        {
            "CRING_RANK": "0",
            "CRING_SIZE": "2",
            "CRING_ADDR": "127.0.0.1",
            "CRING_PORT": "7",
            "CRING_STORE_EXTERNAL": "1",
        }
    )
    assert p.serve_store is False  # the launcher holds the store


def test_slurm_address_from_nodelist():
    assert _discovery._slurm_first_host("node[07-09,12],login1") == "node07"
    assert _discovery._slurm_first_host("gpu3") == "gpu3"
    p, _ = plan(
        {
            "SLURM_PROCID": "1",
            "SLURM_NTASKS": "2",
            "SLURM_JOB_NODELIST": "cn[4-5]",
            "SLURM_JOB_ID": "123",
        }
    )
    assert (p.addr, p.port, p.serve_store) == ("cn4", 15123, False)


def test_bad_environment_values():
    with pytest.raises(ValueError, match="CRING_RANK"):
        _discovery._detect_rank_size({"CRING_RANK": "x", "CRING_SIZE": "2"})
    with pytest.raises(ValueError, match="out of range"):
        plan({"CRING_RANK": "2", "CRING_SIZE": "2"})
    with pytest.raises(ValueError, match="no rendezvous address"):
        plan({"CRING_RANK": "0", "CRING_SIZE": "2"})
    with pytest.raises(ValueError, match="TRANSPORT"):
        _discovery.plan_init(
            rank=0,
            size=1,
            addr=None,
            port=None,
            secret=None,
            transport="udp",
            timeout_s=None,
            generation=0,
            start_store=None,
            env={},
        )


# ---- real rendezvous -----------------------------------------------------------


def test_cringrun_three_ranks_and_reinit(tmp_path):
    run_ranks(3, "topology.py", "--reinit", f"--out={tmp_path}", env=clean_env(), timeout=TIMEOUT_S)
    rows = topologies(tmp_path)
    check_world(rows, 3, attempts=2)
    assert {r["transport"] for r in rows} == {"shm"}


def test_torch_style_environment_without_launcher(tmp_path):
    """RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set by hand: rank 0 serves the
    store on MASTER_PORT; a re-init binds it again."""
    port = str(free_port())
    envs = [
        clean_env(RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        for r in range(2)
    ]
    check_world(spawn_each(tmp_path, envs, "--reinit"), 2, attempts=2)


def test_horovod_variables_and_tcp(tmp_path):
    port = str(free_port())
    envs = [
        clean_env(
            HOROVOD_RANK=str(r),
            HOROVOD_SIZE="2",
            CRING_ADDR="127.0.0.1",
            CRING_PORT=port,
            CRING_TRANSPORT="tcp",
        )
        for r in range(2)
    ]
    rows = spawn_each(tmp_path, envs)
    check_world(rows, 2)
    assert {r["transport"] for r in rows} == {"tcp"}


def test_keyword_arguments_override_environment(tmp_path):
    port = free_port()
    children = []
    for r in range(2):
        kw = json.dumps({"rank": r, "size": 2, "addr": "127.0.0.1", "port": port})
        children.append(
            subprocess.Popen(
                [sys.executable, str(WORKERS / "topology.py"), "--kw=" + kw, f"--out={tmp_path}"],
                env=clean_env(RANK="9", WORLD_SIZE="10"),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    for c in children:
        _, err = c.communicate(timeout=TIMEOUT_S)
        assert c.returncode == 0, err
    check_world(topologies(tmp_path), 2)


def test_slurm_environment(tmp_path):
    job = str(free_port() - 15000 + 20000 * 3)  # port = 15000 + job % 20000: a free one
    envs = [
        clean_env(
            SLURM_PROCID=str(r), SLURM_NTASKS="2", SLURM_JOB_NODELIST="localhost", SLURM_JOB_ID=job
        )
        for r in range(2)
    ]
    check_world(spawn_each(tmp_path, envs), 2)


def test_torchrun(tmp_path):
    pytest.importorskip("torch")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        str(WORKERS / "topology.py"),
        f"--out={tmp_path}",
    ]
    proc = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    check_world(topologies(tmp_path), 2)


def mpirun_cmd(np_: int) -> list[str]:
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("Open MPI's mpirun is not installed")
    return [mpirun, "--allow-run-as-root", "--oversubscribe", "-np", str(np_)]


@pytest.mark.parametrize("with_mpi4py", [True, False])
def test_mpirun_without_master_address(tmp_path, with_mpi4py):
    env = clean_env()
    if with_mpi4py:
        pytest.importorskip("mpi4py")
    else:
        blocker = tmp_path / "mpi4py"
        blocker.mkdir()
        (blocker / "__init__.py").write_text("raise ImportError('mpi4py hidden by the test')\n")
        env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    out = tmp_path / "out"
    out.mkdir()
    cmd = mpirun_cmd(3) + [
        "-x",
        "PYTHONPATH",
        "-x",
        "CRING_TIMEOUT_SECONDS",
        sys.executable,
        str(WORKERS / "topology.py"),
        f"--out={out}",
    ]
    env.setdefault("PYTHONPATH", "")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    check_world(topologies(out), 3)
    assert not list(Path(os.environ.get("TMPDIR", "/tmp")).glob(f"cring-rdzv-{os.getuid()}-*"))

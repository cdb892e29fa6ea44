"""Trainer/Fabric(strategy="cring", accelerator="gpu") on this CPU-only machine:
the strategy's device handling, with torch's CUDA queries patched.

torch here is the CPU build, so CUDA tensors cannot exist: a Lightning fit on
accelerator="gpu" cannot run here, not even against the fake libcudart/libnccl
(they stand in for cring's own CUDA calls, not for torch's allocator and
kernels). So this module does not fake a fit; it checks what decides where a
rank trains, with torch.cuda.is_available/device_count/set_device (and the
capability queries Lightning's CUDAAccelerator makes) patched:

  * root_device per local rank under cringrun, torchrun, mpirun, SLURM and
    Ray (CRING_CUDA_DEVICE), with devices=1 and devices=<processes per host>,
    one or several visible GPUs, and the error for a rank without a GPU;
  * the processes the strategy's own launcher starts (subprocess.Popen patched:
    nothing is started) and the device of each;
  * setup_environment making the device current (torch.cuda.set_device) at
    world size 1, for the Trainer and Fabric;
  * the precision plugin Lightning gives the strategy for "32", "bf16-mixed"
    and "16-mixed" (with its GradScaler);
  * that CUDA is accepted and other device kinds (MPS, meta) are refused.

The real fit (final weights against strategy="ddp" to 1e-6) is
tests/gpu/lightning_gpu_check.py, run on a GPU machine. Nothing here starts a
process.
"""

from __future__ import annotations

import os
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lightning")

import lightning.fabric as lf  # noqa: E402
import lightning.pytorch as pl  # noqa: E402

import cring  # noqa: E402
import cring.lightning as cl  # noqa: E402
from cring.lightning import _environment, _launch  # noqa: E402

# every variable a launcher (or an earlier test) may have left that decides the launch
_LAUNCH_PREFIXES = ("CRING_", "HOROVOD_", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL", "SLURM_")
_LAUNCH_NAMES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "CUDA_VISIBLE_DEVICES",
)

# rank 1 of 4, local rank 1 of 2 on node 0, as each launcher says it
LAUNCHERS = {
    "cringrun": {
        "CRING_RANK": "1",
        "CRING_SIZE": "4",
        "CRING_LOCAL_RANK": "1",
        "CRING_LOCAL_SIZE": "2",
        "CRING_NODE_RANK": "0",
    },
    "torchrun": {
        "RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "0",
    },
    "mpirun": {
        "OMPI_COMM_WORLD_RANK": "1",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    },
    "slurm": {
        "SLURM_PROCID": "1",
        "SLURM_NTASKS": "4",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "0",
        "SLURM_NTASKS_PER_NODE": "2",  # with --ntasks-per-node (Lightning checks it too)
    },
}


class FakeCuda:
    """torch.cuda as a process with `count` GPUs sees it; records set_device.
    Also the test's monkeypatch (setenv, delenv, setattr pass through)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, count: int) -> None:
        self._monkeypatch = monkeypatch
        self.count = count
        self.current: list = []  # every set_device call, as torch.device
        monkeypatch.setattr(torch.cuda, "is_available", lambda: self.count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: self.count)
        monkeypatch.setattr(torch.cuda, "set_device", self._set_device)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "fake GPU")
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)

    def __getattr__(self, name: str):
        return getattr(self._monkeypatch, name)

    def _set_device(self, device) -> None:
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        assert device.index is not None and 0 <= device.index < self.count, device
        self.current.append(device)


@pytest.fixture
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith(_LAUNCH_PREFIXES) or name in _LAUNCH_NAMES:
            monkeypatch.delenv(name)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # else Lightning sets it, and torch's threads
    # Lightning's MPIEnvironment.detect() initialises MPI through mpi4py: with Open MPI's
    # variables faked that would look for an mpirun that is not there
    from lightning.fabric.plugins.environments import MPIEnvironment

    monkeypatch.setattr(MPIEnvironment, "detect", staticmethod(lambda: False))
    return monkeypatch


@pytest.fixture
def cuda2(clean_env):
    return FakeCuda(clean_env, 2)


def _trainer(**kwargs):
    kwargs.setdefault("accelerator", "gpu")
    kwargs.setdefault("devices", 1)
    return pl.Trainer(
        strategy="cring",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


# ---- which GPU a rank takes ----------------------------------------------------------------------


def _ext(local_rank: int, source: str = "cring", local_size=2) -> _launch.Launch:
    return _launch.Launch(source, local_rank, 4, local_rank, local_size, 0)


@pytest.mark.parametrize(
    "launch, local_rank, requested, visible, env, expected",
    [
        # Lightning's own launch: requested[local rank], as DDP
        (None, 0, [0, 1], 2, {}, 0),
        (None, 1, [0, 1], 2, {}, 1),
        (None, 1, [2, 3], 4, {}, 3),
        (None, 0, [0], 2, {"CRING_CUDA_DEVICE": "1"}, 0),  # children would all inherit it
        # an external launcher, devices=1: the local rank, or the one visible device
        (_ext(1), 1, [0], 2, {}, 1),
        (_ext(1), 1, [0], 1, {}, 0),
        (_ext(0), 0, [0], 8, {}, 0),
        # devices = processes per host (torchrun's convention): requested[local rank]
        (_ext(1), 1, [0, 1], 2, {}, 1),
        (_ext(1), 1, [4, 5], 8, {}, 5),
        # devices=[k]: as the user asked
        (_ext(1), 1, [3], 4, {}, 3),
        # Ray (cring.ray sets CRING_CUDA_DEVICE): the worker's own GPU, whatever its local rank
        (_ext(1), 1, [0], 2, {"CRING_CUDA_DEVICE": "0"}, 0),
        (_ext(0), 0, [0], 2, {"CRING_CUDA_DEVICE": "1"}, 1),
    ],
)
def test_cuda_device_index(launch, local_rank, requested, visible, env, expected):
    def count():
        return visible

    assert _launch.cuda_device_index(launch, local_rank, requested, count, env) == expected


def test_cuda_device_index_errors():
    with pytest.raises(ValueError, match=r"rank 3.*only 2 CUDA devices.*CRING_GPU_OPERATIONS"):
        _launch.cuda_device_index(_ext(3, "openmpi", 4), 3, [0], lambda: 2, {})
    with pytest.raises(ValueError, match="no CUDA device is visible"):
        _launch.cuda_device_index(_ext(0), 0, [0], lambda: 0, {})
    with pytest.raises(ValueError, match="local rank 2 has no CUDA device"):
        _launch.cuda_device_index(None, 2, [0, 1], lambda: 2, {})
    with pytest.raises(ValueError, match="CRING_CUDA_DEVICE"):
        _launch.cuda_device_index(_ext(0), 0, [0], lambda: 2, {"CRING_CUDA_DEVICE": "x"})

    # SLURM_NTASKS_PER_NODE that is not one number: no local size, no error
    slurm = {"SLURM_PROCID": "0", "SLURM_NTASKS": "6", "SLURM_LOCALID": "0"}
    assert _launch.external_launch(dict(slurm, SLURM_NTASKS_PER_NODE="2(x3)")).local_size is None
    assert _launch.external_launch(dict(slurm, SLURM_NTASKS_PER_NODE="2")).local_size == 2

    def not_asked():
        raise AssertionError("device_count() was called although the answer was known")

    assert _launch.cuda_device_index(_ext(1), 1, [0, 1], not_asked, {}) == 1


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
@pytest.mark.parametrize("devices", [1, 2])
def test_root_device_is_the_local_rank_under_each_launcher(cuda2, launcher, devices):
    for name, value in LAUNCHERS[launcher].items():
        cuda2.setenv(name, value)
    trainer = _trainer(devices=devices, num_nodes=4 // devices)  # 4 ranks, 2 per host
    strategy = trainer.strategy
    assert type(strategy).__name__ == "CRingStrategy"
    assert strategy.cluster_environment.launch is not None
    assert (trainer.global_rank, trainer.world_size, trainer.local_rank) == (1, 4, 1)
    assert strategy.root_device == torch.device("cuda", 1)
    assert strategy.launcher.num_processes == devices
    assert strategy.cluster_environment.creates_processes_externally


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_one_visible_gpu_per_process_is_cuda_0(clean_env, launcher):
    """srun --gpus-per-task=1, or CUDA_VISIBLE_DEVICES set per rank by a wrapper."""
    FakeCuda(clean_env, 1)
    for name, value in LAUNCHERS[launcher].items():
        clean_env.setenv(name, value)
    assert _trainer().strategy.root_device == torch.device("cuda", 0)


def test_ray_worker_takes_the_gpu_ray_gave_it(cuda2):
    """cring.ray's worker setup exports CRING_CUDA_DEVICE (the worker's GPU among
    the node's shared CUDA_VISIBLE_DEVICES); local rank 1 was given GPU 0 here."""
    for name, value in LAUNCHERS["cringrun"].items():
        cuda2.setenv(name, value)
    cuda2.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    cuda2.setenv("CRING_CUDA_DEVICE", "0")
    assert _trainer().strategy.root_device == torch.device("cuda", 0)
    cuda2.setenv("CRING_CUDA_DEVICE", "1")
    assert _trainer().strategy.root_device == torch.device("cuda", 1)


def test_a_rank_without_a_gpu_fails_when_the_trainer_is_built(cuda2):
    for name, value in {
        "OMPI_COMM_WORLD_RANK": "3",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "3",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
    }.items():
        cuda2.setenv(name, value)
    with pytest.raises(ValueError, match=r"openmpi started local rank 3.*only 2 CUDA devices"):
        _trainer()


def test_devices_must_still_match_an_external_launcher(cuda2):
    for name, value in LAUNCHERS["torchrun"].items():
        cuda2.setenv(name, value)
    cuda2.setattr(torch.cuda, "device_count", lambda: 4)
    with pytest.raises(ValueError, match=r"devices=3.*torchrun.*devices=1"):
        _trainer(devices=3)


# ---- the strategy's own launch ------------------------------------------------------------------


class _FakeProcess:
    def __init__(self, command, env=None, cwd=None) -> None:
        self.command, self.env, self.pid, self.returncode = command, env, 0, 0

    def poll(self) -> int:
        return 0

    def wait(self, timeout=None) -> int:
        return 0


def test_own_launch_starts_one_process_per_further_gpu(cuda2):
    """python train.py with devices=2: this process is local rank 0 on cuda:0 and
    starts one more copy (LOCAL_RANK=1), which takes cuda:1; nothing really starts."""
    from lightning.pytorch.strategies.launchers import subprocess_script

    trainer = _trainer(devices=2)
    strategy = trainer.strategy
    assert strategy.cluster_environment.launch is None
    assert not strategy.cluster_environment.creates_processes_externally
    assert strategy.num_processes == 2 and strategy.root_device == torch.device("cuda", 0)

    started: list = []

    def popen(command, env=None, cwd=None):
        started.append(_FakeProcess(command, env, cwd))
        return started[-1]

    cuda2.setattr(subprocess_script.subprocess, "Popen", popen)
    cuda2.setattr(strategy.launcher._lib, "launch_process_observer", lambda procs: None)
    saved_env = dict(os.environ)
    try:
        assert strategy.launcher.launch(lambda: "ran") == "ran"
        child_env = dict(started[0].env) if started else {}
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        for proc in started:  # the parent would wait for them at exit
            if proc in _environment._children:
                _environment._children.remove(proc)
    assert len(started) == 1
    assert child_env["LOCAL_RANK"] == "1" and child_env["WORLD_SIZE"] == "2"
    assert child_env.get("CRING_SECRET")

    # the child: LOCAL_RANK=1, as the launcher set it
    for name in ("LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"):
        cuda2.setenv(name, child_env[name])
    child = _trainer(devices=2)
    assert child.strategy.cluster_environment.creates_processes_externally
    assert child.strategy.cluster_environment.launch is None  # Lightning's child, not external
    assert (child.global_rank, child.world_size) == (1, 2)
    assert child.strategy.root_device == torch.device("cuda", 1)


def test_own_launch_honours_a_device_list(cuda2):
    cuda2.setattr(torch.cuda, "device_count", lambda: 4)
    cuda2.setenv("LOCAL_RANK", "1")  # the second process Lightning starts
    assert _trainer(devices=[2, 3]).strategy.root_device == torch.device("cuda", 3)


def test_setup_environment_makes_the_device_current(cuda2):
    """One rank (no launcher): setup_environment sets cuda:0 current, joins
    cring (which stays after teardown); under Ray-like settings (CRING_CUDA_DEVICE)
    the worker's GPU is made current."""
    strategy = _trainer().strategy
    assert strategy.root_device == torch.device("cuda", 0)
    strategy.setup_environment()
    try:
        assert cuda2.current == [torch.device("cuda", 0)]
        assert cring.is_initialized() and cring.size() == 1
    finally:
        strategy.teardown()
    assert cring.is_initialized()  # kept after the run (docs/lightning.md)
    cring.shutdown()

    cuda2.current.clear()
    for name, value in {"CRING_RANK": "0", "CRING_SIZE": "1", "CRING_CUDA_DEVICE": "1"}.items():
        cuda2.setenv(name, value)
    strategy = _trainer().strategy
    strategy.setup_environment()
    try:
        assert cuda2.current == [torch.device("cuda", 1)]
    finally:
        strategy.teardown()
    assert cring.is_initialized()  # kept after the run (docs/lightning.md)
    cring.shutdown()


def test_fabric_on_gpu(cuda2):
    for name, value in LAUNCHERS["cringrun"].items():
        cuda2.setenv(name, value)
    fabric = lf.Fabric(strategy="cring", accelerator="cuda", devices=1)
    assert type(fabric.strategy).__name__ == "CRingFabricStrategy"
    assert fabric.device == torch.device("cuda", 1)
    assert (fabric.global_rank, fabric.world_size, fabric.local_rank) == (1, 4, 1)

    for name in LAUNCHERS["cringrun"]:
        cuda2.delenv(name)
    fabric = lf.Fabric(strategy="cring", accelerator="gpu", devices=1)
    fabric.launch()  # one rank: joins cring, makes cuda:0 current
    try:
        assert cuda2.current[-1] == torch.device("cuda", 0)
        assert cring.is_initialized() and fabric.world_size == 1
    finally:
        fabric.strategy.teardown()
    assert cring.is_initialized()  # kept after the run (docs/lightning.md)
    cring.shutdown()


# ---- precision ----------------------------------------------------------------------------------


@pytest.mark.parametrize("api", ["Trainer", "Fabric"])
def test_precision_plugins_on_gpu(cuda2, api):
    """Lightning picks the plugin; on the GPU "16-mixed" comes with a GradScaler,
    which unscales the gradients after the strategy's backward has averaged them."""

    def plugin(precision):
        if api == "Trainer":
            return _trainer(precision=precision).strategy.precision_plugin
        fabric = lf.Fabric(strategy="cring", accelerator="gpu", devices=1, precision=precision)
        return fabric._precision

    p32 = plugin("32")
    assert type(p32).__name__ == "Precision"
    bf16 = plugin("bf16-mixed")
    assert type(bf16).__name__ == "MixedPrecision"
    assert (bf16.device, bf16.precision, bf16.scaler) == ("cuda", "bf16-mixed", None)
    fp16 = plugin("16-mixed")
    assert type(fp16).__name__ == "MixedPrecision"
    assert (fp16.device, fp16.precision) == ("cuda", "16-mixed")
    assert isinstance(fp16.scaler, torch.amp.GradScaler) and fp16.scaler.is_enabled()


# ---- refused devices, accepted tensors -----------------------------------------------------------


def test_the_cpu_only_refusal_is_gone(cuda2):
    trainer = _trainer(devices=2)
    assert [d.type for d in trainer.strategy.parallel_devices] == ["cuda", "cuda"]
    assert type(trainer.accelerator).__name__ == "CUDAAccelerator"


@pytest.mark.parametrize("cls", ["CRingStrategy", "CRingFabricStrategy"])
def test_other_device_kinds_are_refused(cls):
    strategy = getattr(cl, cls)(parallel_devices=[torch.device("mps", 0)])
    with pytest.raises(ValueError, match=r"CPU or CUDA devices.*mps.*accelerator='gpu'"):
        strategy._check_devices()
    mixed = getattr(cl, cls)(parallel_devices=[torch.device("cpu"), torch.device("cuda", 0)])
    with pytest.raises(ValueError, match="one kind per job"):
        mixed._check_devices()


def test_mps_trainer_is_refused(clean_env):
    """Trainer(accelerator="mps", strategy="cring") on a Mac: a ValueError from
    the strategy when the Trainer is built (MPS availability patched)."""
    from lightning.fabric.accelerators import mps as fabric_mps
    from lightning.pytorch.accelerators import mps

    clean_env.setattr(mps.MPSAccelerator, "is_available", staticmethod(lambda: True))
    clean_env.setattr(fabric_mps.MPSAccelerator, "is_available", staticmethod(lambda: True))
    with pytest.raises(ValueError, match=r"CPU or CUDA devices.*mps"):
        _trainer(accelerator="mps", devices=1)


def test_tensors_of_other_kinds_are_refused_by_the_collectives():
    from cring.lightning import _common

    _common._check_device(torch.ones(1), "reduce")  # CPU: fine
    with pytest.raises(ValueError, match="CPU and CUDA tensors, got a tensor on meta"):
        _common._check_device(torch.empty(1, device="meta"), "reduce")


# ---- the GPU machine's check script is importable here ------------------------------------------


def _gpu_check():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent / "gpu" / "lightning_gpu_check.py"
    spec = importlib.util.spec_from_file_location("lightning_gpu_check", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_gpu_check_script_plans_and_judges(capsys):
    """tests/gpu/lightning_gpu_check.py imports without a GPU, plans its cases
    per GPU count, judges results, and refuses to run without a GPU."""
    check = _gpu_check()
    assert check.cases(0) == []
    one = {c.name: c for c in check.cases(1)}
    two = {c.name: c for c in check.cases(2)}
    assert "cring devices=1 32" in one and "cring devices=2 32" not in one
    assert one["cring devices=1 32"].reference == "ddp devices=1 32"
    assert one["cring devices=1 32"].atol == 1e-6
    assert any(c.env.get("CRING_GPU_OPERATIONS") == "host" for c in one.values())
    assert two["cring cringrun -np 2 devices=1 32"].reference == "ddp devices=2 32"
    for cases in (one, two):
        for case in cases.values():
            assert case.reference is None or case.reference in cases

    def result(params, devices=("cuda:0", "cuda:1"), losses=(1.0, 0.5)):
        return {
            "status": 0,
            "ranks": [
                {
                    "rank": r,
                    "root_device": d,
                    "param_device": d,
                    "current_device": int(d[5:]),
                    "params": params,
                    "losses": list(losses),
                }
                for r, d in enumerate(devices)
            ],
        }

    case = two["cring devices=2 32"]
    ddp = result({"w": [1.0, 2.0]})
    assert check.judge(case, result({"w": [1.0, 2.0 + 5e-7]}), ddp)[0]
    passed, why, diff = check.judge(case, result({"w": [1.0, 2.001]}), ddp)
    assert not passed and "differ" in why and diff == pytest.approx(1e-3)
    passed, why, _ = check.judge(case, result({"w": [1.0]}, devices=("cuda:0", "cuda:0")), ddp)
    assert not passed and "want cuda:1" in why
    passed, why, _ = check.judge(case, result({"w": [1.0]}, losses=(0.5, 1.0)), ddp)
    assert not passed and "loss" in why
    assert "PASS" in check.table(
        [
            {
                "case": case.name,
                "ranks": 2,
                "passed": True,
                "why": "ok",
                "max_diff": 0.0,
                "last_loss": 0.5,
                "seconds": 1.0,
            }
        ]
    )
    assert check.main([]) == 1  # the CPU build of torch: no GPU, nothing started
    assert "no CUDA device" in capsys.readouterr().out

"""cring.lightning: Trainer(strategy="cring") and Fabric(strategy="cring") on
real processes, against Trainer(strategy="ddp") over gloo with the same seed.

One worker script (tests/workers/lightning_fit.py) trains Lightning's
BoringModel (plus a small head) and records weights, logged metrics, the data
each rank saw, checkpoints, early stopping and the strategy's collectives. It
runs, all at once to save time on a small machine:
  * started as `python lightning_fit.py` (strategy "cring" starts rank 1), with
    validate/test/predict and an accumulate_grad_batches=2 fit;
  * the same with strategy="ddp" (gloo): the reference;
  * with devices=1 under cringrun, mpirun, torchrun, and as two "nodes"
    (num_nodes=2, NODE_RANK=0/1, started separately), and under cringrun with
    no strategy and no devices given (Trainer() picks cring by itself);
  * Fabric (tests/workers/lightning_fabric_train.py) against one-process training.
Every job has a hard timeout; the tests then read the JSON each rank wrote.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import free_port

pytest.importorskip("torch")
pytest.importorskip("lightning")

WORKERS = Path(__file__).parent / "workers"
FIT = str(WORKERS / "lightning_fit.py")
TIMEOUT_S = 360  # for all jobs together; they normally end within 1-2 minutes
MAX_EPOCHS = 4  # as in the worker
ATOL = 1e-6  # cring's and gloo's averages of 2 ranks differ at most in the last bit


def _jobs(out: Path) -> dict:
    """label -> list of commands (one per process this test starts) and extra env."""
    py = sys.executable
    jobs = {
        "spawn": ([[py, FIT, str(out), "spawn", "--full"]], {}),
        "ddp": ([[py, FIT, str(out), "ddp", "--strategy", "ddp", "--full"]], {}),
        "cringrun": (
            [[py, "-m", "cring.run", "-np", "2", py, FIT, str(out), "cringrun", "--devices", "1"]],
            {},
        ),
        # Trainer() with no strategy and no devices under cringrun: cring by itself
        "cringrun-auto": (
            [
                [py, "-m", "cring.run", "-np", "2", py, FIT, str(out), "cringrun-auto"]
                + ["--strategy", "auto", "--devices", "auto"]
            ],
            {},
        ),
        "fabric": ([[py, str(WORKERS / "lightning_fabric_train.py"), str(out)]], {}),
    }
    port = str(free_port())
    node = [py, FIT, str(out), "nodes", "--devices", "1", "--num-nodes", "2"]
    jobs["nodes"] = ([node, node], {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
    if shutil.which("mpirun"):
        jobs["mpirun"] = (
            [
                [
                    "mpirun",
                    "--allow-run-as-root",
                    "--oversubscribe",
                    "-np",
                    "2",
                    py,
                    FIT,
                    str(out),
                    "mpirun",
                    "--devices",
                    "1",
                ]
            ],
            {},
        )
    # torchrun as `python -m torch.distributed.run`: this Python's torch, never
    # another torchrun found first on PATH (whose Python may lack cring)
    jobs["torchrun"] = (
        [
            [
                py,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                "2",
                FIT,
                str(out),
                "torchrun",
                "--devices",
                "1",
            ]
        ],
        {},
    )
    return jobs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Start every job at once; wait for all with one deadline; kill what hangs."""
    out = tmp_path_factory.mktemp("lightning")
    base = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        CRING_TIMEOUT_SECONDS="120",
        PYTHONWARNINGS="ignore",
        PYTHONUNBUFFERED="1",
    )
    base.pop("MASTER_PORT", None)
    procs = []  # (label, Popen, log path)
    for label, (commands, extra) in _jobs(out).items():
        for i, cmd in enumerate(commands):
            env = dict(base, **extra)
            if len(commands) > 1:
                env["NODE_RANK"] = str(i)
            log = out / f"{label}.{i}.log"
            with open(log, "w") as f:
                procs.append(
                    (
                        label,
                        subprocess.Popen(
                            cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
                        ),
                        log,
                    )
                )
    deadline = time.monotonic() + TIMEOUT_S
    hung = set()
    for label, proc, _ in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            hung.add(label)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    results = {}
    for label, proc, log in procs:
        status = "hung" if label in hung else proc.returncode
        entry = results.setdefault(label, {"status": [], "log": ""})
        entry["status"].append(status)
        entry["log"] += log.read_text()[-6000:]
    for label, entry in results.items():
        entry["ranks"] = []
        for r in range(2):
            path = out / f"{label}.rank{r}.json"
            entry["ranks"].append(json.loads(path.read_text()) if path.exists() else None)
    results["_out"] = out
    return results


def job(runs, label):
    """Both ranks' results of one job, after checking it ran cleanly."""
    if label not in runs:
        pytest.skip(f"{label} is not installed")
    entry = runs[label]
    assert entry["status"] == [0] * len(entry["status"]), entry["log"]
    assert all(r is not None for r in entry["ranks"]), entry["log"]
    return entry["ranks"]


def close(a, b, atol=ATOL):
    """Largest difference between two {name: list} weight dicts is within atol."""
    assert a.keys() == b.keys()
    worst = max(max(abs(x - y) for x, y in zip(a[k], b[k])) for k in a)
    return worst <= atol


# ---- python script.py: the strategy starts the second process ---------------------------------


def test_fit_started_as_a_script_matches_ddp(runs):
    ranks, ddp = job(runs, "spawn"), job(runs, "ddp")
    assert ranks[0]["fit"]["world_size"] == 2
    # identical on every rank, and equal to DDP with the same seed
    assert ranks[0]["fit"]["weights"] == ranks[1]["fit"]["weights"]
    assert close(ranks[0]["fit"]["weights"], ddp[0]["fit"]["weights"])
    # training moved the weights (the comparison means something)
    assert not close(ranks[0]["fit"]["weights"], ranks[0]["accumulate"]["weights"], atol=1e-3)


def test_gradient_clipping_is_applied_to_the_averaged_gradient(runs):
    """The fit clips at 0.05 while the gradients were larger: had clipping come
    before averaging, the weights would not match DDP's (checked above)."""
    fit = job(runs, "spawn")[0]["fit"]
    assert fit["gradient_clip_val"] == 0.05
    assert fit["max_grad_norm"] > 0.05
    assert fit["max_grad_norm"] == job(runs, "ddp")[0]["fit"]["max_grad_norm"]


def test_gradients_are_averaged_while_backward_runs(runs):
    """When backward reaches the first layer, the head's gradients are already
    being averaged (started by hooks, not after backward)."""
    for r in job(runs, "spawn"):
        assert r["fit"]["max_in_flight"] >= 2


def test_sync_dist_logging_is_the_mean_over_ranks(runs):
    ranks, ddp = job(runs, "spawn"), job(runs, "ddp")
    for r, d in zip(ranks, ddp):
        m = r["fit"]["metrics"]
        assert m["rank_mean"] == 0.5  # ranks log 0 and 1
        assert m["rank_max"] == 1.0  # reduce_fx="max"
        for key in ("train_loss", "val_loss", "rank_mean", "rank_max"):
            assert m[key] == pytest.approx(d["fit"]["metrics"][key], abs=1e-6), key
    assert ranks[0]["fit"]["metrics"]["train_loss"] == ranks[1]["fit"]["metrics"]["train_loss"]


def test_each_rank_sees_its_own_half_of_the_data(runs):
    ranks, ddp = job(runs, "spawn"), job(runs, "ddp")
    dataset = sorted(ranks[0]["fit"]["dataset"])
    assert len(dataset) == 64 and ranks[1]["fit"]["dataset"] == ranks[0]["fit"]["dataset"]
    for epoch, seen0 in ranks[0]["fit"]["seen"].items():
        seen1 = ranks[1]["fit"]["seen"][epoch]
        assert len(seen0) == len(seen1) == 32
        assert not set(seen0) & set(seen1)
        assert sorted(seen0 + seen1) == dataset
    for r, d in zip(ranks, ddp):  # the same shards, in the same order, as DDP
        assert r["fit"]["seen"] == d["fit"]["seen"]


def test_model_checkpoint_is_written_once_by_rank_zero(runs):
    ranks = job(runs, "spawn")
    out = runs["_out"]
    files = list((out / "ckpt-spawn").iterdir())
    assert [f.name for f in files] == ["model.ckpt"]
    writers = list(out.glob("spawn.saves.*.txt"))
    assert len(writers) == 1  # one process saved
    lines = writers[0].read_text().split("\n")
    assert [line.split()[0] for line in lines if line] == ["0"] * (len(lines) - 1)
    assert ranks[0]["fit"]["checkpoint_path"] == ranks[1]["fit"]["checkpoint_path"]
    # the checkpoint holds the final weights
    assert ranks[0]["fit"]["checkpoint_weights"] == ranks[0]["fit"]["weights"]


def test_early_stopping_stops_every_rank_at_the_same_epoch(runs):
    """Only rank 1's signal stagnates; the decision is shared, so rank 0 (whose
    own signal kept improving) stops in the same epoch, as with DDP."""
    ranks, ddp = job(runs, "spawn"), job(runs, "ddp")
    epochs = [r["fit"]["current_epoch"] for r in ranks]
    assert epochs[0] == epochs[1] == ddp[0]["fit"]["current_epoch"] < MAX_EPOCHS
    assert ranks[0]["fit"]["stopped_epoch"] == ranks[1]["fit"]["stopped_epoch"] == 1


def test_accumulate_grad_batches_matches_ddp_without_communicating_in_between(runs):
    ranks, ddp = job(runs, "spawn"), job(runs, "ddp")
    acc = [r["accumulate"] for r in ranks]
    assert acc[0]["weights"] == acc[1]["weights"]
    assert close(acc[0]["weights"], ddp[0]["accumulate"]["weights"])
    for a in acc:
        counts = a["tensor_counts"]  # tensors cring reduced during each training batch
        assert len(counts) == 32
        assert counts[0::2] == [0] * 16  # accumulating batches: no communication
        assert counts[1::2] == [a["params"]] * 16  # one average per parameter


def test_strategy_collectives_match_ddp(runs):
    ranks, ddp = job(runs, "spawn"), job(runs, "ddp")
    for r, d in zip(ranks, ddp):
        assert r["fit"]["collectives"] == d["fit"]["collectives"]
    c = ranks[1]["fit"]["collectives"]
    assert c["reduce_sum"] == [3.0, 6.0] and c["reduce_mean"] == [1.5, 3.0]
    assert c["reduce_max"] == [2.0, 4.0] and c["reduce_min"] == [1.0, 2.0]
    assert c["reduce_int_mean"] == [2]  # (2 + 3) / 2, rounded toward zero as DDP does
    assert c["all_gather"] == [[0, 10], [1, 11]]
    assert c["all_gather_grad"] == [6.0, 8.0]  # d/dx of sum(w * gathered) summed over ranks
    assert c["broadcast"] == {"from": 1, "text": "rank 1"}
    assert c["all_true"] is False and c["any_true"] is True


def test_validate_test_predict(runs):
    ranks, ddp = job(runs, "spawn"), job(runs, "ddp")
    for r, d in zip(ranks, ddp):
        assert r["validate"]["rank_mean"] == 0.5
        assert r["validate"]["val_loss"] == pytest.approx(d["validate"]["val_loss"], abs=1e-6)
        assert r["test"] == {"test_rank_mean": 0.5}
        assert r["predict"] == {"count": 32}  # each rank predicts its half of 64 samples


def test_cring_stays_initialised_after_each_run_and_collectives_work(runs):
    """As Horovod's strategy left hvd, and DDP its process group: after fit,
    validate, test and predict cring is still up (hvd.size() is 2), and the
    strategy's all_gather, reduce and broadcast still communicate, as DDP's."""
    ranks, ddp = job(runs, "spawn"), job(runs, "ddp")
    for r, d in zip(ranks, ddp):
        assert r["fit"]["cring_initialized_after"] is True
        assert r["validate_cring_after"] is True and r["predict_cring_after"] is True
        after = r["after_run"]
        assert after["all_gather"] == [[0, 32], [1, 32]]  # every rank's predictions counted
        assert after["reduce_sum"] == 2.0 and after["broadcast"] == "rank 1"
        assert after["hvd_size"] == 2
        assert {k: v for k, v in after.items() if k != "hvd_size"} == d["after_run"]


# ---- one rank per process: external launchers, and num_nodes > 1 --------------------------------


@pytest.mark.parametrize("label", ["cringrun", "mpirun", "torchrun", "nodes", "cringrun-auto"])
def test_devices_1_under_an_external_launcher_matches_ddp(runs, label):
    ranks, ddp = job(runs, label), job(runs, "ddp")
    for r, d in zip(ranks, ddp):
        fit = r["fit"]
        assert fit["strategy"] == "CRingStrategy"
        assert fit["world_size"] == 2
        assert fit["weights"] == ranks[0]["fit"]["weights"]
        assert close(fit["weights"], d["fit"]["weights"])
        assert fit["metrics"]["rank_mean"] == 0.5
        assert fit["seen"] == d["fit"]["seen"]
        assert fit["current_epoch"] == d["fit"]["current_epoch"]
        assert fit["cring_initialized_after"] is True
    writers = list(runs["_out"].glob(f"{label}.saves.*.txt"))
    assert len(writers) == 1 and writers[0].read_text().startswith("0 ")


# ---- Fabric ------------------------------------------------------------------------------------


def test_fabric_matches_one_process_training(runs):
    ranks = job(runs, "fabric")
    for r in ranks:
        assert r["start_equal"]  # rank 1's perturbed weights were replaced by rank 0's
        assert r["max_error"] < 1e-12 and r["moved"] > 1e-2
        assert r["clipped_steps"] > 0
        assert r["params"] == ranks[0]["params"]
        # no_backward_sync: nothing reduced on accumulating steps, 4 parameters on the others
        assert r["tensor_counts"] == [0, 4] * 6
        assert r["all_reduce_sum"] == [3.0] and r["all_reduce_mean"] == [1.5]
        assert r["all_gather"] == [[0, 0], [1, 1]] and r["broadcast"] == "from 1"


# ---- in this process: registration, errors, one rank --------------------------------------------


def test_registration_and_import_costs():
    """import cring imports no Lightning; import cring.lightning imports none
    either, and registers "cring" with each distribution when it is imported."""
    code = (
        "import sys, cring\n"
        "assert not any(m.split('.')[0] in ('lightning', 'pytorch_lightning', 'torch') "
        "for m in sys.modules), 'import cring imported a framework'\n"
        "import cring.lightning, importlib.util\n"
        "assert 'lightning' not in sys.modules and 'pytorch_lightning' not in sys.modules\n"
        "importlib.util.find_spec('pytorch_lightning')  # a look-up, not an import\n"
        "import lightning.pytorch as L, lightning.fabric as F\n"
        "assert 'cring' in L.strategies.StrategyRegistry\n"
        "assert 'cring' in F.strategies.STRATEGY_REGISTRY\n"
        "s = L.strategies.StrategyRegistry.get('cring')\n"
        "assert isinstance(s, L.strategies.ParallelStrategy), type(s).__mro__\n"
        "assert cring.lightning.CRingStrategy is type(s)\n"
        "try:\n"
        "    import pytorch_lightning as PL\n"
        "except ImportError:\n"
        "    print('no pytorch_lightning')\n"
        "else:\n"
        "    s = PL.strategies.StrategyRegistry.get('cring')\n"
        "    assert isinstance(s, PL.strategies.ParallelStrategy)\n"
        "    assert cring.lightning.classes('pytorch_lightning').CRingStrategy is type(s)\n"
        "print('ok')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=180
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith("ok")


@pytest.fixture
def pl():
    import lightning.pytorch

    import cring.lightning  # noqa: F401  (registers strategy "cring")

    return lightning.pytorch


def test_devices_must_match_an_external_launcher(pl, monkeypatch):
    monkeypatch.setenv("CRING_RANK", "0")
    monkeypatch.setenv("CRING_SIZE", "2")
    monkeypatch.setenv("CRING_LOCAL_SIZE", "2")
    with pytest.raises(ValueError, match=r"devices=3.*cring.*devices=1"):
        pl.Trainer(strategy="cring", accelerator="cpu", devices=3)
    trainer = pl.Trainer(strategy="cring", accelerator="cpu", devices=1, logger=False)
    assert (trainer.global_rank, trainer.world_size) == (0, 2)
    assert trainer.strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0}
    assert "cring" in repr(trainer.strategy.cluster_environment)


def test_no_strategy_in_a_job_cring_started_is_cring(pl, monkeypatch):
    """Trainer() and Fabric() with no strategy ("auto"): cring in a job of 2+
    ranks that cringrun/cring.ray started (as Lightning 1.x chose Horovod under
    horovodrun, and Lightning 2 chooses DDP under torchrun); Lightning's own
    choice otherwise, and an explicit strategy is always the user's."""
    import lightning.fabric as lf

    def name(obj):
        return type(obj.strategy).__name__

    for variable in ("CRING_RANK", "CRING_SIZE", "CRING_LOCAL_SIZE"):
        monkeypatch.delenv(variable, raising=False)
    assert name(pl.Trainer(accelerator="cpu", logger=False)) == "SingleDeviceStrategy"
    monkeypatch.setenv("CRING_RANK", "1")
    monkeypatch.setenv("CRING_SIZE", "2")
    monkeypatch.setenv("CRING_LOCAL_SIZE", "2")
    trainer = pl.Trainer(accelerator="cpu", logger=False)
    assert name(trainer) == "CRingStrategy"
    assert (trainer.global_rank, trainer.world_size) == (1, 2)
    assert name(pl.Trainer(strategy="auto", accelerator="cpu", devices=2)) == "CRingStrategy"
    assert name(lf.Fabric(accelerator="cpu")) == "CRingFabricStrategy"
    assert name(pl.Trainer(strategy="ddp", accelerator="cpu", logger=False)) == "DDPStrategy"
    with pytest.raises(ValueError, match=r"devices=3.*cring"):
        pl.Trainer(accelerator="cpu", devices=3)
    monkeypatch.setenv("CRING_SIZE", "1")  # a job of one rank: nothing to average
    monkeypatch.setenv("CRING_RANK", "0")
    monkeypatch.setenv("CRING_LOCAL_SIZE", "1")
    assert name(pl.Trainer(accelerator="cpu", logger=False)) == "SingleDeviceStrategy"


def test_unsupported_settings_raise(pl):
    import torch

    import cring.lightning as cl

    # sync_batchnorm=True is supported (cring.torch.SyncBatchNorm): test_sync_batchnorm.py
    trainer = pl.Trainer(strategy="cring", accelerator="cpu", devices=2, sync_batchnorm=True)
    assert type(trainer.strategy._layer_sync).__name__ == "CRingSyncBatchNorm"
    strategy = cl.CRingStrategy()
    with pytest.raises(ValueError, match="reduce_op='median'"):
        strategy.reduce(torch.ones(2), reduce_op="median")
    with pytest.raises(ValueError, match="process groups"):
        strategy.reduce(torch.ones(2), group=object())
    with pytest.raises(ValueError, match="timeout_s"):
        cl.CRingStrategy(timeout_s=0)


def test_one_process_fit_and_a_user_initialised_cring(pl, monkeypatch):
    """devices=1 with no launcher is a job of one rank. cring stays initialised
    after a run (the next run joins the same job); a failed run shuts down the
    job the strategy started; a job the user initialised is always left alone."""
    import torch
    from lightning.pytorch.demos.boring_classes import BoringModel

    import cring
    from cring import _api

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # or Lightning sets it (and torch's threads)

    class Failing(BoringModel):
        def training_step(self, batch, batch_idx):
            raise RuntimeError("step failed")

    def fit(model_class=BoringModel):
        model = model_class()
        before = model.layer.weight.detach().clone()
        trainer = pl.Trainer(
            strategy="cring",
            accelerator="cpu",
            devices=1,
            max_steps=3,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(model)
        assert not torch.equal(before, model.layer.weight)
        assert trainer.world_size == 1
        return trainer

    if cring.is_initialized():
        cring.shutdown()
    try:
        trainer = fit()
        assert cring.is_initialized() and cring.size() == 1  # kept, as Horovod's strategy did
        generation = _api._generation
        assert trainer.strategy.reduce(torch.tensor(2.0), reduce_op="sum") == 2.0
        fit()
        assert _api._generation == generation, "the second run joined the same job"
        with pytest.raises(RuntimeError, match="step failed"):
            fit(Failing)
        assert not cring.is_initialized(), "a failed run shuts down the job it started"
        cring.init()
        fit()
        with pytest.raises(RuntimeError, match="step failed"):
            fit(Failing)
        assert cring.is_initialized()  # the user's, left alone
    finally:
        if cring.is_initialized():
            cring.shutdown()

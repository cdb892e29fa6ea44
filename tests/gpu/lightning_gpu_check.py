"""Lightning on real GPUs: Trainer(strategy="cring", accelerator="gpu") against
strategy="ddp" (NCCL), for a machine with NVIDIA GPUs and a CUDA build of torch.

    pip install torch==2.13.0 lightning==2.6.6 && pip install -e .
    python tests/gpu/lightning_gpu_check.py [--out lightning_gpu.json] [--timeout-s 600]

It cannot run on a CPU-only machine (CI's unit tests of the same device
handling, with torch's CUDA queries patched, are tests/test_lightning_cuda.py).
Importing it runs nothing and needs neither torch nor Lightning, so
tests/gpu/run_gpu_checks.py (or CPU tests) may import it and call main().

Each case fits the same small model on the same data (a few epochs,
gradient clipping, accumulate_grad_batches=2, a sync_dist-logged loss) in a
fresh `python lightning_gpu_check.py --fit ...` process, which Lightning
re-executes once per extra device as usual; every rank writes its final
weights. Cases:

  * devices=1, and devices=2 when there are 2+ GPUs: strategy "cring" and
    "ddp" with precision "32" (TF32 off, deterministic): the final weights
    must agree to 1e-6 (issue 16's acceptance), every rank on cuda:<local rank>;
  * "bf16-mixed" and "16-mixed" (GradScaler: cring averages the scaled
    gradients before Lightning unscales them) against DDP with the same
    precision: agreement to 1e-3, a finite loss that went down;
  * with 2+ GPUs: `cringrun -np 2` with devices=1 (one rank per process,
    each on cuda:<local rank>) against DDP's devices=2;
  * with one GPU: `cringrun -np 2` with CRING_GPU_OPERATIONS=host (two ranks
    sharing cuda:0 through host staging): ranks equal, loss went down;
  * Fabric(strategy="cring", accelerator="gpu"): ranks equal, loss went down.

It prints a table (one row per case, PASS/FAIL), writes the details to --out
and exits 0 when every case passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

FP32_ATOL = 1e-6  # issue 16: the fp32 fit's weights equal DDP's to 1e-6
MIXED_ATOL = 1e-3  # mixed precision: same kernels, gradient sums rounded differently
EPOCHS = 3
SEED = 1234


@dataclass
class Case:
    """One fit: how it is started and what it is compared with."""

    name: str
    strategy: str  # "cring" or "ddp"
    devices: int  # Trainer(devices=...)
    precision: str
    ranks: int  # processes in all
    launcher: str = "lightning"  # "lightning" (the strategy starts them), "cringrun", "fabric"
    env: dict = field(default_factory=dict)
    reference: Optional[str] = None  # the case whose weights these must equal
    atol: float = FP32_ATOL


def cases(gpus: int) -> list[Case]:
    """What to run on a machine with `gpus` GPUs (none when there is no GPU)."""
    if gpus < 1:
        return []
    out: list[Case] = []
    counts = [1, 2] if gpus >= 2 else [1]
    for n in counts:
        for precision, atol in (
            ("32", FP32_ATOL),
            ("bf16-mixed", MIXED_ATOL),
            ("16-mixed", MIXED_ATOL),
        ):
            ddp = f"ddp devices={n} {precision}"
            out.append(Case(ddp, "ddp", n, precision, n))
            out.append(
                Case(
                    f"cring devices={n} {precision}",
                    "cring",
                    n,
                    precision,
                    n,
                    reference=ddp,
                    atol=atol,
                )
            )
    if gpus >= 2:
        out.append(
            Case(
                "cring cringrun -np 2 devices=1 32",
                "cring",
                1,
                "32",
                2,
                launcher="cringrun",
                reference="ddp devices=2 32",
            )
        )
    else:
        out.append(
            Case(
                "cring cringrun -np 2 on one GPU (host staging) 32",
                "cring",
                1,
                "32",
                2,
                launcher="cringrun",
                env={"CRING_GPU_OPERATIONS": "host"},
            )
        )
    out.append(
        Case(
            f"fabric cring devices={counts[-1]} 32", "cring", counts[-1], "32", counts[-1], "fabric"
        )
    )
    return out


# ---- inside one rank -----------------------------------------------------------------------------


def _deterministic_torch() -> Any:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    return torch


def _data(torch: Any) -> Any:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(512, 32, generator=g)
    w = torch.randn(32, 1, generator=g)
    y = torch.tanh(x @ w) + 0.05 * torch.randn(512, 1, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def _network(torch: Any, seed: int = SEED) -> Any:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64),
        torch.nn.GELU(),
        torch.nn.Linear(64, 64),
        torch.nn.GELU(),
        torch.nn.Linear(64, 1),
    )


def _weights(module: Any) -> dict:
    return {k: v.detach().double().cpu().flatten().tolist() for k, v in module.state_dict().items()}


def _write_rank(out: str, rank: int, record: dict) -> None:
    path = Path(f"{out}.rank{rank}.json")
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def fit_trainer(strategy: str, devices: int, precision: str, out: str) -> None:
    """One rank of a Trainer fit (Lightning re-runs this script for the other ranks)."""
    torch = _deterministic_torch()
    import lightning.pytorch as pl

    import cring.lightning  # noqa: F401  (registers "cring")

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _network(torch)
            self.losses: list = []

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x).float(), y)
            self.log("train_loss", loss, sync_dist=True, on_step=False, on_epoch=True)
            return loss

        def on_train_epoch_end(self) -> None:
            self.losses.append(float(self.trainer.callback_metrics["train_loss"]))
            # Read here, not after fit(): Lightning's teardown moves the module
            # back to the CPU when fit() returns (DDP's and cring's alike).
            self.param_device = str(next(self.net.parameters()).device)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

        def train_dataloader(self) -> Any:
            # The same shards in the same order for every strategy and world size:
            # Lightning's own sampler shuffles, and only when the strategy is
            # distributed (DDP always, cring from 2 ranks on).
            data = _data(torch)
            sampler = torch.utils.data.DistributedSampler(
                data, num_replicas=self.trainer.world_size, rank=self.global_rank, shuffle=False
            )
            return torch.utils.data.DataLoader(data, batch_size=32, sampler=sampler)

    pl.seed_everything(SEED, workers=True)
    model = Model()
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="gpu",
        devices=devices,
        precision=precision,
        max_epochs=EPOCHS,
        gradient_clip_val=1.0,
        accumulate_grad_batches=2,
        deterministic=True,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tempfile.gettempdir(),
    )
    trainer.fit(model)
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    _write_rank(
        out,
        trainer.global_rank,
        {
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "root_device": str(trainer.strategy.root_device),
            "current_device": torch.cuda.current_device(),
            "param_device": model.param_device,
            "params": _weights(model.net),
            "losses": model.losses,
            "scaler_scale": float(scaler.get_scale()) if scaler is not None else None,
        },
    )


def fit_fabric(devices: int, precision: str, out: str) -> None:
    """One rank of a Fabric loop with strategy "cring"."""
    torch = _deterministic_torch()
    import lightning.fabric as lf

    import cring.lightning  # noqa: F401

    fabric = lf.Fabric(strategy="cring", accelerator="gpu", devices=devices, precision=precision)
    fabric.launch()
    net = _network(torch, seed=SEED + fabric.global_rank)  # different starts: setup() broadcasts
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net, optimizer = fabric.setup(net, optimizer)
    sampler = torch.utils.data.DistributedSampler(
        _data(torch), num_replicas=fabric.world_size, rank=fabric.global_rank, shuffle=False
    )
    loader = fabric.setup_dataloaders(
        torch.utils.data.DataLoader(_data(torch), batch_size=32, sampler=sampler),
        use_distributed_sampler=False,
    )
    losses = []
    for _ in range(EPOCHS):
        total = torch.zeros((), device=fabric.device)
        for x, y in loader:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(net(x).float(), y)
            fabric.backward(loss)
            fabric.clip_gradients(net, optimizer, max_norm=1.0)
            optimizer.step()
            total += loss.detach()
        losses.append(float(fabric.all_reduce(total / len(loader), reduce_op="mean")))
    _write_rank(
        out,
        fabric.global_rank,
        {
            "rank": fabric.global_rank,
            "world_size": fabric.world_size,
            "root_device": str(fabric.device),
            "current_device": torch.cuda.current_device(),
            "param_device": str(next(net.parameters()).device),
            "params": _weights(net),
            "losses": losses,
            "scaler_scale": None,
        },
    )
    fabric.strategy.teardown()


# ---- the driver ----------------------------------------------------------------------------------


def _command(case: Case, out: str) -> list:
    here = os.path.abspath(__file__)
    if case.launcher == "fabric":
        script = [sys.executable, here, "--fabric", str(case.devices), case.precision, out]
    else:
        script = [
            sys.executable,
            here,
            "--fit",
            case.strategy,
            str(case.devices),
            case.precision,
            out,
        ]
    if case.launcher == "cringrun":
        return [sys.executable, "-m", "cring.run", "-np", str(case.ranks), *script]
    return script


def run_case(case: Case, workdir: Path, timeout_s: float) -> dict:
    """Start one case (its own process group), wait at most timeout_s, read every rank's record."""
    out = str(workdir / case.name.replace(" ", "_").replace("=", ""))
    env = dict(os.environ, CRING_TIMEOUT_SECONDS="120", PYTHONUNBUFFERED="1", **case.env)
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_PORT"):
        env.pop(name, None)  # a launch of its own, whatever started this script
    for name in [n for n in env if n.startswith("CRING_RANK") or n.startswith("CRING_SIZE")]:
        env.pop(name)
    started = time.monotonic()
    log = Path(out + ".log")
    with open(log, "w") as f:
        proc = subprocess.Popen(
            _command(case, out), env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            status: Any = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            status = "timed out"
    ranks = []
    for r in range(case.ranks):
        path = Path(f"{out}.rank{r}.json")
        ranks.append(json.loads(path.read_text()) if path.exists() else None)
    return {
        "status": status,
        "seconds": round(time.monotonic() - started, 1),
        "ranks": ranks,
        "log_tail": log.read_text()[-3000:],
    }


def _max_diff(a: dict, b: dict) -> float:
    if a.keys() != b.keys():
        return math.inf
    worst = 0.0
    for key in a:
        if len(a[key]) != len(b[key]):
            return math.inf
        for x, y in zip(a[key], b[key]):
            worst = max(worst, abs(x - y))
    return worst


def judge(case: Case, result: dict, reference: Optional[dict]) -> tuple[bool, str, Optional[float]]:
    """(passed, why, largest weight difference to the reference) for one finished case."""
    if result["status"] != 0:
        return False, f"exited {result['status']}", None
    ranks = result["ranks"]
    if any(r is None for r in ranks):
        return False, "a rank wrote no result", None
    local_ranks = range(case.devices) if case.launcher != "cringrun" else range(case.ranks)
    gpus_shared = bool(case.env.get("CRING_GPU_OPERATIONS") == "host")
    for r, local in zip(ranks, local_ranks):
        want = "cuda:0" if gpus_shared else f"cuda:{local}"
        got = (r["root_device"], r["param_device"], f"cuda:{r['current_device']}")
        if got != (want, want, want):
            return (
                False,
                f"rank {r['rank']} on {got} (root, parameters, current), want {want}",
                None,
            )
    for r in ranks[1:]:
        if _max_diff(r["params"], ranks[0]["params"]) > 0:
            return False, "ranks ended with different weights", None
    losses = ranks[0]["losses"]
    if not losses or not all(math.isfinite(v) for v in losses) or not losses[-1] < losses[0]:
        return False, f"loss did not go down: {losses}", None
    if case.reference is None:
        return True, "ranks equal, loss went down", None
    if reference is None or reference["status"] != 0 or not reference["ranks"][0]:
        return False, f"reference {case.reference!r} failed", None
    diff = _max_diff(ranks[0]["params"], reference["ranks"][0]["params"])
    if diff > case.atol:
        return False, f"weights differ from {case.reference!r} by {diff:.3g} > {case.atol:g}", diff
    # the sync_dist-logged epoch losses (cring's reduce on CUDA tensors)
    loss_diff = _max_diff({"loss": losses}, {"loss": reference["ranks"][0]["losses"]})
    if loss_diff > 10 * case.atol:
        return False, f"logged losses differ from {case.reference!r} by {loss_diff:.3g}", diff
    return True, f"weights within {case.atol:g} of {case.reference!r}", diff


def table(rows: list[dict]) -> str:
    head = f"{'case':<52} {'ranks':>5} {'max|w-ref|':>11} {'last loss':>10} {'s':>6}  result"
    lines = [head, "-" * len(head)]
    for row in rows:
        diff = "-" if row["max_diff"] is None else f"{row['max_diff']:.2e}"
        loss = "-" if row["last_loss"] is None else f"{row['last_loss']:.5f}"
        lines.append(
            f"{row['case']:<52} {row['ranks']:>5} {diff:>11} {loss:>10} {row['seconds']:>6}  "
            f"{'PASS' if row['passed'] else 'FAIL'} {row['why']}"
        )
    return "\n".join(lines)


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="lightning_gpu.json")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per case")
    parser.add_argument("--fit", nargs=4, metavar=("STRATEGY", "DEVICES", "PRECISION", "OUT"))
    parser.add_argument("--fabric", nargs=3, metavar=("DEVICES", "PRECISION", "OUT"))
    args = parser.parse_args(argv)
    if args.fit:
        strategy, devices, precision, out = args.fit
        fit_trainer(strategy, int(devices), precision, out)
        return 0
    if args.fabric:
        devices, precision, out = args.fabric
        fit_fabric(int(devices), precision, out)
        return 0

    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    todo = cases(gpus)
    if not todo:
        print("FAIL no CUDA device: lightning_gpu_check.py needs a GPU and a CUDA build of torch")
        return 1
    print(f"{gpus} GPU(s): {torch.cuda.get_device_name(0)}; torch {torch.__version__}", flush=True)
    results: dict = {}
    rows = []
    with tempfile.TemporaryDirectory(prefix="cring-lightning-gpu-") as tmp:
        for case in todo:
            result = results[case.name] = run_case(case, Path(tmp), args.timeout_s)
            passed, why, diff = judge(case, result, results.get(case.reference or ""))
            first = result["ranks"][0] if result["ranks"] else None
            rows.append(
                {
                    "case": case.name,
                    "ranks": case.ranks,
                    "passed": passed,
                    "why": why,
                    "max_diff": diff,
                    "last_loss": first["losses"][-1] if first and first["losses"] else None,
                    "seconds": result["seconds"],
                    "config": asdict(case),
                }
            )
            print(f"{'PASS' if passed else 'FAIL'} lightning {case.name}: {why}", flush=True)
            if not passed:
                print(result["log_tail"], flush=True)
    print(table(rows))
    Path(args.out).write_text(json.dumps({"gpus": gpus, "rows": rows}, indent=1))
    return 0 if all(row["passed"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

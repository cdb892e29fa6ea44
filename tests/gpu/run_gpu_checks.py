"""cring's GPU checks for a machine with at least one NVIDIA GPU and a CUDA
build of torch (not part of the CPU test suite; CPU CI covers the same code
against test doubles in tests/test_gpu_loader.py).

    pip install torch==2.13.0 && pip install -e .
    python tests/gpu/run_gpu_checks.py --out gpu_checks.json

What it checks, printing one PASS/FAIL line each and exiting 1 on any FAIL:
  1. the libraries: nccl_available(), cuda_available(), versions and paths;
  2. the NCCL path at world size 1 on cuda:0, in this process: every
     collective and dtype, in place and out of place, grouped calls (one NCCL
     group), scaling factors, fp16 compression; results ordered after the
     producer's work on a side stream (the stream is delayed with
     torch.cuda._sleep, so a call on the wrong stream reads stale data); calls
     return without waiting for the device; cring.torch's DistributedOptimizer
     trains a small model on CUDA through NCCL; (issue 16) cring.allreduce_
     and allreduce_async_ of a torch CUDA tensor reach the queue with no
     Python frame; 100 small tensors submitted asynchronously take at most 2
     NCCL calls; synchronize() does not block the host, block_host=True does;
     a Lightning fit with accelerator="gpu", devices=1 (when lightning imports);
     (issue 26) the sweep of tests/gpu/sweep.py: every dtype x collective
     (alltoall included) x shape, in and out of place, with scale factors,
     and a one-rank process set, byte for byte against the CPU path;
  3. the host-staged path (CRING_GPU_OPERATIONS=host) with 2 processes on the
     same GPU: every collective's values, and DistributedOptimizer training to
     identical parameters on both ranks;
  4. with 2+ GPUs: the NCCL path with 2 processes, one GPU each, the same
     checks as 3; with one GPU, what NCCL says to 2 ranks on one GPU (reported,
     not judged).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

RESULTS: list = []


def check(name: str, fn: Callable[[], Any]) -> Any:
    t0 = time.perf_counter()
    try:
        detail = fn()
        RESULTS.append(
            {"check": name, "ok": True, "seconds": time.perf_counter() - t0, "detail": detail}
        )
        print(f"PASS {name}" + (f": {detail}" if detail not in (None, "") else ""), flush=True)
        return detail
    except Exception as error:  # noqa: BLE001  (a failed check is reported, then the next runs)
        RESULTS.append(
            {
                "check": name,
                "ok": False,
                "seconds": time.perf_counter() - t0,
                "detail": f"{type(error).__name__}: {error}",
                "traceback": traceback.format_exc(),
            }
        )
        print(f"FAIL {name}: {type(error).__name__}: {error}", flush=True)
        return None


def expect(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(what)


# ---- shared collective checks (any world size) --------------------------------------------------


def collectives(torch: Any, cring: Any, dev: Any, tag: str) -> None:
    r, p = cring.rank(), cring.size()
    dtypes = [
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int32,
        torch.int64,
        torch.int8,
        torch.uint8,
    ]

    def allreduce_dtypes() -> str:
        for dt in dtypes:
            x = (torch.arange(1000, device=dev) % 7 + r).to(dt)
            ref = sum((torch.arange(1000, device=dev) % 7 + q).to(torch.float64) for q in range(p))
            y = cring.allreduce(x, op=cring.Sum, name=f"{tag}.sum.{dt}")
            expect(y.device == dev and y.dtype == dt, f"{dt}: output on {y.device}/{y.dtype}")
            if dt in (torch.int8, torch.uint8):
                ref = ref.to(torch.int64).to(dt)
            expect(
                torch.allclose(y.double(), ref.to(dt).double(), rtol=1e-2, atol=1e-2),
                f"{dt} sum wrong",
            )
            for op in (cring.Min, cring.Max):
                z = cring.allreduce(x, op=op, name=f"{tag}.{op.name}.{dt}")
                want = (
                    (torch.arange(1000, device=dev) % 7).to(dt)
                    if op == cring.Min
                    else (torch.arange(1000, device=dev) % 7 + p - 1).to(dt)
                )
                expect(torch.equal(z, want), f"{dt} {op.name} wrong")
        avg = cring.allreduce(torch.full((5,), 10.0 * (r + 1), device=dev), name=f"{tag}.avg")
        expect(torch.allclose(avg, torch.full((5,), 10.0 * (p + 1) / 2, device=dev)), "average")
        iavg = cring.allreduce(
            torch.tensor([-7 * (r + 1), 5], device=dev, dtype=torch.int32), name=f"{tag}.iavg"
        )
        s = sum(q + 1 for q in range(p))
        expect(iavg.tolist() == [int(-7 * s / p), int(5 * p / p)], f"int average {iavg}")
        return f"{len(dtypes)} dtypes"

    def in_place_and_grouped() -> str:
        x = torch.full((3, 4), float(r), device=dev)
        ptr = x.data_ptr()
        out = cring.allreduce_(x, op=cring.Sum, name=f"{tag}.inplace")
        expect(out is x and x.data_ptr() == ptr, "in place moved the tensor")
        expect(torch.all(x == sum(range(p))).item(), "in-place sum")
        group = [
            torch.zeros(0, device=dev),
            torch.ones(1, device=dev) * (r + 1),
            torch.arange(100_001, device=dev, dtype=torch.float32),
        ]
        cring.grouped_allreduce_(group, op=cring.Sum, name=f"{tag}.group")
        s = sum(q + 1 for q in range(p))
        expect(group[1].item() == s, "group[1]")
        expect(
            torch.equal(group[2], torch.arange(100_001, device=dev, dtype=torch.float32) * p),
            "group[2]",
        )
        scaled = cring.allreduce(
            torch.ones(7, device=dev),
            op=cring.Sum,
            prescale_factor=0.5,
            postscale_factor=4.0,
            name=f"{tag}.scaled",
        )
        expect(torch.allclose(scaled, torch.full((7,), 2.0 * p, device=dev)), "scaling")
        comp = cring.allreduce(
            torch.full((9,), 1.5, device=dev),
            op=cring.Sum,
            compression=cring.Compression.fp16,
            name=f"{tag}.fp16",
        )
        expect(
            comp.dtype == torch.float32 and torch.allclose(comp, torch.full_like(comp, 1.5 * p)),
            "fp16 compression",
        )
        h = cring.allreduce_async_(torch.ones(3, device=dev), op=cring.Sum, name=f"{tag}.async")
        expect(torch.all(cring.synchronize(h) == p).item(), "async")
        return "ok"

    def broadcast_gather_scatter() -> str:
        b = torch.full((2, 5), float(r), device=dev)
        cring.broadcast_(b, root_rank=p - 1, name=f"{tag}.bcast")
        expect(torch.all(b == p - 1).item(), "broadcast_")
        g = cring.allgather(
            torch.full((r + 1, 3), r, device=dev, dtype=torch.int64), name=f"{tag}.gather"
        )
        ref = torch.cat([torch.full((q + 1, 3), q, dtype=torch.int64) for q in range(p)])
        expect(torch.equal(g.cpu(), ref), "uneven allgather")
        g0 = cring.allgather(torch.tensor(float(r), device=dev), name=f"{tag}.gather0d")
        expect(g0.tolist() == [float(q) for q in range(p)], "0-d allgather")
        x = torch.arange(14, device=dev, dtype=torch.float32).reshape(7, 2) * (r + 1)
        rs = cring.reducescatter(x, op=cring.Sum, name=f"{tag}.rs")
        rows = [7 // p + (1 if q < 7 % p else 0) for q in range(p)]
        start = sum(rows[:r])
        full = torch.arange(14, dtype=torch.float32).reshape(7, 2) * sum(q + 1 for q in range(p))
        expect(torch.equal(rs.cpu(), full[start : start + rows[r]]), "reducescatter")
        return "ok"

    check(f"{tag}: allreduce Sum/Min/Max/Average over every dtype", allreduce_dtypes)
    check(f"{tag}: in place, grouped, scaled, fp16-compressed, async", in_place_and_grouped)
    check(
        f"{tag}: broadcast, uneven allgather, 0-d allgather, uneven reducescatter",
        broadcast_gather_scatter,
    )


def sweep_on_cuda(torch: Any, cring: Any, dev: Any) -> str:
    """Issue 26's sweep (tests/gpu/sweep.py; CPU CI runs it on fake CUDA
    tensors): every dtype x collective x shape (17**3, 2**20 + 3, ...) on torch
    CUDA tensors, byte for byte against the same calls on NumPy arrays. At
    world size 1 on an NCCL with the one-rank defect (2.27.0-2.29.6, e.g.
    torch 2.11's 2.28.9), this is the check that Average and scaled results
    keep their tail."""
    sys.path.insert(0, str(Path(__file__).parent))
    from sweep import sweep  # noqa: PLC0415  (tests/gpu is not a package)

    from cring import _gpu

    cases, failures = sweep(
        lambda a: torch.from_numpy(a).to(dev),
        lambda t: t.cpu().numpy(),
        log=lambda line, verbose: None if verbose else print(line, flush=True),
    )
    expect(not failures, f"{len(failures)} of {cases} cases differ: " + "; ".join(failures[:5]))
    info = _gpu.nccl_info()
    return f"{cases} cases exact (NCCL {info['version']}, one-rank guard {info['one_rank_guard']})"


def train(torch: Any, cring: Any, dev: Any, tag: str) -> dict:
    """cring.torch DistributedOptimizer on CUDA: each rank its shard of a
    regression problem; returns the first and last loss and a parameter sum."""
    import cring.torch as hvd

    hvd.init()
    torch.manual_seed(1234)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
    ).to(dev)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters()
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    gen = torch.Generator(device="cpu").manual_seed(99 + hvd.rank())
    w_true = torch.randn(32, 1, generator=torch.Generator().manual_seed(5))
    losses = []
    for _ in range(60):
        xb = torch.randn(64, 32, generator=gen)
        yb = xb @ w_true
        xb, yb = xb.to(dev), yb.to(dev)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    flat = torch.cat([q.detach().flatten() for q in model.parameters()])
    every = cring.allgather(flat.unsqueeze(0), name=f"{tag}.params")
    same = bool(torch.all(every == every[0]).item())
    expect(same, "ranks ended with different parameters")
    expect(losses[-1] < 0.5 * losses[0], f"loss did not fall: {losses[0]:.4f} -> {losses[-1]:.4f}")
    return {
        "first_loss": round(losses[0], 5),
        "last_loss": round(losses[-1], 5),
        "parameters_equal_on_all_ranks": same,
    }


# ---- 2. world size 1 on the NCCL path, in this process -------------------------------------------


def world_one(torch: Any, cring: Any) -> None:
    from cring import _gpu

    os.environ.pop("CRING_GPU_OPERATIONS", None)
    cring.init(rank=0, size=1)
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    before = _gpu.stats()
    collectives(torch, cring, dev, "nccl world 1")

    def stream_order() -> str:
        side = torch.cuda.Stream(device=dev)
        with torch.cuda.stream(side):
            x = torch.full((1 << 20,), 3.0, device=dev)
            torch.cuda._sleep(200_000_000)  # delay this stream (~0.1 s)
            x.add_(1.0)  # 4.0, but only after the delay
            z = cring.allreduce(x, op=cring.Sum, name="stream.order")  # must see 4.0
            w = z * 2  # ordered after the collective on the same stream
        torch.cuda.synchronize()
        expect(torch.all(z == 4.0).item(), f"collective read stale data: {z[0].item()}")
        expect(torch.all(w == 8.0).item(), "work after the collective saw stale data")
        return "ordered after the producer on its stream"

    def no_device_wait() -> str:
        work = torch.cuda.Stream(device=dev)
        busy = torch.cuda.Stream(device=dev)
        with torch.cuda.stream(work):
            x = torch.ones(1 << 16, device=dev)
            cring.allreduce_(x, name="nowait.warmup")
        torch.cuda.synchronize()
        with torch.cuda.stream(busy):
            torch.cuda._sleep(2_000_000_000)  # about a second on the busy stream
        with torch.cuda.stream(work):
            t0 = time.perf_counter()
            cring.allreduce_(x, name="nowait")
            h = cring.allreduce_async_(x, name="nowait.async")
            cring.synchronize(h)
            seconds = time.perf_counter() - t0
        still_busy = not busy.query()
        torch.cuda.synchronize()
        expect(
            still_busy and seconds < 0.2,
            f"calls took {seconds:.3f} s while another stream was busy (device-wide wait?)",
        )
        return f"{seconds * 1e6:.0f} us for a sync + an async call while the device was busy"

    def optimizer() -> dict:
        calls = _gpu.stats()["nccl_calls"]
        out = train(torch, cring, dev, "nccl world 1")
        expect(_gpu.stats()["nccl_calls"] > calls, "the optimizer did not go through NCCL")
        return out

    def c_fast_path() -> str:
        x = torch.ones(1024, device=dev)
        cring.allreduce_(x, op=cring.Sum, name="fast.warm")  # the first call loads NCCL
        cring.synchronize(cring.allreduce_async_(x, op=cring.Sum, name="fast.warm.async"))
        frames: list = []

        def profile(frame: Any, event: str, arg: Any) -> None:
            if event == "call":
                frames.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")

        events = _gpu.stats()["events"]
        sys.setprofile(profile)
        try:
            cring.allreduce_(x, op=cring.Sum, name="fast.sync")
            h = cring.allreduce_async_(x, op=cring.Sum, name="fast.async")
        finally:
            sys.setprofile(None)
        cring.synchronize(h)
        torch.cuda.synchronize()
        expect(not frames, f"Python frames between the call and the queue: {frames}")
        expect(_gpu.stats()["events"] > events, "no event was recorded")
        expect(torch.all(x == 1).item(), "values")
        return "no Python frame in cring.allreduce_ / allreduce_async_ of a torch CUDA tensor"

    def fusion() -> str:
        xs = [torch.full((1000,), float(k), device=dev) for k in range(100)]
        calls = _gpu.stats()["nccl_calls"]
        hs = [cring.allreduce_async_(x, op=cring.Sum, name=f"fuse.{k}") for k, x in enumerate(xs)]
        for h in hs:
            cring.synchronize(h)
        n = _gpu.stats()["nccl_calls"] - calls
        torch.cuda.synchronize()
        expect(all(torch.all(x == k).item() for k, x in enumerate(xs)), "values")
        expect(n <= 2, f"100 small tensors took {n} NCCL calls")
        return f"100 tensors of 4 KB: {n} NCCL call(s)"

    def host_blocking() -> str:
        x = torch.ones(1 << 16, device=dev)
        cring.allreduce_(x, name="block.warm")
        torch.cuda.synchronize()
        out = {}
        for block in (False, True):
            torch.cuda._sleep(200_000_000)  # the current stream is busy ~0.1 s
            h = cring.allreduce_async_(x, name=f"block.{block}")
            t0 = time.perf_counter()
            cring.synchronize(h, block_host=block)
            out[block] = time.perf_counter() - t0
            torch.cuda.synchronize()
        expect(out[False] < 0.05, f"synchronize() blocked the host {out[False]:.3f} s")
        expect(out[True] > 0.03, f"block_host=True returned after {out[True]:.3f} s")
        return f"synchronize {out[False] * 1e6:.0f} us, block_host=True {out[True] * 1e3:.1f} ms"

    def lightning_fit() -> str:
        try:
            import lightning as L
        except ImportError:
            return "lightning is not installed (skipped)"
        import cring.lightning  # noqa: F401  (registers strategy="cring", as a user does)

        torch.manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(256, 8), torch.randn(256, 1))

        class Tiny(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = torch.nn.Linear(8, 1)

            def training_step(self, batch, _):
                xb, yb = batch
                self.seen_on = xb.device.type
                return torch.nn.functional.mse_loss(self.net(xb), yb)

            def on_train_epoch_end(self):
                # fit()'s teardown moves the module back to the CPU: look during fit
                self.param_on = next(self.parameters()).device.type

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

        model = Tiny()
        trainer = L.Trainer(
            strategy="cring",
            accelerator="gpu",
            devices=1,
            max_epochs=2,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
        )
        trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=32))
        expect(
            (model.param_on, model.seen_on) == ("cuda", "cuda"),
            f"parameters on {model.param_on}, batches on {model.seen_on} during fit",
        )
        return "Trainer(strategy='cring', accelerator='gpu', devices=1).fit() ran"

    check("nccl world 1: C fast path for torch CUDA tensors", c_fast_path)
    check("nccl world 1: 100 small tensors fuse into at most 2 NCCL calls", fusion)
    check("nccl world 1: synchronize() leaves the host free, block_host=True waits", host_blocking)
    check("nccl world 1: the collective is ordered after the producer's stream", stream_order)
    check("nccl world 1: no device-wide wait on the fast path", no_device_wait)
    check("nccl world 1: cring.torch DistributedOptimizer on CUDA", optimizer)
    check("nccl world 1: Lightning fit on accelerator='gpu', devices=1", lightning_fit)
    after = _gpu.stats()
    # On an NCCL with the one-rank defect (2.27-2.29.6) the scaled calls above
    # are staged through host memory by design (the guard); nothing else is.
    guard = _gpu.nccl_info()["one_rank_guard"]
    check(
        "nccl world 1: one communicator, nothing staged through host memory "
        "but the guarded scaled calls",
        lambda: (
            expect(
                after["communicators"] - before["communicators"] == 1
                and (guard or after["staged_bytes"] == before["staged_bytes"]),
                str(after),
            )
            or dict(after, one_rank_guard=guard)
        ),
    )
    # last: its int16 and scaled-integer reductions are staged through host memory
    check(
        "nccl world 1: every dtype x collective x shape equals the CPU path (issue 26 sweep)",
        lambda: sweep_on_cuda(torch, cring, dev),
    )
    cring.shutdown()


# ---- 3/4. two processes ------------------------------------------------------------------------


def worker(mode: str, out: Path) -> None:
    import torch

    import cring
    from cring import _gpu

    cring.init()
    r = cring.rank()
    dev = torch.device("cuda", 0 if mode in ("host", "nccl-one-gpu") else cring.local_rank())
    torch.cuda.set_device(dev)
    if mode == "nccl-one-gpu":  # informational: what NCCL says to two ranks on one GPU
        try:
            x = torch.ones(4, device=dev)
            cring.allreduce_(x, op=cring.Sum, name="one_gpu")
            outcome = f"worked: {x.tolist()}"
        except Exception as error:  # noqa: BLE001
            outcome = f"{type(error).__name__}: {error}"
        RESULTS.append({"check": "nccl two ranks on one GPU", "ok": True, "detail": outcome})
    else:
        collectives(torch, cring, dev, f"{mode} world 2")
        check(
            f"{mode} world 2: cring.torch DistributedOptimizer on CUDA",
            lambda: train(torch, cring, dev, f"{mode} world 2"),
        )
        RESULTS.append(
            {"check": f"{mode} world 2: GPU layer counters", "ok": True, "detail": _gpu.stats()}
        )
    cring.shutdown()
    with open(out / f"rank{r}.json", "w") as f:
        json.dump(RESULTS, f)


def two_ranks(mode: str, tmp: Path) -> None:
    env = dict(os.environ, CRING_TIMEOUT_SECONDS="120")
    if mode == "host":
        env["CRING_GPU_OPERATIONS"] = "host"
    else:
        env.pop("CRING_GPU_OPERATIONS", None)
    outdir = tmp / mode
    outdir.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "cring.run",
        "-np",
        "2",
        sys.executable,
        __file__,
        "--worker",
        mode,
        "--out",
        str(outdir),
    ]
    limit_s = 180 if mode == "nccl-one-gpu" else 900
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=limit_s)
    except subprocess.TimeoutExpired as e:
        ok = mode == "nccl-one-gpu"  # informational only
        RESULTS.append(
            {
                "check": f"{mode} world 2",
                "ok": ok,
                "detail": f"did not finish in {limit_s} s: {str(e.stderr)[-2000:]}",
            }
        )
        print(f"{'INFO' if ok else 'FAIL'} {mode} world 2: did not finish in {limit_s} s")
        return
    sys.stdout.write(proc.stdout)
    for r in range(2):
        path = outdir / f"rank{r}.json"
        if path.exists():
            for item in json.loads(path.read_text()):
                item["check"] = f"[rank {r}] {item['check']}"
                RESULTS.append(item)
    if proc.returncode != 0 and mode != "nccl-one-gpu":
        RESULTS.append(
            {
                "check": f"{mode} world 2: processes exited 0",
                "ok": False,
                "detail": proc.stderr[-4000:],
            }
        )
        print(f"FAIL {mode} world 2 exited {proc.returncode}:\n{proc.stderr[-4000:]}")


def lightning_against_ddp() -> str:
    """The Lightning fits of lightning_gpu_check.py (its own processes and
    per-case timeouts): cring's final weights against strategy="ddp"."""
    script = Path(__file__).resolve().parent / "lightning_gpu_check.py"
    out = Path(tempfile.gettempdir()) / "lightning_gpu.json"
    proc = subprocess.run(
        [sys.executable, str(script), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    expect(proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:])
    return proc.stdout[-1500:]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="gpu_checks.json", help="where to write the results")
    parser.add_argument(
        "--worker", choices=("host", "nccl", "nccl-one-gpu"), help=argparse.SUPPRESS
    )
    parser.add_argument(
        "--skip-lightning",
        action="store_true",
        help="leave out the Lightning cring-vs-ddp comparison (several minutes)",
    )
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, Path(args.out))
        return 0
    import torch

    import cring
    from cring import _gpu

    if not torch.cuda.is_available():
        print("torch sees no CUDA device: this script needs a GPU (and a CUDA build of torch)")
        return 2
    gpus = torch.cuda.device_count()
    info = {
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "gpus": gpus,
        "gpu_name": torch.cuda.get_device_name(0),
        "nccl": _gpu.nccl_info(),
        "cuda": _gpu.cuda_info(),
    }
    print(json.dumps(info, indent=1))
    check(
        "libraries: nccl_available() and cuda_available() are True",
        lambda: expect(cring.nccl_available() and cring.cuda_available(), json.dumps(info)),
    )
    world_one(torch, cring)
    tmp = Path(args.out).resolve().parent / "gpu_checks_ranks"
    two_ranks("host", tmp)
    two_ranks("nccl" if gpus >= 2 else "nccl-one-gpu", tmp)
    if not args.skip_lightning:
        check("Lightning: tests/gpu/lightning_gpu_check.py (cring vs ddp)", lightning_against_ddp)
    failed = [r for r in RESULTS if not r["ok"]]
    with open(args.out, "w") as f:
        json.dump({"info": info, "results": RESULTS}, f, indent=1, default=str)
    print(f"\n{len(RESULTS) - len(failed)} passed, {len(failed)} failed; details in {args.out}")
    for item in RESULTS:
        if item["check"].endswith("nccl two ranks on one GPU"):
            print(f"(info) {item['check']}: {item['detail']}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

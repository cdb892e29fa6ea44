"""Memory benchmark of sharded optimizer state: bytes of optimizer state and
of gradients that each rank keeps, with cring's DistributedOptimizer
unsharded (shard_state=0), stage 1 and stage 2, at 2 and 3 ranks.

Each job trains a wide MLP (float32, Adam, two param groups, a parameter
count divisible by neither 2 nor 3) for two steps in each mode and counts,
after the step, the distinct storages the optimizer's state holds and the
gradients that are left (the parameters' .grad and, stage 2, this rank's
slices of the reduced gradients). These are the buffers a rank keeps from
one step to the next; they are counted, not timed, so the machine's load
does not matter. Also counted: the largest amount of full-size gradient
alive at once during stage 2's backward (tracked by the gradient hooks:
buckets whose reducescatter has not ended, gradients not yet packed).

Target (issue 18): optimizer-state bytes per rank <= 1/P of unsharded + 1 %
at P = 2 and 3, and (stage 2) the gradient bytes too.

Prints a table; writes benchmarks/results/zero_memory.csv and, with
matplotlib, zero_memory.png. Run it as
    python benchmarks/zero_memory.py [--width 1024] [--layers 4] [--ranks 2 3]
(it starts its ranks itself).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

RESULTS = Path(__file__).resolve().parent / "results"
SLACK = 0.01  # 1 % over the ideal 1/P
LAUNCHER_VARS = (
    "CRING_RANK",
    "CRING_SIZE",
    "CRING_LOCAL_RANK",
    "CRING_LOCAL_SIZE",
    "CRING_ADDR",
    "CRING_PORT",
    "CRING_SECRET",
    "CRING_JOB_ID",
    "CRING_STORE_EXTERNAL",
)
MODES = {0: "unsharded", 1: "stage 1", 2: "stage 2"}


def storages_bytes(tensors: list) -> int:
    """Bytes of the distinct storages behind `tensors` (views count once)."""
    seen: dict = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F

    import cring
    from cring.torch import DistributedOptimizer, broadcast_parameters

    torch.set_num_threads(1)
    cring.init()
    rank, size = cring.rank(), cring.size()

    def make_model() -> torch.nn.Module:
        torch.manual_seed(0)
        dims = [args.width + 3] + [args.width] * (args.layers - 1) + [7]
        layers: list = []
        for a, b in zip(dims, dims[1:]):
            layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
        return torch.nn.Sequential(*layers[:-1])

    g = torch.Generator().manual_seed(rank)
    x = torch.randn(4, args.width + 3, generator=g)
    y = torch.randn(4, 7, generator=g)
    rows = {}
    for stage, label in MODES.items():
        model = make_model()
        broadcast_parameters(model.state_dict(), root_rank=0)
        params = list(model.parameters())
        groups = [{"params": params[:2], "lr": 1e-3}, {"params": params[2:], "lr": 3e-3}]
        opt = DistributedOptimizer(
            torch.optim.Adam(groups),
            named_parameters=[(f"m{stage}.{n}", p) for n, p in model.named_parameters()],
            shard_state=stage,
        )
        peak = {"now": 0, "max": 0}
        if stage == 2:
            track_full_gradients(opt, peak)
        for _ in range(2):
            opt.zero_grad()
            peak["now"] = 0
            F.mse_loss(model(x), y).backward()
            opt.step()
        state = [
            v
            for st in opt.state.values()
            for v in st.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        ]
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        grads += list(getattr(opt, "_zero_grads", {}).values())
        rows[label] = {
            "state_bytes": storages_bytes(state),
            "grad_bytes": storages_bytes(grads),
            "param_bytes": sum(p.numel() * p.element_size() for p in params),
            "peak_full_grad_bytes": peak["max"] if stage == 2 else None,
        }
        del model, opt
    with open(os.path.join(args.outdir, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "size": size, "rows": rows}, f)
    cring.shutdown()


def track_full_gradients(opt, peak: dict) -> None:
    """Follow the full-size gradient bytes alive during stage 2's backward:
    a gradient counts from its hook until its bucket's reducescatter was
    started (packed buckets then hold a copy until it ends: counted until
    synchronize()). Reads the optimizer's bookkeeping, changes nothing."""
    submit, finish = opt._cring_submit, opt._cring_finish

    def nbytes(p) -> int:
        return p.numel() * p.element_size()

    def hooked_submit(unit):
        submit(unit)
        # the unit's gradients: packed (a P x width copy, the grads freed) or sent in place
        held = sum(nbytes(p) for p in unit.params)
        if not unit.direct:
            held = unit.width * len(unit.offsets[0]) * unit.params[0].element_size()
        peak["now"] += held - sum(nbytes(p) for p in unit.params)
        peak["max"] = max(peak["max"], peak["now"])

    def hooked_finish(handle, entries):
        landed = entries.done
        finish(handle, entries)
        if landed or not entries.done:
            return
        unit = entries.bucket
        held = (
            sum(nbytes(p) for p in unit.params)
            if unit.direct
            else (unit.width * len(unit.offsets[0]) * unit.params[0].element_size())
        )
        peak["now"] -= held

    for p in opt._zero_shards:
        if p.requires_grad:

            def on_grad(param, p=p):
                peak["now"] += nbytes(param)
                peak["max"] = max(peak["max"], peak["now"])

            p.register_post_accumulate_grad_hook(on_grad)
    opt._cring_submit, opt._cring_finish = hooked_submit, hooked_finish


def run(args: argparse.Namespace, ranks: int) -> list:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "cring.run",
            "-np",
            str(ranks),
            sys.executable,
            __file__,
            "--worker",
            "--outdir",
            tmp,
            "--width",
            str(args.width),
            "--layers",
            str(args.layers),
        ]
        env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
        env.setdefault("OPENBLAS_NUM_THREADS", "1")
        subprocess.run(cmd, timeout=600, env=env, check=True)
        out = []
        for r in range(ranks):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                out.append(json.load(f))
        return out


def verdict(value: float, limit: float) -> str:
    return "PASS" if value <= limit else f"MISS by {value / limit - 1:.1%}"


def plot(path: Path, table: list) -> Optional[str]:
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib==3.11.2)"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    colors = {"unsharded": "tab:gray", "stage 1": "tab:blue", "stage 2": "tab:red"}
    for ax, key, title in (
        (axes[0], "state_bytes", "optimizer state (Adam)"),
        (axes[1], "grad_bytes", "gradients kept after the step"),
    ):
        ranks = sorted({row["P"] for row in table})
        width = 0.8 / len(MODES)
        for i, mode in enumerate(MODES.values()):
            xs, hs = [], []
            for j, p in enumerate(ranks):
                worst = max(row[key] for row in table if row["P"] == p and row["mode"] == mode)
                xs.append(j + (i - 1) * width)
                hs.append(worst / 2**20)
            ax.bar(xs, hs, width, label=mode, color=colors[mode])
        for j, p in enumerate(ranks):
            base = max(row[key] for row in table if row["P"] == p and row["mode"] == "unsharded")
            ax.hlines(base / p / 2**20, j - 0.45, j + 0.45, colors="k", linestyles="dashed")
        ax.set_xticks(range(len(ranks)), [f"P = {p}" for p in ranks])
        ax.set_ylabel("MiB per rank (largest rank)")
        ax.set_title(title + "; dashed: unsharded / P")
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--outdir", help=argparse.SUPPRESS)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4, help="Linear layers")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 3])
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    if os.environ.get("CRING_RANK", "0") != "0":
        return 0
    table = []
    for ranks in args.ranks:
        for res in run(args, ranks):
            for mode, row in res["rows"].items():
                table.append({"P": ranks, "rank": res["rank"], "mode": mode, **row})
    params = table[0]["param_bytes"]
    print(
        f"\nsharded optimizer state: MLP {args.width + 3}-{args.width}x{args.layers - 1}-7, "
        f"{params / 4 / 1e6:.2f}M float32 parameters ({params / 2**20:.1f} MiB), Adam; "
        f"bytes each rank keeps after a step\n"
    )
    print(
        f"{'P':>2s} {'rank':>4s} {'mode':10s} {'state MiB':>10s} {'/unsharded':>10s} "
        f"{'grad MiB':>9s} {'/unsharded':>10s}"
    )
    worst_ok = True
    lines = []
    for row in table:
        base = next(
            r
            for r in table
            if r["P"] == row["P"] and r["rank"] == row["rank"] and r["mode"] == "unsharded"
        )
        row["state_ratio"] = row["state_bytes"] / base["state_bytes"]
        row["grad_ratio"] = row["grad_bytes"] / base["grad_bytes"]
        print(
            f"{row['P']:2d} {row['rank']:4d} {row['mode']:10s} "
            f"{row['state_bytes'] / 2**20:10.3f} {row['state_ratio']:10.4f} "
            f"{row['grad_bytes'] / 2**20:9.3f} {row['grad_ratio']:10.4f}"
        )
    print()
    for ranks in args.ranks:
        limit = (1 + SLACK) / ranks
        for mode, key in (
            ("stage 1", "state_ratio"),
            ("stage 2", "state_ratio"),
            ("stage 2", "grad_ratio"),
        ):
            worst = max(r[key] for r in table if r["P"] == ranks and r["mode"] == mode)
            v = verdict(worst, limit)
            worst_ok &= v == "PASS"
            what = "optimizer state" if key == "state_ratio" else "gradients"
            line = (
                f"P={ranks} {mode}: {what} per rank {worst:.4f} of unsharded (target <= "
                f"1/P + 1% = {limit:.4f}): {v}"
            )
            lines.append(line)
            print(line)
        peak = max(
            r["peak_full_grad_bytes"] for r in table if r["P"] == ranks and r["mode"] == "stage 2"
        )
        print(
            f"P={ranks} stage 2: at most {peak / 2**20:.2f} MiB of full-size gradients alive "
            f"at once during backward ({peak / params:.0%} of the parameters)"
        )
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / "zero_memory.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            [
                "ranks",
                "rank",
                "mode",
                "state_bytes",
                "state_ratio",
                "grad_bytes",
                "grad_ratio",
                "param_bytes",
                "peak_full_grad_bytes",
            ]
        )
        for row in table:
            w.writerow(
                [
                    row["P"],
                    row["rank"],
                    row["mode"],
                    row["state_bytes"],
                    f"{row['state_ratio']:.5f}",
                    row["grad_bytes"],
                    f"{row['grad_ratio']:.5f}",
                    row["param_bytes"],
                    row["peak_full_grad_bytes"] if row["peak_full_grad_bytes"] is not None else "",
                ]
            )
    why = plot(RESULTS / "zero_memory.png", table)
    print(
        f"\nwrote {RESULTS / 'zero_memory.csv'}"
        + (f" and {RESULTS / 'zero_memory.png'}" if why is None else f" (no plot: {why})")
    )
    return 0 if worst_ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""The report of benchmarks/collectives.py: medians over repetitions, the
tables, the CSV and the plot, and the targets checked against the peers.
Pure functions of the measured samples."""

from __future__ import annotations

import csv
import statistics
from pathlib import Path
from typing import Any, Optional

from _collectives_common import (
    PEERS,
    RATIO_PAIRS,
    SHORT,
    WORLD,
    KiB,
    MiB,
    busbw_factor,
    dtype_of,
    fmt_size,
)


def summarise(samples: dict) -> dict:
    """{(collective, bytes): row} from {(collective, bytes): [(rank replies), ...]}:
    per repetition the slowest rank, then the median over all repetitions."""
    rows: dict = {}
    for key, rounds in samples.items():
        reps = [max(ts) for replies in rounds for ts in zip(*(r["times_s"] for r in replies))]
        first = rounds[0][0]
        t = statistics.median(reps)
        algbw = first["bytes"] / t / 1e9
        rows[key] = {
            "time_s": t,
            "algbw": algbw,
            "busbw": algbw * busbw_factor(key[0], WORLD),
            "calls_per_rep": first["calls_per_rep"],
            "reps": len(reps),
            "buffers": first["buffers"],
            "buffer_bytes": first["buffer_bytes"],
            "spread": (max(reps) - min(reps)) / t if t else 0.0,
        }
    return rows


def fmt_time(t: Optional[float]) -> str:
    if t is None:
        return "-"
    if t < 1e-3:
        return f"{t * 1e6:.2f}us" if t < 1e-5 else f"{t * 1e6:.1f}us"
    return f"{t * 1e3:.2f}ms" if t < 0.1 else f"{t * 1e3:.0f}ms"


def fmt_bw(x: Optional[float]) -> str:
    if x is None:
        return "-"
    if x >= 100:
        return f"{x:.0f}"
    return f"{x:.2f}" if x >= 1 else f"{x:.3f}" if x >= 0.001 else f"{x:.0e}"


def has(data: dict, lib: str, collective: str) -> bool:
    return any(isinstance(k, tuple) and k[0] == collective for k in data.get(lib, {}))


def print_tables(data: dict, all_libs: list, collectives: list, sizes: list) -> None:
    short = SHORT
    for collective in collectives:
        libs = [l for l in all_libs if has(data, l, collective)]
        if not libs:
            continue
        ratios = [(c, p) for c, p in RATIO_PAIRS if c in libs and p in libs]
        keys = sorted(
            {
                k[1]
                for l in libs
                for k in data.get(l, {})
                if isinstance(k, tuple) and k[0] == collective
            }
        )
        kind = f" ({dtype_of(collective)[0]} sum, in place)" if "allreduce" in collective else ""
        print(
            f"\n{collective}{kind}"
            f"   time per call | algbw GB/s | busbw GB/s (x{busbw_factor(collective, WORLD):g})"
            f" | ratio = cring time / peer time"
        )
        head = f"{'size':>8s} |" + "".join(f"{short[l]:>9s}" for l in libs) + " |"
        head += "".join(f"{short[l]:>8s}" for l in libs) + " |"
        head += "".join(f"{short[l]:>8s}" for l in libs) + " |"
        head += "".join(f"{short[c] + '/' + short[p]:>11s}" for c, p in ratios)
        print(head)
        print("-" * len(head))
        for nbytes in keys:
            get = [data.get(l, {}).get((collective, nbytes)) for l in libs]
            line = f"{fmt_size(nbytes):>8s} |"
            line += "".join(f"{fmt_time(g and g['time_s']):>9s}" for g in get) + " |"
            line += "".join(f"{fmt_bw(g and g['algbw']):>8s}" for g in get) + " |"
            line += "".join(f"{fmt_bw(g and g['busbw']):>8s}" for g in get) + " |"
            for c, p in ratios:
                a = data.get(c, {}).get((collective, nbytes))
                z = data.get(p, {}).get((collective, nbytes))
                line += f"{a['time_s'] / z['time_s']:>11.3f}" if a and z else f"{'-':>11s}"
            print(line)


def write_csv(path: Path, data: dict, libs: list) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            [
                "collective",
                "bytes",
                "library",
                "time_us",
                "algbw_GBps",
                "busbw_GBps",
                *(f"vs_{peer}" for peer in PEERS),
                "calls_per_rep",
                "reps",
                "buffers",
                "buffer_bytes",
                "rep_spread",
            ]
        )
        for lib in libs:
            for key, row in sorted(
                (k, v) for k, v in data.get(lib, {}).items() if isinstance(k, tuple)
            ):
                vs = []
                for peer in PEERS:
                    other = data.get(peer, {}).get(key)
                    vs.append(
                        f"{row['time_s'] / other['time_s']:.4g}"
                        if other and (lib, peer) in RATIO_PAIRS
                        else ""
                    )
                w.writerow(
                    [
                        key[0],
                        key[1],
                        lib,
                        f"{row['time_s'] * 1e6:.4g}",
                        f"{row['algbw']:.4g}",
                        f"{row['busbw']:.4g}",
                        *vs,
                        row["calls_per_rep"],
                        row["reps"],
                        row["buffers"],
                        row["buffer_bytes"],
                        f"{row['spread']:.3g}",
                    ]
                )


def plot(path: Path, data: dict, libs: list, collectives: list, title: str) -> Optional[str]:
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib==3.11.2)"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    style = {
        "cring-shm": ("tab:red", "o"),
        "cring-tcp": ("tab:orange", "s"),
        "gloo": ("tab:blue", "^"),
        "mpi": ("tab:green", "v"),
        "cring-torch": ("tab:purple", "D"),
        "deepspeed": ("tab:brown", "x"),
    }
    label = {
        "cring-shm": "cring (shared memory)",
        "cring-tcp": "cring (TCP)",
        "gloo": "torch.distributed gloo",
        "mpi": "Open MPI (mpi4py)",
        "cring-torch": "cring.torch (torch tensors, shm)",
        "deepspeed": "DeepSpeed shm (torch tensors)",
    }
    fig, axes = plt.subplots(
        1, len(collectives), figsize=(5 * len(collectives), 4.4), squeeze=False
    )
    for ax, collective in zip(axes[0], collectives):
        for lib in libs:
            pts = sorted(
                (k[1], v["busbw"])
                for k, v in data.get(lib, {}).items()
                if isinstance(k, tuple) and k[0] == collective
            )
            if pts:
                color, marker = style[lib]
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    marker=marker,
                    color=color,
                    label=label[lib],
                    markersize=4,
                )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(
            collective + (f" ({dtype_of(collective)[0]} sum)" if "allreduce" in collective else "")
        )
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.grid(True, which="both", alpha=0.3)
        ticks = [1 << k for k in range(3, 31, 4)]
        ax.set_xticks(ticks, [fmt_size(t).replace(" ", "") for t in ticks])
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


TARGETS = [
    # (label, library, peer, collective, sizes, limit)
    ("allreduce 64 MiB vs Open MPI", "cring-shm", "mpi", "allreduce", [64 * MiB], 0.5),
    ("allreduce 64 MiB vs gloo", "cring-shm", "gloo", "allreduce", [64 * MiB], 0.25),
    ("allreduce 1 MiB vs Open MPI", "cring-shm", "mpi", "allreduce", [MiB], 0.7),
    ("allreduce 8 B..1 KiB vs mpi4py (worst size)", "cring-shm", "mpi", "allreduce", "small", 1.0),
    ("allreduce 8 B..1 KiB vs gloo (worst size)", "cring-shm", "gloo", "allreduce", "small", 0.05),
    (
        "allreduce 64 MiB, CRING_TRANSPORT=tcp vs gloo",
        "cring-tcp",
        "gloo",
        "allreduce",
        [64 * MiB],
        0.7,
    ),
    ("broadcast 1 MiB vs Open MPI", "cring-shm", "mpi", "broadcast", [MiB], 1.0),
    ("broadcast 64 MiB vs Open MPI", "cring-shm", "mpi", "broadcast", [64 * MiB], 1.0),
    ("allgather 1 MiB vs Open MPI", "cring-shm", "mpi", "allgather", [MiB], 1.0),
    ("allgather 64 MiB vs Open MPI", "cring-shm", "mpi", "allgather", [64 * MiB], 1.0),
    # issue 20: small broadcast and allgather (the --loop mode times plain loops)
    (
        "broadcast 8 B..64 KiB vs mpi4py (worst size)",
        "cring-shm",
        "mpi",
        "broadcast",
        [8, KiB, 64 * KiB],
        1.5,
    ),
    (
        "allgather 8 B..64 KiB vs mpi4py (worst size)",
        "cring-shm",
        "mpi",
        "allgather",
        [8, KiB, 64 * KiB],
        1.5,
    ),
    # issue 20: cring.torch against DeepSpeed's shared-memory allreduce, same torch tensors
    *(
        (f"allreduce {dt} {fmt_size(n)} vs DeepSpeed shm", "cring-torch", "deepspeed", c, [n], lim)
        for dt, c in (("fp32", "allreduce"), ("bf16", "allreduce-bf16"))
        for n, lim in ((8, 1.0), (MiB, 0.6), (64 * MiB, 0.4))
    ),
]


def worst_ratio(data: dict, lib: str, peer: str, collective: str, sizes: Any) -> tuple:
    """(largest cring/peer time ratio over `sizes`, the size where it is)."""
    if sizes == "small":
        sizes = sorted(
            k[1]
            for k in data.get(lib, {})
            if isinstance(k, tuple) and k[0] == collective and 8 <= k[1] <= KiB
        )
    worst, worst_size = None, None
    for s in sizes:
        a = data.get(lib, {}).get((collective, s))
        z = data.get(peer, {}).get((collective, s))
        if a and z:
            r = a["time_s"] / z["time_s"]
            if worst is None or r > worst:
                worst, worst_size = r, s
    return worst, worst_size


def check_targets(data: dict, per_round: list) -> list:
    """[(label, ratio or None, worst size, limit, verdict, per-round ratios)]
    for issue 7's targets; the verdict uses the medians over all rounds."""
    out = []
    for label, lib, peer, collective, sizes, limit in TARGETS:
        worst, worst_size = worst_ratio(data, lib, peer, collective, sizes)
        rounds = [worst_ratio(d, lib, peer, collective, sizes)[0] for d in per_round]
        verdict = "n/a" if worst is None else ("PASS" if worst <= limit else "MISS")
        out.append((label, worst, worst_size, limit, verdict, rounds))
    return out

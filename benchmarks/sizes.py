"""Shared memory at every size (issue 35): cring over shared memory against
cring over TCP, Open MPI (mpi4py) and gloo, two ranks on this machine.

    python benchmarks/sizes.py [--runs 3] [--reps 7] [--sizes 4K 1M ...]
                               [--libraries ...] [--out DIR] [--plot docs/sizes.png]

Each run starts every library's ranks (benchmarks/collectives.py's machinery
and workers) and has them measure, one after another, float32 allreduce in
place and out of place, broadcast and allgather at every power of 4 from
4 KiB to 64 MiB; `--runs` repeats the whole thing (new processes each time)
and the figures are medians over the runs of each run's median. `--data
memory` (default) rotates every call over buffers larger than the last-level
cache, `--data cache` uses one buffer per size: one regime at every size, so
that a step between sizes is the algorithm's. Out of
place: `cring.allreduce(x)` (a new array), `comm.Allreduce(x, out)` and
`out.copy_(x); dist.all_reduce(out)` (gloo reduces in place only).

It prints, first, the machine's figures (CPU, cores, cache sizes, NumPy copy
bandwidth in and out of cache) and the sizes cring's shared-memory
collectives chose here (`cringrun --check-build` prints the same), so that
results from different machines can be compared; then, per collective, a
table of times, the ratios of cring's shared memory to each peer and the
step from the size before (time / time at a quarter of the size); then the
issue's acceptance lines. Writes DIR/sizes.json (every run) and a plot
(time per call against size, one panel per collective) to --plot or
DIR/sizes.png. DIR defaults to benchmarks/results (ignored by git).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from _collectives_common import RESULTS, WORLD, fmt_size, llc_bytes, machine, parse_size
from _collectives_report import fmt_time
from collectives import start_groups, stop_groups

LIBS = ("cring-shm", "cring-tcp", "mpi", "gloo")
SHORT = {"cring-shm": "shm", "cring-tcp": "tcp", "mpi": "mpi", "gloo": "gloo"}
COLLS = ("allreduce", "allreduce-oop", "broadcast", "allgather")
TITLES = {
    "allreduce": "allreduce, float32 sum, in place",
    "allreduce-oop": "allreduce, float32 sum, out of place",
    "broadcast": "broadcast from rank 0, in place",
    "allgather": "allgather (size = the gathered result)",
}
SIZES = [4**k for k in range(6, 14)]  # 4 KiB .. 64 MiB
STEP_LIMIT = 5.0  # no step between adjacent sizes costs more than this for 4x the data
OOP_LIMIT = 1.5  # the synchronous out-of-place 4 KiB call against the in-place one


# --------------------------------------------------------------------------- the machine


def cache_levels() -> list:
    """cpu0's caches as sysfs reports them: (name, bytes, CPUs sharing it)."""
    out = []
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    for index in sorted(base.glob("index*")):
        try:
            level = (index / "level").read_text().strip()
            kind = (index / "type").read_text().strip()
            size = (index / "size").read_text().strip()
            shared = (index / "shared_cpu_list").read_text().strip()
        except OSError:
            continue
        if kind == "Instruction":
            continue
        name = f"L{level}{'d' if kind == 'Data' else ''}"
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
        out.append((name, int(size.rstrip("KMG")) * scale, shared))
    return out


def copy_bandwidth(nbytes: int, min_s: float = 0.2) -> float:
    """GB/s of NumPy copying nbytes between two buffers (one thread), best of
    several passes; from beyond the last-level cache when nbytes exceeds it."""
    import numpy as np

    a = np.ones(nbytes // 8, np.float64)
    b = np.empty_like(a)
    np.copyto(b, a)
    best, spent = float("inf"), 0.0
    while spent < min_s:
        t = time.perf_counter()
        np.copyto(b, a)
        dt = time.perf_counter() - t
        best, spent = min(best, dt), spent + dt
    return nbytes / best / 1e9


def machine_figures() -> dict:
    info = machine()
    llc = llc_bytes()
    info["caches"] = cache_levels()
    info["cpus_usable"] = len(os.sched_getaffinity(0))
    info["copy_gbps"] = {
        "256 KiB (in L2)": copy_bandwidth(256 << 10),
        "4 MiB (in L3)": copy_bandwidth(4 << 20) if llc > (8 << 20) else None,
        f"{fmt_size(4 * llc)} (from memory)": copy_bandwidth(4 * llc),
    }
    try:
        import cring

        info["shm_sizes"] = cring._C.shm_tuning()
    except (ImportError, AttributeError) as e:  # a cring without it (an older tree)
        info["shm_sizes"] = {"error": str(e)}
    return info


def print_machine(info: dict) -> None:
    print(f"machine: {info['cpu']}, {info['nproc']} CPUs ({info['cpus_usable']} usable here)")
    for name, nbytes, shared in info["caches"]:
        print(f"  {name:4s} {fmt_size(nbytes):>8s}  shared by CPUs {shared}")
    for what, gbps in info["copy_gbps"].items():
        if gbps is not None:
            print(f"  NumPy copy {what}: {gbps:.1f} GB/s")
    sizes = info["shm_sizes"]
    if "error" in sizes:
        print(f"  cring's shared-memory sizes: not reported ({sizes['error']})")
        return
    print(
        "  cring's shared-memory sizes here: "
        + ", ".join(
            f"{k.replace('_bytes', '')} {fmt_size(v)}"
            for k, v in sizes.items()
            if not k.startswith(("l1", "l2", "l3"))
        )
    )


# --------------------------------------------------------------------------- one run


def one_run(args: argparse.Namespace, rotate_bytes: int) -> dict:
    """Start the libraries, measure every collective and size, stop them.
    Returns {library: {collective: {bytes: median seconds per call}}}."""
    groups, notes, server = start_groups(list(args.libraries), args.timeout)
    for lib, why in notes.items():
        print(f"  {lib}: skipped ({why})", flush=True)
    result: dict = {lib: {c: {} for c in COLLS} for lib in groups}
    try:
        # one discarded pass of every collective at the smallest size first:
        # right after start-up the first library measured ran several times
        # slower than later (the others' start-up still settling; one
        # collective's pass was not always enough)
        for coll in COLLS:
            for g in groups.values():
                if not g.failed:
                    g.request(
                        {
                            "cmd": "measure",
                            "collective": coll,
                            "bytes": min(args.sizes),
                            "reps": 1,
                            "rotate_bytes": rotate_bytes,
                        },
                        args.timeout,
                    )
        for coll in COLLS:
            for nbytes in args.sizes:
                line = []
                for lib, g in groups.items():
                    if g.failed:
                        continue
                    request = {
                        "cmd": "measure",
                        "collective": coll,
                        "bytes": nbytes,
                        "reps": args.reps,
                        "rotate_bytes": rotate_bytes,
                        # from memory: every size rotates; in cache: none does
                        "rotate_from_bytes": 0 if args.data == "memory" else 1 << 62,
                    }
                    replies = g.request(request, args.timeout)
                    if not replies or replies[0].get("skipped"):
                        continue
                    # a repetition's time is the slowest rank's; the median over them
                    t = statistics.median(max(ts) for ts in zip(*(r["times_s"] for r in replies)))
                    result[lib][coll][replies[0]["bytes"]] = t
                    line.append(f"{SHORT[lib]} {fmt_time(t)}")
                print(f"  {coll:13s} {fmt_size(nbytes):>8s}: " + ", ".join(line), flush=True)
    finally:
        stop_groups(groups, server)
    return result


# --------------------------------------------------------------------------- report


def medians(runs: list) -> dict:
    """{lib: {coll: {bytes: median over runs}}}."""
    out: dict = {}
    for run in runs:
        for lib, colls in run.items():
            for coll, by_size in colls.items():
                for nbytes, t in by_size.items():
                    out.setdefault(lib, {}).setdefault(coll, {}).setdefault(int(nbytes), [])
                    out[lib][coll][int(nbytes)].append(t)
    return {
        lib: {c: {b: statistics.median(ts) for b, ts in s.items()} for c, s in colls.items()}
        for lib, colls in out.items()
    }


def get(data: dict, lib: str, coll: str, nbytes: int):
    return data.get(lib, {}).get(coll, {}).get(nbytes)


def ratio(a, b) -> str:
    return f"{a / b:7.3f}" if a is not None and b else "      -"


def print_tables(data: dict, sizes: list) -> None:
    libs = [lib for lib in LIBS if lib in data]
    for coll in COLLS:
        print(
            f"\n{TITLES[coll]}: time per call; ratio = cring shm time / peer time; "
            "step = shm time / shm time at a quarter of the size"
        )
        head = f"{'size':>8s} | " + " ".join(f"{SHORT[l]:>8s}" for l in libs)
        head += " | " + " ".join(f"{'shm/' + SHORT[l]:>8s}" for l in libs if l != "cring-shm")
        print(head + " |     step")
        print("-" * len(head + " |     step"))
        prev = None
        for nbytes in sizes:
            shm = get(data, "cring-shm", coll, nbytes)
            row = f"{fmt_size(nbytes):>8s} | " + " ".join(
                f"{fmt_time(t) if (t := get(data, l, coll, nbytes)) is not None else '-':>8s}"
                for l in libs
            )
            row += " | " + " ".join(
                f"{ratio(shm, get(data, l, coll, nbytes)):>8s}" for l in libs if l != "cring-shm"
            )
            step = f"{shm / prev:8.2f}" if shm is not None and prev else "       -"
            print(row + " | " + step)
            prev = shm


def acceptance(data: dict, sizes: list) -> list:
    """Issue 35's lines: (label, worst value, limit, where, verdict)."""
    lines = []

    def worst(values):  # [(value, where)] -> the largest
        values = [v for v in values if v[0] is not None]
        return max(values) if values else (None, None)

    for coll in COLLS:
        for peer, limit in (("mpi", 1.0), ("cring-tcp", 1.0)):
            v, at = worst(
                (
                    (
                        s / p
                        if (s := get(data, "cring-shm", coll, b))
                        and (p := get(data, peer, coll, b))
                        else None
                    ),
                    b,
                )
                for b in sizes
            )
            lines.append((f"{coll}: shm / {SHORT[peer]}, worst size", v, limit, at))
        steps = []
        for small, big in zip(sizes, sizes[1:]):
            a, b = get(data, "cring-shm", coll, small), get(data, "cring-shm", coll, big)
            steps.append((b / a if a and b and big == 4 * small else None, big))
        v, at = worst(steps)
        lines.append((f"{coll}: shm step for 4x the data, worst", v, STEP_LIMIT, at))
    a = get(data, "cring-shm", "allreduce", 4096)
    b = get(data, "cring-shm", "allreduce-oop", 4096)
    lines.append(
        ("4 KiB allreduce: out of place / in place", b / a if a and b else None, OOP_LIMIT, 4096)
    )
    return [
        (label, v, limit, at, "-" if v is None else "PASS" if v <= limit else "MISS")
        for label, v, limit, at in lines
    ]


def plot(path: Path, data: dict, sizes: list, title: str):
    """Time per call against size, one panel per collective; None, or why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib==3.11.2)"
    fig, axes = plt.subplots(2, 2, figsize=(11, 8), sharex=True)
    for ax, coll in zip(axes.flat, COLLS):
        for lib in LIBS:
            pts = [(b, get(data, lib, coll, b)) for b in sizes]
            pts = [(b, t * 1e6) for b, t in pts if t is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=lib)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(TITLES[coll], fontsize=10)
        ax.set_ylabel("us per call")
        ax.set_xticks(sizes, [fmt_size(b).replace(" ", "") for b in sizes], fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    return None


# --------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", nargs="+", type=parse_size, default=SIZES)
    parser.add_argument("--runs", type=int, default=3, help="whole runs (default %(default)s)")
    parser.add_argument("--reps", type=int, default=7, help="repetitions per size and run")
    parser.add_argument("--out", default=str(RESULTS), help="output folder (default %(default)s)")
    parser.add_argument("--plot", default=None, help="plot file (default OUT/sizes.png)")
    parser.add_argument(
        "--libraries",
        nargs="+",
        choices=LIBS,
        default=list(LIBS),
        help="default: all four (an A/B of two cring builds needs only cring-shm)",
    )
    parser.add_argument(
        "--data",
        choices=("memory", "cache"),
        default="memory",
        help="memory (default): every call uses the next of buffers totalling more than the "
        "last-level cache, at every size; cache: one buffer per size, as a loop over one "
        "tensor (resident where it fits). One regime for all sizes, so that a step between "
        "sizes is the algorithm's, not a switch between the two",
    )
    parser.add_argument("--timeout", type=float, default=600, help="seconds per size or start")
    args = parser.parse_args()
    if os.environ.get("CRING_RANK", "0") != "0":
        return 0  # under cringrun: rank 0 runs the benchmark, which starts its own ranks
    if args.runs < 1 or args.reps < 1:
        parser.error("--runs and --reps must be at least 1")
    args.sizes = sorted(args.sizes)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = machine_figures()
    print_machine(info)
    rotate_bytes = int(info["llc_bytes"] * 1.1) // (1 << 20) * (1 << 20)
    regime = (
        f"every call on the next of buffers totalling {fmt_size(rotate_bytes)} per rank "
        "(data from memory)"
        if args.data == "memory"
        else "one buffer per size (data in cache where it fits)"
    )
    print(
        f"{WORLD} ranks per library, {args.runs} runs x {args.reps} repetitions per size; {regime}",
        flush=True,
    )
    runs = []
    for k in range(args.runs):
        print(f"run {k + 1}/{args.runs}", flush=True)
        runs.append(one_run(args, rotate_bytes))
    data = medians(runs)
    print(f"\nmedians over {args.runs} runs")
    print_tables(data, args.sizes)
    verdicts = acceptance(data, args.sizes)
    print("\nissue 35's acceptance lines (medians over the runs):")
    for label, v, limit, at, verdict in verdicts:
        shown = "-" if v is None else f"{v:.3f}"
        where = f" (at {fmt_size(at)})" if at else ""
        print(f"  {label:48s} {shown:>8s}  <= {limit:g}  {verdict}{where}")
    (out / "sizes.json").write_text(
        json.dumps(
            {
                "machine": info,
                "data": args.data,
                "runs": runs,
                "medians": data,
                "acceptance": verdicts,
            },
            indent=1,
        )
    )
    png = Path(args.plot) if args.plot else out / "sizes.png"
    title = f"{WORLD} ranks, {info['cpu']}; data from {args.data}; medians of {args.runs} runs"
    why = plot(png, data, args.sizes, title)
    print(
        f"\nwrote {out / 'sizes.json'}" + (f" and {png}" if why is None else f" (no plot: {why})")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

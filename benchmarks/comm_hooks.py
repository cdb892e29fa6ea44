"""Communication hooks over a slow link: bytes on the wire and step time per
hook (cring.torch.hooks) against no hook, 2 ranks over TCP through a veth
pair between two network namespaces, limited with a `tbf` qdisc on both
ends (netem is not available here), for ResNet-50's and GPT-2-small's
gradient sets.

    python benchmarks/comm_hooks.py                     # 1 and 10 Gbit/s, both models
    python benchmarks/comm_hooks.py --rates 1gbit --models resnet50 --plot docs/hooks.png

Needs root, iproute2 (ip, tc) and the kernel's tbf qdisc; all traffic stays
on the private link. Run it alone (`/work/bin/cpu-slot -x`): the figures are
times.

A step here is DistributedOptimizer.synchronize() on a full set of random
float32 gradients (no model runs): what the hook costs and saves is all
that differs between rows. For each hook:
  * bytes: what this rank's engine sent over TCP in one step (engine_stats);
  * step: the median of the timed steps (both ranks start each together);
  * compute: the same step with each rank in a process set of its own (the
    hook's arithmetic, no link), the compression's own cost;
  * predicted: the uncompressed step's time x the byte ratio + compute,
    what the byte count predicts for the step with the hook.
gloo's allreduce of the same buckets (torch.distributed, 25 MiB buckets)
is the peers' row for the uncompressed step.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HOOKS = ("none", "fp16", "int8", "powersgd4", "powersgd1")
START_ITER = 2  # PowerSGD's plain steps before compressing (within the warm-up)

# ---- the gradient sets -----------------------------------------------------------------------


def resnet50_shapes() -> list:
    """The parameters of torchvision's resnet50, in registration order (25,557,032)."""
    shapes = [(64, 3, 7, 7), (64,), (64,)]
    inplanes = 64
    for planes, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            shapes += [(planes, inplanes, 1, 1), (planes,), (planes,)]
            shapes += [(planes, planes, 3, 3), (planes,), (planes,)]
            shapes += [(planes * 4, planes, 1, 1), (planes * 4,), (planes * 4,)]
            if b == 0:
                shapes += [(planes * 4, inplanes, 1, 1), (planes * 4,), (planes * 4,)]
            inplanes = planes * 4
    return shapes + [(1000, 2048), (1000,)]


def gpt2_small_shapes() -> list:
    """GPT-2 small (124,439,808 parameters; the output layer shares the embedding)."""
    d, shapes = 768, [(50257, 768), (1024, 768)]
    for _ in range(12):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,)]
        shapes += [(d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return shapes + [(d,), (d,)]


MODELS = {
    "resnet50": (resnet50_shapes, 25_557_032),
    "transformer": (gpt2_small_shapes, 124_439_808),
}


def numel(shape: tuple) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# ---- one rank ----------------------------------------------------------------------------------


def _hook(name: str, process_set):
    from cring.torch import hooks

    if name == "none":
        return None, None
    if name == "fp16":
        return hooks.fp16_compress, process_set
    if name == "int8":
        return hooks.int8_hook, hooks.Int8State(process_set)
    rank = int(name[len("powersgd") :])
    state = hooks.PowerSGDState(
        process_set, matrix_approximation_rank=rank, start_powerSGD_iter=START_ITER
    )
    return hooks.powerSGD_hook, state


def _steps(opt, params, warmup: int, steps: int, set_size: int) -> tuple:
    """(seconds of each timed step, TCP bytes this rank sent in the last)."""
    import torch

    import cring

    times, sent = [], 0
    for i in range(warmup + steps):
        for p in params:
            p.grad.normal_()
        cring.barrier()
        before = cring.engine_stats()["tcp_bytes_sent"]
        t0 = time.perf_counter()
        opt.synchronize()
        dt = time.perf_counter() - t0
        sent = cring.engine_stats()["tcp_bytes_sent"] - before
        if i >= warmup:
            times.append(dt)
    del torch
    return times, sent


def _gloo_steps(params, warmup: int, steps: int, addr: str, port: int) -> list:
    import torch
    import torch.distributed as dist

    import cring

    dist.init_process_group(
        "gloo", init_method=f"tcp://{addr}:{port}", rank=cring.rank(), world_size=cring.size()
    )
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    buckets = list(flat.split((25 << 20) // 4))
    times = []
    for i in range(warmup + steps):
        flat.normal_()
        cring.barrier()
        t0 = time.perf_counter()
        for w in [dist.all_reduce(b, async_op=True) for b in buckets]:
            w.wait()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    dist.destroy_process_group()
    return times


def worker(args: argparse.Namespace) -> None:
    import torch

    import cring
    import cring.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    rank = cring.rank()
    shapes_fn, expected = MODELS[args.model]
    shapes = shapes_fn()
    assert sum(numel(s) for s in shapes) == expected, args.model
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    for p in params:
        p.grad = torch.zeros_like(p)
    alone = [hvd.add_process_set([r]) for r in range(cring.size())]
    rows = {}
    for name in args.hooks:
        row = {}
        for where, ps in (("link", None), ("alone", alone[rank])):
            if where == "alone" and name == "none":
                continue
            hook, state = _hook(name, ps)
            opt = hvd.DistributedOptimizer(
                torch.optim.SGD(params, lr=0.0),
                named_parameters=[(f"{name}.{where}.{i}", p) for i, p in enumerate(params)],
                comm_hook=hook,
                comm_state=state,
                process_set=ps,
            )
            times, sent = _steps(opt, params, args.warmup, args.steps, 1 if ps else 2)
            if where == "link":
                row.update(step_s=statistics.median(times), times=times, bytes=sent)
            else:
                row.update(compute_s=statistics.median(times))
            del opt, state
        rows[name] = row
        print(f"rank {rank}: {args.model} {name}: {row}", flush=True)
    rows["gloo"] = {
        "step_s": statistics.median(_gloo_steps(params, 1, args.steps, args.addr, args.gloo_port))
    }
    if rank == 0:
        Path(args.result).write_text(json.dumps(rows))
    cring.shutdown()


# ---- the link ------------------------------------------------------------------------------------


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


class Link:
    """Two network namespaces joined by a veth pair, each end shaped by tbf."""

    def __init__(self, rate: str) -> None:
        tag = f"{os.getpid() % 100000}"
        self.ns = (f"crh{tag}a", f"crh{tag}b")
        self.dev = (f"crh{tag}a", f"crh{tag}b")
        third = os.getpid() % 200 + 20
        self.addr = (f"10.213.{third}.1", f"10.213.{third}.2")
        self.rate = rate
        bits = _bits_per_s(rate)
        burst = max(256 << 10, int(bits / 8 / 250))  # at least a 4 ms timer tick's worth

        for ns in self.ns:
            _run("ip", "netns", "add", ns)
        self.up = True
        _run("ip", "link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1])
        for ns, dev, addr in zip(self.ns, self.dev, self.addr):
            _run("ip", "link", "set", dev, "netns", ns)
            _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _run("ip", "-n", ns, "link", "set", dev, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run(
                "ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                "rate", rate, "burst", str(burst), "latency", "100ms",
            )  # fmt: skip

    def close(self) -> None:
        if self.up:
            for ns in self.ns:
                subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            self.up = False

    def measure_gbit(self, seconds: float = 2.0) -> float:
        """One TCP stream's throughput from a to b over the shaped link."""
        port = 47000 + os.getpid() % 1000
        sink = (
            "import socket;s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);"
            f"s.bind(('{self.addr[1]}',{port}));s.listen(1);c,_=s.accept()\n"
            "while c.recv(1<<20): pass"
        )
        source = (
            "import socket,time;s=socket.create_connection"
            f"(('{self.addr[1]}',{port}));b=b'x'*(1<<20);n=0;t=time.time()\n"
            f"while time.time()-t<{seconds}:\n s.sendall(b);n+=len(b)\n"
            "print(n*8/(time.time()-t)/1e9)"
        )
        rx = subprocess.Popen(["ip", "netns", "exec", self.ns[1], sys.executable, "-c", sink])
        try:
            for _ in range(50):
                try:
                    out = subprocess.run(
                        ["ip", "netns", "exec", self.ns[0], sys.executable, "-c", source],
                        capture_output=True,
                        text=True,
                        timeout=60,
                        check=True,
                    )
                    return float(out.stdout.strip())
                except subprocess.CalledProcessError:
                    time.sleep(0.1)  # the sink is not listening yet
            raise RuntimeError("could not measure the link")
        finally:
            rx.kill()
            rx.wait()

    def __enter__(self) -> Link:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _bits_per_s(rate: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for unit, factor in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * factor
    raise ValueError(f"rate {rate!r}: give it as <n>kbit, <n>mbit or <n>gbit")


def run_job(link: Link, model: str, hooks: list, warmup: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="cring-hooks-") as d:
        result = Path(d) / "result.json"
        port, gloo_port = 29000 + os.getpid() % 2000, 31000 + os.getpid() % 2000
        procs = []
        for rank, ns in enumerate(link.ns):
            env = dict(
                os.environ,
                CRING_RANK=str(rank),
                CRING_SIZE="2",
                CRING_ADDR=link.addr[0],
                CRING_PORT=str(port),
                CRING_TRANSPORT="tcp",
                CRING_TIMEOUT_SECONDS="600",
                OMP_NUM_THREADS="1",
                GLOO_SOCKET_IFNAME=link.dev[rank],  # gloo's own row: the shaped link too
                PYTHONPATH=str(ROOT / "python"),
            )
            cmd = [
                "ip", "netns", "exec", ns, sys.executable, __file__, "--worker",
                "--model", model, "--hooks", *hooks, "--warmup", str(warmup),
                "--steps", str(steps), "--result", str(result), "--addr", link.addr[0],
                "--gloo-port", str(gloo_port),
            ]  # fmt: skip
            procs.append(subprocess.Popen(cmd, env=env))
        try:
            codes = [p.wait(timeout=3600) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if codes != [0, 0]:
            raise SystemExit(f"{model} over {link.rate}: ranks exited {codes}")
        return json.loads(result.read_text())


# ---- the report ----------------------------------------------------------------------------------


def report(results: dict) -> str:
    lines = [
        "| link | model | hook | MB sent per step | bytes vs none | step ms | speed-up | "
        "compute ms | predicted ms | predicted speed-up |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (rate, measured, model), rows in results.items():
        base = rows["none"]
        for name, row in rows.items():
            if name == "gloo":
                lines.append(
                    f"| {rate} ({measured:.2f}) | {model} | gloo allreduce | | | "
                    f"{row['step_s'] * 1e3:.0f} | {base['step_s'] / row['step_s']:.2f}x | | | |"
                )
                continue
            ratio = row["bytes"] / base["bytes"]
            compute = row.get("compute_s", 0.0)
            predicted = base["step_s"] * ratio + compute
            step = row["step_s"]
            lines.append(
                f"| {rate} ({measured:.2f}) | {model} | {name} | {row['bytes'] / 1e6:.2f} | "
                f"{ratio:.4f} | {step * 1e3:.0f} | {base['step_s'] / step:.2f}x | "
                f"{compute * 1e3:.0f} | {predicted * 1e3:.0f} | {base['step_s'] / predicted:.2f}x |"
            )
    return "\n".join(lines)


def plot(results: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    keys = list(results)
    cols = 2 if len(keys) > 1 else 1
    nrows = (len(keys) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(6.2 * cols, 3.8 * nrows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        rate, measured, model = key
        rows = results[key]
        names = [n for n in rows if n != "gloo"] + ["gloo"]
        x = list(range(len(names)))
        steps = [rows[n]["step_s"] * 1e3 for n in names]
        computes = [rows[n].get("compute_s", 0.0) * 1e3 for n in names]
        ax.bar([i - 0.2 for i in x], steps, 0.4, color="#4477aa", label="step over the link")
        ax.bar([i + 0.2 for i in x], computes, 0.4, color="#ee6677", label="the hook's compute")
        ax.set_xticks(x, names, fontsize=8)
        ax.set_title(f"{model}, {rate} tbf ({measured:.2f} Gbit/s measured)", fontsize=9)
        ax.set_ylabel("ms per step (2 ranks)", fontsize=8)
        for i, n in enumerate(names):
            if n != "gloo":
                ax.annotate(
                    f"{rows[n]['bytes'] / rows['none']['bytes']:.3g}x bytes",
                    (i - 0.2, steps[i]),
                    ha="center",
                    va="bottom",
                    fontsize=7,
                )
    for ax in list(axes.flat)[len(keys) :]:
        ax.axis("off")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", nargs="+", default=["1gbit", "10gbit"])
    parser.add_argument("--models", nargs="+", default=["resnet50", "transformer"])
    parser.add_argument("--hooks", nargs="+", default=list(HOOKS))
    parser.add_argument("--warmup", type=int, default=START_ITER + 1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--plot", default=None, help="write a figure here (PNG)")
    parser.add_argument("--json", default=None, help="write the figures here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--addr", help=argparse.SUPPRESS)
    parser.add_argument("--gloo-port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if "none" not in args.hooks:
        args.hooks.insert(0, "none")
    # a timeout's SIGTERM unwinds too, so the namespaces and the ranks go
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("comm_hooks.py: terminated"))
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing or os.geteuid() != 0:
        raise SystemExit(f"needs root and iproute2 (missing: {missing or 'root'})")
    results = {}
    for rate in args.rates:
        with Link(rate) as link:
            measured = link.measure_gbit()
            print(f"link {rate}: one TCP stream measures {measured:.2f} Gbit/s", flush=True)
            for model in args.models:
                rows = run_job(link, model, args.hooks, args.warmup, args.steps)
                results[(rate, measured, model)] = rows
                print(report({(rate, measured, model): rows}), flush=True)
    print()
    print(report(results))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                [{"rate": k[0], "gbit": k[1], "model": k[2], "rows": v} for k, v in results.items()]
            )
        )
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()

"""Multi-host collectives on simulated hosts (tests/simhosts.py): flat ring vs
hierarchical vs recursive doubling, in the same run, and the alpha-beta
model of docs/scaling.md checked against them.

    python benchmarks/multihost.py               # the acceptance cases + model
    python benchmarks/multihost.py --crossover   # tree vs ring by size, P=2,4,8
    python benchmarks/multihost.py --plot out.png

Prints tables; with --plot writes a figure when matplotlib is installed (and
says so when it is not). Needs what tests/simhosts.py needs (root or user
namespaces). Timings on a shared machine are noisy: each job reports its
fastest call, and every comparison runs its sides alternately (three times)
and keeps each side's best.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import simhosts  # noqa: E402
from multihost_ranks import run  # noqa: E402

MIB = 1 << 20
FLAT_RING = {"CRING_HIERARCHICAL": "0", "CRING_TREE_MAX_BYTES": "0"}  # the ring of before
FLAT_TREE = {"CRING_HIERARCHICAL": "0"}
HIER = {}


def bench(nhosts, per_host, spec, env, layout="block"):
    """[(bytes, seconds, tcp bytes sent per rank per call)] for one job: the
    slowest rank's fastest call (the machine is shared: the fastest call is
    the one least disturbed by other work) and the busiest rank's TCP bytes."""
    with tempfile.TemporaryDirectory(prefix="cring-mh-") as d:
        codes, results, logs = run(
            nhosts,
            per_host,
            "multihost.py",
            ["bench", d, spec],
            Path(d),
            env=env,
            layout=layout,
            timeout_s=300,
        )
        if codes != [0] * len(codes):
            raise SystemExit(f"benchmark job failed ({codes}):\n{logs[-4000:]}")
    rows = []
    for i, row in enumerate(results[0]["rows"]):
        t = max(r["rows"][i]["min_s"] for r in results)
        b = max(r["rows"][i]["per_call"]["tcp_bytes_sent"] for r in results)
        rows.append((row["bytes"], t, b))
    return rows, results[0]["transport"]


def best_of(nhosts, per_host, spec, envs, repeats=3):
    """Run each env alternately `repeats` times; keep each one's best time."""
    best = {}
    for _ in range(repeats):
        for label, env in envs.items():
            rows, transport = bench(nhosts, per_host, spec, env)
            old = best.get(label)
            if old is None:
                best[label] = (rows, transport)
            else:
                merged = [(a[0], min(a[1], b[1]), a[2]) for a, b in zip(old[0], rows)]
                best[label] = (merged, transport)
    return best


# ---- the model (docs/scaling.md) ---------------------------------------------------------
# n bytes, P = H * L ranks (H hosts, L ranks each); alpha per message, beta per
# byte on a host's link, shm_alpha / shm_beta for a local allreduce (reduce-
# scatter + allgather through shared memory, per byte of the vector).


def tree_steps(P):
    """Exchanges of recursive doubling: log2 of the largest power of two <= P,
    plus the fold and unfold when P is not a power of two."""
    if P <= 1:
        return 0
    pof2 = 1 << int(math.log2(P))
    return int(math.log2(pof2)) + (2 if pof2 != P else 0)


def ring_allreduce(P, n, alpha, beta):
    return 2 * (P - 1) * alpha + 2 * (P - 1) / P * n * beta if P > 1 else 0.0


def tree_allreduce(P, n, alpha, beta):
    return tree_steps(P) * (alpha + n * beta)


def p2p_allreduce(P, n, alpha, beta, tree_max=65536):
    return tree_allreduce(P, n, alpha, beta) if n <= tree_max else ring_allreduce(P, n, alpha, beta)


def hier_allreduce(H, L, n, alpha, beta, shm_alpha, shm_beta, tree_max=65536):
    """Local reduce-scatter, L cross allreduces of n/L bytes at once (sharing
    the host's link: each at beta * L), local allgather. Small vectors: local
    allreduce, then every local rank the whole vector across."""
    if n <= tree_max or n < L:
        return shm_alpha + n * shm_beta + p2p_allreduce(H, n, alpha, beta * L, tree_max)
    return shm_alpha + n * shm_beta + p2p_allreduce(H, n / L, alpha, beta * L, tree_max)


def sim_factor(P, cores):
    """Simulated hosts share the machine's cores: with more ranks than cores,
    every rank gets cores / P of one, and a term in which every rank works at
    once (a bandwidth term: loopback TCP and shared memory are CPU copies)
    stretches by P / cores."""
    return max(1.0, P / cores)


def sim_hop(P, p, cores):
    """One TCP message's latency with P ranks on the cores: the part a rank
    spends on the CPU (syscalls, the copy of a few bytes) stretches by P / C;
    the part spent waiting (loopback delivery, the receiver's wake-up) does
    not, since a waiting rank sleeps and leaves its core to the others. Both
    parts are fitted: 2 ranks (no stretch) and 4 ranks (stretch 2)."""
    return p["alpha_wait"] + p["alpha_cpu"] * sim_factor(P, cores)


def sim_flat(P, n, p, cores):
    return p2p_allreduce(
        P, n, sim_hop(P, p, cores), sim_factor(P, cores) * p["beta"], p["tree_max"]
    )


def sim_hier(H, L, n, p, cores):
    """Local reduce-scatter and allgather through shared memory (every local
    rank busy: stretched), then the cross part over TCP. On one machine the
    "link" is not shared by the L local ranks: each cross flow is its own CPU
    copy, so the cross beta is beta (stretched), not L * beta. (An earlier
    rule, "a shared-memory step costs at least alpha when ranks outnumber
    cores", fitted a run under load 20-30 and over-predicted quiet runs.)"""
    f = sim_factor(H * L, cores)
    local = f * (p["shm_alpha"] + n * p["shm_beta"])
    cross_n = n if (n <= p["tree_max"] or n < L) else n / L
    return local + p2p_allreduce(H, cross_n, sim_hop(H * L, p, cores), f * p["beta"], p["tree_max"])


def fit(t2_small, t4_small, t4_big, t_shm_small, t_shm_big, n, cores):
    """The model's parameters from the calibration jobs: a 4-byte and an n-byte
    flat ring on 2 hosts x 2 ranks, a 4-byte ring on 2 hosts x 1 rank, and a
    4-byte and an n-byte allreduce through shared memory on 1 host x 2 ranks."""
    hop2 = t2_small / ring_allreduce(2, 0, 1, 0)  # 2 hops, no stretch
    hop4 = t4_small / ring_allreduce(4, 0, 1, 0)  # 6 hops, P = 4
    f4 = sim_factor(4, cores)
    alpha_cpu = max(0.0, (hop4 - hop2) / (f4 - 1)) if f4 > 1 else 0.0
    alpha_wait = max(0.0, hop2 - alpha_cpu)
    beta = (t4_big - ring_allreduce(4, 0, hop4, 0)) / (f4 * 1.5 * n)
    f2 = sim_factor(2, cores)
    return {
        "alpha_wait": alpha_wait,
        "alpha_cpu": alpha_cpu,
        "beta": beta,
        "shm_alpha": t_shm_small / f2,
        "shm_beta": (t_shm_big / f2) / n,
        "tree_max": 65536,
    }


def model_table(alpha=15e-6, shm_alpha=1e-6, shm_gbs=10.0, n=64 * MIB, vector=None):
    """The docs/scaling.md table: H hosts x 8 ranks at 25 and 100 Gbit/s."""
    L = 8
    shm_beta = 2 / (shm_gbs * 1e9)  # reduce-scatter + allgather: 2n bytes through memory
    print(f"alpha {alpha * 1e6:.0f} us, shared memory {shm_gbs:.0f} GB/s per rank, L = {L}")
    print(f"{'hosts':>6}{'Gbit/s':>8}{'n':>10}{'flat ring':>14}{'flat tree':>14}{'hier':>14}")
    for H in (8, 64, 512):
        P = H * L
        for gbit in (25, 100):
            beta = 8 / (gbit * 1e9)
            for nb in (4, n) if vector is None else (vector(P),):
                ring = ring_allreduce(P, nb, alpha, beta)
                tree = tree_allreduce(P, nb, alpha, beta)
                hier = hier_allreduce(H, L, nb, alpha, beta, shm_alpha, shm_beta)
                print(
                    f"{H:>6}{gbit:>8}{nb:>10}{ring * 1e3:>12.3f}ms{tree * 1e3:>12.3f}ms"
                    f"{hier * 1e3:>12.3f}ms"
                )


# ---- cases --------------------------------------------------------------------------------


def acceptance(cores):
    out = {}
    print("== 64 MiB float32 allreduce, 2 hosts x 2 ranks: flat ring vs hierarchical")
    best = best_of(2, 2, f"{64 * MIB}:5", {"flat": FLAT_RING, "hier": HIER})
    (_, t_flat, b_flat), (_, t_hier, b_hier) = best["flat"][0][0], best["hier"][0][0]
    print(f"{'':8}{'transport':>16}{'time ms':>10}{'TCP MiB sent/rank':>20}")
    print(f"{'flat':8}{best['flat'][1]:>16}{t_flat * 1e3:>10.1f}{b_flat / MIB:>20.1f}")
    print(f"{'hier':8}{best['hier'][1]:>16}{t_hier * 1e3:>10.1f}{b_hier / MIB:>20.1f}")
    print(
        f"hier/flat: TCP bytes {b_hier / b_flat:.2f}x (target <= 0.55), "
        f"time {t_hier / t_flat:.2f}x (target <= 0.8)\n"
    )
    out["2x2_64MiB"] = {"flat": t_flat, "hier": t_hier}

    print("== 4-byte allreduce, 4 hosts x 2 ranks (P=8): ring vs recursive doubling")
    best = best_of(4, 2, "4:300", {"ring": FLAT_RING, "tree": FLAT_TREE, "hier": HIER})
    t = {k: v[0][0][1] for k, v in best.items()}
    for k in ("ring", "tree", "hier"):
        print(f"{k:8}{best[k][1]:>16}{t[k] * 1e6:>10.0f} us")
    print(
        f"tree/ring {t['tree'] / t['ring']:.2f}x, hier/ring {t['hier'] / t['ring']:.2f}x "
        "(target <= 0.6)\n"
    )
    out["4x2_4B"] = t

    print("== the model: fit alpha (its CPU and its waiting part), beta on the 2x1 and")
    print("   2x2 flat rings, the shared-memory terms on 1 host x 2 ranks, then predict")
    print("   the 2x2 hierarchical and 4x2 times (all six jobs run in turn, three rounds,")
    print("   each keeps its fastest call: the same load)")
    n = 64 * MIB
    spec = f"4:300,{n}:3"
    jobs = {
        ("2x1", "flat"): (2, 1, FLAT_RING),
        ("2x2", "flat"): (2, 2, FLAT_RING),
        ("1x2", "shm"): (1, 2, HIER),
        ("2x2", "hier"): (2, 2, HIER),
        ("4x2", "flat"): (4, 2, FLAT_RING),
        ("4x2", "hier"): (4, 2, HIER),
    }
    best = {}
    for _ in range(3):
        for key, (H, L, env) in jobs.items():
            rows, _ = bench(H, L, spec, env)
            old = best.get(key, rows)
            best[key] = [(a[0], min(a[1], b[1]), a[2]) for a, b in zip(old, rows)]
    two, cal, shm = best[("2x1", "flat")], best[("2x2", "flat")], best[("1x2", "shm")]
    params = fit(two[0][1], cal[0][1], cal[1][1], shm[0][1], shm[1][1], n, cores)
    print(
        f"alpha {params['alpha_wait'] * 1e6:.1f} us waiting + {params['alpha_cpu'] * 1e6:.1f} us"
        f" on the CPU (stretched), beta {1 / params['beta'] / 1e9:.2f} GB/s, shared memory "
        f"{params['shm_alpha'] * 1e6:.1f} us + {1 / params['shm_beta'] / 1e9:.2f} GB/s, "
        f"{cores} cores\n"
    )
    checks = []
    for (hosts, label), rows in best.items():
        if (hosts, label) in (("2x1", "flat"), ("2x2", "flat"), ("1x2", "shm")):
            continue
        H, L, _ = jobs[(hosts, label)]
        for nb, t_meas, _ in rows:
            if label == "flat":
                pred = sim_flat(H * L, nb, dict(params, tree_max=0), cores)
            else:
                pred = sim_hier(H, L, nb, params, cores)
            checks.append((hosts, label, nb, t_meas, pred))
    print(f"{'hosts':8}{'table':8}{'bytes':>10}{'measured ms':>14}{'model ms':>12}{'error':>8}")
    for hosts, label, nb, t_meas, pred in checks:
        err = (pred - t_meas) / t_meas
        print(f"{hosts:8}{label:8}{nb:>10}{t_meas * 1e3:>14.3f}{pred * 1e3:>12.3f}{err:>+8.0%}")
    out["model"] = checks
    return out


def crossover():
    sizes = [4, 1024, 4096, 16384, 65536, 262144, 1 << 20]
    spec = ",".join(f"{s}:{max(5, 200 // (1 + s // 16384))}" for s in sizes)
    table = {}
    for P in (2, 4, 8):
        for where, (nh, per) in {"hosts": (P, 1), "one host": (1, P)}.items():
            envs = {
                "ring": {"CRING_TRANSPORT": "tcp", "CRING_TREE_MAX_BYTES": "0"},
                "tree": {"CRING_TRANSPORT": "tcp", "CRING_TREE_MAX_BYTES": str(1 << 30)},
            }
            best = best_of(nh, per, spec, envs, repeats=1)
            table[(P, where)] = {k: [r[1] for r in v[0]] for k, v in best.items()}
    print(f"{'P':>3} {'where':10}" + "".join(f"{s:>10}" for s in sizes) + "   (tree/ring time)")
    for (P, where), t in table.items():
        ratios = [a / b for a, b in zip(t["tree"], t["ring"])]
        print(f"{P:>3} {where:10}" + "".join(f"{r:>10.2f}" for r in ratios))
    return sizes, table


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--crossover", action="store_true", help="tree vs ring by size")
    ap.add_argument("--plot", help="write a figure here (needs matplotlib)")
    ap.add_argument("--cores", type=int, default=None, help="cores the ranks share")
    ap.add_argument("--model-table", action="store_true", help="print docs/scaling.md's table")
    args = ap.parse_args()
    if args.model_table:
        model_table()
        print("negotiation round (a MIN over P + 64 bytes):")
        model_table(vector=lambda P: P + 64)
        return
    why = simhosts.unavailable()
    if why:
        raise SystemExit(f"simulated hosts unavailable: {why}")
    import os

    cores = args.cores or len(os.sched_getaffinity(0))
    result = crossover() if args.crossover else acceptance(cores)
    if args.plot:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib is not installed: no plot")
            return
        fig, ax = plt.subplots(figsize=(7, 4))
        if args.crossover:
            sizes, table = result
            for (P, where), t in table.items():
                ax.plot(
                    sizes,
                    [a / b for a, b in zip(t["tree"], t["ring"])],
                    marker="o",
                    label=f"P={P} {where}",
                )
            ax.axhline(1.0, color="gray", lw=0.5)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("bytes")
            ax.set_ylabel("tree time / ring time")
        else:
            checks = result["model"]
            labels = [f"{h} {lab} {nb}B" for h, lab, nb, _, _ in checks]
            x = range(len(checks))
            ax.bar([i - 0.2 for i in x], [c[3] * 1e3 for c in checks], 0.4, label="measured")
            ax.bar([i + 0.2 for i in x], [c[4] * 1e3 for c in checks], 0.4, label="model")
            ax.set_xticks(list(x), labels, rotation=30, ha="right", fontsize=7)
            ax.set_yscale("log")
            ax.set_ylabel("ms")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()

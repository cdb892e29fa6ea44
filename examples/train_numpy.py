"""Data-parallel training with NumPy and cring: a small two-layer classifier
on synthetic data. Each rank trains on its own shard; gradients are averaged
with cring.allreduce_ after every step, so all ranks keep identical weights.

    cringrun -np 2 python examples/train_numpy.py
"""

import argparse
import time

import numpy as np

import cring


def make_data(n: int, dim: int, classes: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    centers = rng.normal(0, 2.0, (classes, dim))
    labels = rng.integers(0, classes, n)
    x = centers[labels] + rng.normal(0, 1.0, (n, dim))
    return x.astype(np.float32), labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=60_000)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch", type=int, default=256, help="per-rank batch size")
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()

    cring.init()
    rank, size = cring.rank(), cring.size()
    dim, hidden, classes = 32, 64, 10
    x_all, y_all = make_data(args.samples, dim, classes)
    x, y = x_all[rank::size], y_all[rank::size]  # this rank's shard

    rng = np.random.default_rng(1234 + rank)  # deliberately different on every rank...
    params = {
        "w1": rng.normal(0, 0.1, (dim, hidden)).astype(np.float32),
        "b1": np.zeros(hidden, np.float32),
        "w2": rng.normal(0, 0.1, (hidden, classes)).astype(np.float32),
        "b2": np.zeros(classes, np.float32),
    }
    for name, p in params.items():  # ...until rank 0's weights are broadcast
        cring.broadcast_(p, root_rank=0, name=name)

    steps = len(x) // args.batch
    start = time.perf_counter()
    for epoch in range(args.epochs):
        order = np.random.default_rng(epoch * size + rank).permutation(len(x))
        loss_sum = np.zeros(1, np.float64)
        for step in range(steps):
            idx = order[step * args.batch:(step + 1) * args.batch]
            xb, yb = x[idx], y[idx]
            h = np.maximum(xb @ params["w1"] + params["b1"], 0)
            logits = h @ params["w2"] + params["b2"]
            logits -= logits.max(1, keepdims=True)
            prob = np.exp(logits)
            prob /= prob.sum(1, keepdims=True)
            loss_sum += -np.log(prob[np.arange(len(yb)), yb] + 1e-12).mean()
            d_logits = prob
            d_logits[np.arange(len(yb)), yb] -= 1
            d_logits /= len(yb)
            grads = {"w2": h.T @ d_logits, "b2": d_logits.sum(0)}
            dh = (d_logits @ params["w2"].T) * (h > 0)
            grads["w1"] = xb.T @ dh
            grads["b1"] = dh.sum(0)
            for name, g in grads.items():
                cring.allreduce_(g, op=cring.Average, name=f"grad.{name}")
                params[name] -= args.lr * g
        cring.allreduce_(loss_sum, op=cring.Average, name="loss")
        if rank == 0:
            print(f"epoch {epoch + 1}: mean loss {loss_sum[0] / steps:.4f}", flush=True)
    elapsed = time.perf_counter() - start

    h = np.maximum(x_all @ params["w1"] + params["b1"], 0)
    accuracy = float(((h @ params["w2"] + params["b2"]).argmax(1) == y_all).mean())
    checksum = np.array([sum(float(np.abs(p).sum()) for p in params.values())])
    every = cring.allgather(checksum)
    same = bool(np.all(every == every[0]))
    samples = steps * args.batch * size * args.epochs
    if rank == 0:
        print(f"trained on {size} ranks over {cring.transport()}: {samples / elapsed:,.0f} "
              f"samples/s, accuracy {accuracy:.3f}, weights identical on all ranks: {same}")
    cring.shutdown()
    if not same:
        raise SystemExit("weights differ between ranks")


if __name__ == "__main__":
    main()

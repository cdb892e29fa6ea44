"""Worker: op=Adasum through every entry point (cring.allreduce, grouped and
fused submissions, cring.torch.allreduce, DistributedOptimizer, Lightning's
reduce) against a NumPy reference of the pairwise tree; at a size that is not
a power of two, the error every rank must raise. Writes <outdir>/rank<R>.json
with the number of cases and every failure; exits 1 if any case failed."""

import json
import sys
import traceback

import numpy as np
import torch

import cring
import cring.torch as hvd

RTOL = {"float64": 1e-12, "float32": 2e-5, "bfloat16": 4e-2, "float16": 1e-2}


def combine(a, b):
    """The pairwise Adasum of two float64 vectors (Maleki et al.)."""
    dot, na, nb = float(a @ b), float(a @ a), float(b @ b)
    tiny = np.sqrt(np.finfo(np.float64).tiny)
    ca = 1 - dot / (2 * na) if na >= tiny else 1.0
    cb = 1 - dot / (2 * nb) if nb >= tiny else 1.0
    return ca * a + cb * b


def tree(vectors):
    """adasum(adasum(v0, v1), adasum(v2, v3)) ... for a power-of-two count."""
    level = [np.asarray(v, np.float64).ravel() for v in vectors]
    while len(level) > 1:
        level = [combine(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]


def data(rank, n, salt):
    rng = np.random.default_rng([rank, n, salt])
    return rng.standard_normal(n) + (0.5 if salt % 2 else 0.0)


def as_f64(x):
    if isinstance(x, torch.Tensor):
        return x.detach().to(torch.float64).numpy().ravel()
    return np.asarray(x, np.float64).ravel()


def close(got, want, dtype):
    got, want = as_f64(got), np.asarray(want, np.float64).ravel()
    if got.shape != want.shape:
        return f"shape {got.shape} != {want.shape}"
    scale = max(1.0, float(np.abs(want).max(initial=0.0)))
    err = float(np.abs(got - want).max(initial=0.0))
    if err > RTOL[dtype] * scale:
        return f"max error {err:.3g} (scale {scale:.3g}) over tolerance for {dtype}"
    return None


def make(values, dtype):
    if dtype == "bfloat16":
        return torch.tensor(values, dtype=torch.float64).to(torch.bfloat16)
    return np.asarray(values).astype(dtype)


def main():
    outdir, mode = sys.argv[1], sys.argv[2]
    cring.init()
    hvd.init()
    rank, size = cring.rank(), cring.size()
    cases, failures = 0, []

    def check(label, fn):
        nonlocal cases
        cases += 1
        try:
            problem = fn()
        except Exception:
            problem = traceback.format_exc(limit=4)
        if problem:
            failures.append(f"{label}: {problem}")

    if mode == "not_power":

        def refused():
            try:
                cring.allreduce(np.ones(4, np.float32), op=cring.Adasum, name="g")
            except ValueError as e:
                text = str(e)
                if "power-of-two" in text and str(size) in text and "'g'" in text:
                    return None
                return f"message {text!r}"
            return "no error"

        check("non-power-of-two size", refused)

        def optimizer_refused():
            model = torch.nn.Linear(2, 1)
            try:
                hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum)
            except ValueError as e:
                return None if "power-of-two" in str(e) else f"message {e}"
            return "no error"

        check("DistributedOptimizer(op=Adasum) refused", optimizer_refused)
        check(
            "communicator still usable",
            lambda: close(cring.allreduce(np.ones(3), op=cring.Sum), np.full(3, size), "float64"),
        )
        finish(outdir, rank, size, cases, failures)
        return

    # 1. single tensors, each dtype and several lengths, against the tree
    for dtype in ("float64", "float32", "bfloat16", "float16"):
        for n in (0, 1, 7, 1000, 100_003):
            vectors = [make(data(q, n, 1), dtype) for q in range(size)]
            want = tree([as_f64(v) for v in vectors])
            check(
                f"allreduce {dtype} n={n}",
                lambda v=vectors, w=want, d=dtype: close(
                    cring.allreduce(v[rank], op=cring.Adasum), w, d
                ),
            )

    # 2. several tensors fused in one batch: each gets its own coefficients
    lengths = [5, 300, 1, 64]
    per_rank = [[data(q, n, 2 + i) * (i + 1) for i, n in enumerate(lengths)] for q in range(size)]
    wants = [tree([per_rank[q][i] for q in range(size)]) for i in range(len(lengths))]

    def grouped():
        outs = cring.grouped_allreduce(
            [t.astype(np.float32) for t in per_rank[rank]], op=cring.Adasum
        )
        return next((p for p in (close(o, w, "float32") for o, w in zip(outs, wants)) if p), None)

    def fused_async():
        mine = [t.copy() for t in per_rank[rank]]
        handles = [
            cring.allreduce_async_(t, op=cring.Adasum, name=f"fused.{i}")
            for i, t in enumerate(mine)
        ]
        for h in handles:
            cring.synchronize(h)
        return next((p for p in (close(o, w, "float64") for o, w in zip(mine, wants)) if p), None)

    def one_buffer_differs():
        # the same data as one tensor is a different (single-coefficient) result:
        # proof that the fused batch above did not mix the tensors
        whole = tree([np.concatenate(per_rank[q]) for q in range(size)])
        split = np.concatenate(wants)
        if np.allclose(whole, split, rtol=1e-6):
            return "concatenated reference equals the per-tensor one: the test proves nothing"
        return close(
            cring.allreduce(np.concatenate(per_rank[rank]), op=cring.Adasum), whole, "float64"
        )

    check("grouped_allreduce keeps per-tensor coefficients", grouped)
    check("fused async submissions keep per-tensor coefficients", fused_async)
    check("one concatenated tensor", one_buffer_differs)

    # 3. orthogonal gradients add, equal gradients average (2 ranks)
    if size == 2:

        def orthogonal():
            g = np.zeros(6)
            g[rank * 3 : rank * 3 + 3] = [1.0, -2.0, 0.5]
            got = cring.allreduce(g, op=cring.Adasum)
            want = np.array([1.0, -2.0, 0.5, 1.0, -2.0, 0.5])
            return None if np.allclose(got, want, rtol=0, atol=1e-15) else f"got {got}"

        def equal():
            g = np.array([3.0, -1.0, 2.0, 0.25])
            got = cring.allreduce(g, op=cring.Adasum)
            return None if np.allclose(got, g, rtol=1e-15) else f"got {got}, not the average {g}"

        check("orthogonal gradients sum", orthogonal)
        check("equal gradients average", equal)

    # 4. cring.torch: hvd.allreduce(op=hvd.Adasum) and its in-place and grouped forms
    vectors = [data(q, 50, 9) for q in range(size)]
    want = tree(vectors)
    t = torch.tensor(vectors[rank], dtype=torch.float32)
    check("hvd.allreduce", lambda: close(hvd.allreduce(t, op=hvd.Adasum), want, "float32"))
    check(
        "hvd.allreduce_", lambda: close(hvd.allreduce_(t.clone(), op=hvd.Adasum), want, "float32")
    )
    check(
        "hvd.grouped_allreduce",
        lambda: close(hvd.grouped_allreduce([t], op=hvd.Adasum)[0], want, "float32"),
    )

    # 5. DistributedOptimizer(op=Adasum): parameters become old + adasum(deltas)
    def optimizer():
        torch.manual_seed(0)  # the same initial weights on every rank
        model = torch.nn.Linear(4, 3)
        start = [p.detach().clone() for p in model.parameters()]
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=model.named_parameters(),
            op=hvd.Adasum,
        )
        x = torch.tensor(data(rank, 8, 11), dtype=torch.float32).reshape(2, 4)
        model(x).pow(2).sum().backward()
        grads = [p.grad.detach().clone() for p in model.parameters()]
        opt.step()
        for (name, p), p0, g in zip(model.named_parameters(), start, grads):
            deltas = hvd.allgather((-0.1 * g).reshape(1, -1))  # every rank's step
            expected = p0.double().numpy().ravel() + tree(deltas.double().numpy())
            problem = close(p, expected, "float32")
            if problem:
                return f"{name}: {problem}"
        if type(opt).__name__ != "SGD" or not isinstance(opt, torch.optim.SGD):
            return f"wrapped optimizer is a {type(opt).__name__}"
        return None

    check("DistributedOptimizer(op=Adasum)", optimizer)

    # 6. Lightning's reduce with reduce_op=cring.Adasum
    def lightning():
        from cring.lightning import _common

        x = torch.tensor(vectors[rank], dtype=torch.float64)
        return close(_common.reduce(x, reduce_op=cring.Adasum), want, "float64")

    check("lightning reduce(reduce_op=cring.Adasum)", lightning)

    # 7. what Adasum refuses, with messages naming the tensor
    def refuses_ints():
        try:
            cring.allreduce(np.ones(3, np.int32), op=cring.Adasum, name="ints")
        except TypeError as e:
            return None if "'ints'" in str(e) and "int32" in str(e) else f"message {e}"
        return "no error"

    check("integer tensor refused", refuses_ints)
    finish(outdir, rank, size, cases, failures)


def finish(outdir, rank, size, cases, failures):
    with open(f"{outdir}/rank{rank}.json", "w") as f:
        json.dump({"rank": rank, "size": size, "cases": cases, "failures": failures}, f)
    cring.barrier()  # the last check communicates nothing: leave together
    cring.shutdown()
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()

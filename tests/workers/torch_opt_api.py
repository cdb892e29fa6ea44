"""Worker: DistributedOptimizer's guards and controls, sparse gradients, and
broadcast_parameters + broadcast_optimizer_state from root rank `argv[2]`.
Writes <outdir>/rank<R>.json with what the test compares across ranks."""

import gc
import sys
import warnings

import torch
import torch.nn.functional as F

import cring
from cring.torch.optimizer import (
    DistributedOptimizer,
    broadcast_optimizer_state,
    broadcast_parameters,
)

from engine_common import Checks
from torch_opt_common import Net, batch, jsonable, vector

torch.set_num_threads(1)
cring.init()
rank, size = cring.rank(), cring.size()
root = int(sys.argv[2])
checks = Checks(sys.argv[1], rank, size)


def raises(exc, fn, match=""):
    try:
        fn()
    except exc as e:
        return None if match in str(e) else f"{exc.__name__} without {match!r}: {e}"
    return f"no {exc.__name__}"


def plain_sgd(model, lr=0.1):
    return torch.optim.SGD(model.parameters(), lr=lr)


def arguments():
    """Bad arguments raise on the calling rank, before anything is communicated."""
    m = Net(seed=1)
    named = list(m.named_parameters())
    problems = [
        raises(
            ValueError,
            lambda: DistributedOptimizer(
                plain_sgd(m), named_parameters=named + [(named[0][0], named[1][1])]
            ),
            "duplicates",
        ),
        raises(
            ValueError,
            lambda: DistributedOptimizer(plain_sgd(m), named_parameters=[p for _, p in named]),
            "tuples",
        ),
        raises(
            ValueError,
            lambda: DistributedOptimizer(plain_sgd(m), named_parameters=named[1:]),
            "not named",
        ),
        raises(
            ValueError,
            lambda: DistributedOptimizer(plain_sgd(m), op=cring.Sum, gradient_predivide_factor=2.0),
            "predivide",
        ),
        raises(
            ValueError,
            lambda: DistributedOptimizer(plain_sgd(m), op=cring.Adasum, groups=2),
            "Adasum",
        ),
        raises(ValueError, lambda: DistributedOptimizer(plain_sgd(m), groups=-1)),
        raises(
            ValueError,
            lambda: DistributedOptimizer(plain_sgd(m), groups=[[m.extra], [m.extra]]),
            "once",
        ),
        raises(ValueError, lambda: DistributedOptimizer(plain_sgd(m), backward_passes_per_step=0)),
        raises(TypeError, lambda: DistributedOptimizer(object())),
    ]
    return "; ".join(p for p in problems if p) or None


def wrapper_is_the_optimizer():
    """isinstance, the class name, state_dict and the shared param_groups."""
    m = Net(seed=1)
    adam = torch.optim.Adam(m.parameters(), lr=0.01)
    opt = DistributedOptimizer(adam, named_parameters=m.named_parameters())
    if not isinstance(opt, torch.optim.Adam) or type(opt).__name__ != "Adam":
        return f"wrapped optimizer is a {type(opt)}"
    x, y = batch(0, 0, rank)
    F.mse_loss(m(x, torch.full((4,), rank)), y).backward()
    opt.step()
    sd = opt.state_dict()
    # every trainable parameter (index 0 is the frozen one) has state, `extra` too: on
    # ranks but 0 it has no gradient of its own and was given the reduced one
    if sorted(sd["state"]) != list(range(1, 8)) or float(sd["state"][1]["step"]) != 1.0:
        return f"state_dict after one step: {sd['state'].keys()}"
    opt.param_groups[0]["lr"] = 0.5  # an LR schedule on the wrapper reaches the optimizer
    if adam.param_groups[0]["lr"] != 0.5:
        return "param_groups are not shared with the wrapped optimizer"
    fresh = torch.optim.Adam(m.parameters(), lr=0.01)
    fresh.load_state_dict(sd)
    return None


def zero_grad_while_in_flight():
    m = Net(seed=1)
    opt = DistributedOptimizer(plain_sgd(m), named_parameters=m.named_parameters())
    x, y = batch(0, 0, rank)
    F.mse_loss(m(x, torch.full((4,), rank)), y).backward()
    problem = raises(AssertionError, opt.zero_grad, "before optimizer.step()")
    opt.step()
    opt.zero_grad()  # fine once the step has synchronized
    # dropping the optimizer removes its hooks: a new one on the same model works
    del opt
    gc.collect()
    # with two backward passes per step, zeroing between them is refused too
    opt2 = DistributedOptimizer(
        plain_sgd(m), named_parameters=m.named_parameters(), backward_passes_per_step=2
    )
    F.mse_loss(m(x, torch.full((4,), rank)), y).backward()
    problem2 = raises(AssertionError, opt2.zero_grad)
    F.mse_loss(m(x, torch.full((4,), rank)), y).backward()
    opt2.step()
    opt2.zero_grad()
    return problem or problem2


def too_many_backwards():
    m = Net(seed=1)
    opt = DistributedOptimizer(plain_sgd(m), named_parameters=m.named_parameters())
    x, y = batch(0, 0, rank)
    F.mse_loss(m(x, torch.full((4,), rank)), y).backward()
    problem = raises(
        AssertionError, lambda: F.mse_loss(m(x, torch.full((4,), rank)), y).backward(), "more than"
    )
    opt.synchronize()  # what the first backward started still completes
    return problem


def skip_synchronize():
    """synchronize(), clip the reduced gradients, step() inside
    skip_synchronize(): the step uses the clipped average (computed here from
    every rank's data), and warns only when skip_synchronize is left out."""
    m = Net(seed=7)
    opt = DistributedOptimizer(plain_sgd(m, lr=0.5), named_parameters=m.named_parameters())
    ref = Net(seed=7)
    grads = []
    for r in range(size):
        ref.zero_grad()
        x, y = batch(0, 0, r)
        F.mse_loss(ref(x, torch.full((4,), r)), y).backward()
        grads.append(
            [
                torch.zeros_like(p) if p.grad is None else p.grad.clone()
                for p in ref.parameters()
                if p.requires_grad
            ]
        )
    avg = [sum(g) / size for g in zip(*grads)]
    norm = torch.sqrt(sum((g * g).sum() for g in avg))
    clip = 0.01 / (float(norm) + 1e-6)  # as clip_grad_norm_ computes it
    expected = [
        p.detach() - 0.5 * g * clip
        for p, g in zip([p for p in ref.parameters() if p.requires_grad], avg)
    ]

    x, y = batch(0, 0, rank)
    F.mse_loss(m(x, torch.full((4,), rank)), y).backward()
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(m.parameters(), 0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with opt.skip_synchronize():
            opt.step()
    if caught:
        return f"warning inside skip_synchronize: {caught[0].message}"
    got = [p.detach() for p in m.parameters() if p.requires_grad]
    err = max(float((a - b).abs().max()) for a, b in zip(got, expected))
    if err > 1e-12:
        return f"clipped step differs by {err}"
    opt.zero_grad()
    F.mse_loss(m(x, torch.full((4,), rank)), y).backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    if not any("skip_synchronize" in str(w.message) for w in caught):
        return "no warning for step() after synchronize() without skip_synchronize()"
    return None


class Bag(torch.nn.Module):
    def __init__(self, sparse):
        super().__init__()
        torch.manual_seed(3)
        self.emb = torch.nn.Embedding(10, 3, sparse=sparse).double()

    def forward(self, idx):
        return self.emb(idx).sum()


def sparse_gradients():
    """Sparse gradients, allgathered (Horovod's default) or with
    sparse_as_dense: the reduced gradient stays sparse and the step equals
    dense SGD on every rank's data."""
    idx = torch.tensor([rank, rank + 1, 7])
    ref = Bag(sparse=False)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    (sum(ref(torch.tensor([r, r + 1, 7])) for r in range(size)) / size).backward()
    ref_opt.step()
    for as_dense in (False, True):
        m = Bag(sparse=True)
        opt = DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.1),
            named_parameters=m.named_parameters(),
            sparse_as_dense=as_dense,
        )
        m(idx).backward()
        opt.synchronize()
        if not m.emb.weight.grad.is_sparse:
            return f"sparse_as_dense={as_dense}: the reduced gradient is no longer sparse"
        with opt.skip_synchronize():
            opt.step()
        err = float((m.emb.weight - ref.emb.weight).detach().abs().max())
        if err > 1e-12:
            return f"sparse_as_dense={as_dense}: the step differs by {err}"
    return None


class HalfCompressor:
    """A Horovod-style compressor object: compress(t) -> (t', ctx), decompress(t', ctx) -> t."""

    @staticmethod
    def compress(t):
        return t.to(torch.float16), t.dtype

    @staticmethod
    def decompress(t, dtype):
        return t.to(dtype)


class WireHalfCompressor(HalfCompressor):
    """As cring.torch's FP16Compressor: float32 is cast by the engine (`_wire`)."""

    _wire = cring.Compression.fp16


def compression():
    """float32 gradients through Compression.fp16 / bf16 (cast in the engine) and
    through Horovod-style compressors (one casting in Python, one naming the
    engine's wire format as cring.torch's do): the reduced gradients equal the exact
    average to 16-bit precision, and are identical on every rank."""
    ref = Net(seed=9).float()
    grads = []
    for r in range(size):
        ref.zero_grad()
        x, y = batch(0, 0, r)
        F.mse_loss(ref(x.float(), torch.full((4,), r)), y.float()).backward()
        grads.append(
            [
                torch.zeros_like(p) if p.grad is None else p.grad.clone()
                for p in ref.parameters()
                if p.requires_grad
            ]
        )
    exact = torch.cat([(sum(g) / size).reshape(-1) for g in zip(*grads)])
    problems = []
    for comp, tol in (
        (cring.Compression.fp16, 2e-3),
        (cring.Compression.bf16, 1.6e-2),
        (HalfCompressor(), 2e-3),
        (WireHalfCompressor, 2e-3),
    ):
        m = Net(seed=9).float()
        opt = DistributedOptimizer(
            plain_sgd(m), named_parameters=m.named_parameters(), compression=comp
        )
        x, y = batch(0, 0, rank)
        F.mse_loss(m(x.float(), torch.full((4,), rank)), y.float()).backward()
        opt.synchronize()
        got = torch.cat([p.grad.reshape(-1) for p in m.parameters() if p.requires_grad])
        every = cring.allgather(got[None])
        err = float((got - exact).abs().max() / exact.abs().max())
        if (
            got.dtype != torch.float32
            or err > tol
            or not all(torch.equal(e, every[0]) for e in every)
        ):
            problems.append(f"{comp!r}: dtype {got.dtype}, relative error {err:.2g}")
    return "; ".join(problems) or None


def snapshot(model, opt):
    sd = opt.state_dict()
    return {
        "params": vector(model).tolist(),
        "state": jsonable(sd["state"]),
        "groups": jsonable(
            [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
        ),
    }


states = {}


def broadcast_state(kind):
    """Ranks start from different weights, train a different number of steps
    on different data with different learning rates (so parameters, Adam's
    moments and step counts, SGD's momentum differ), then take root's. The
    optimizer is plain on even ranks and a DistributedOptimizer (that never
    stepped) on odd ones; on rank 2 (with 3 ranks) it is fresh (no state)."""
    m = Net(seed=50 + rank)
    if kind == "adam":
        opt = torch.optim.Adam(m.parameters(), lr=0.01 * (rank + 1), betas=(0.8, 0.9 + rank / 100))
    else:
        opt = torch.optim.SGD(m.parameters(), lr=0.1 * (rank + 1), momentum=0.5 + rank / 10)
    steps = 0 if rank == 2 else 2 + rank
    for step in range(steps):
        opt.zero_grad()
        x, y = batch(step, 0, rank)
        F.mse_loss(m(x, torch.full((4,), rank)), y).backward()
        opt.step()
    before = snapshot(m, opt)
    if rank % 2:
        opt = DistributedOptimizer(opt, named_parameters=m.named_parameters())
    broadcast_parameters(m.state_dict(), root_rank=root)
    broadcast_optimizer_state(opt, root_rank=root)
    after = snapshot(m, opt)
    states[kind] = {"before": before, "after": after}
    # training on from here keeps every rank identical
    if not rank % 2:
        opt = DistributedOptimizer(opt, named_parameters=m.named_parameters())
    for step in range(2):
        opt.zero_grad()
        x, y = batch(10 + step, 0, rank)
        F.mse_loss(m(x, torch.full((4,), rank)), y).backward()
        opt.step()
    states[kind]["trained_on"] = snapshot(m, opt)
    return None


def fresh_everywhere():
    """Nobody has state: nothing is created (no step is taken, nothing moves)."""
    m = Net(seed=50 + rank)
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    broadcast_parameters(list(m.named_parameters()), root_rank=root)
    p0 = vector(m).clone()
    broadcast_optimizer_state(opt, root_rank=root)
    if len(opt.state) or not torch.equal(vector(m), p0):
        return f"state after broadcasting an empty one: {len(opt.state)} entries"
    return None


def mismatched_layout():
    """Different parameter counts: ValueError on every rank, and the next call works."""
    m = Net(seed=1, depth=3 if rank == root else 4)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    problem = raises(ValueError, lambda: broadcast_optimizer_state(opt, root), "differ")
    cring.barrier()
    return problem


def _freeze_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(8, 1)).double()


def _train_freezing(how: str, steps: int = 5, freeze_at: int = 2) -> tuple:
    """AdamW with weight decay on rank-specific data; layer 0 frozen (requires_grad
    False) before step freeze_at, after the optimizer was built. how: "ddp" (torch's
    DistributedDataParallel over gloo), "cring", "cring_buckets" (gradient_as_bucket_view)."""
    from torch.nn.parallel import DistributedDataParallel

    model = _freeze_model(seed=4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    if how == "ddp":
        forward = DistributedDataParallel(model, find_unused_parameters=True)
    else:
        forward = model
        opt = DistributedOptimizer(
            opt,
            named_parameters=model.named_parameters(),
            gradient_as_bucket_view=how == "cring_buckets",
        )
    frozen_at = None
    for step in range(steps):
        if step == freeze_at:
            model[0].requires_grad_(False)
            frozen_at = [p.detach().clone() for p in model[0].parameters()]
        x, y = batch(step, 0, rank)
        opt.zero_grad()
        F.mse_loss(forward(x).squeeze(1), y).backward()
        opt.step()
    return model, frozen_at


def freezing():
    """A layer frozen after DistributedOptimizer was built does not move, exactly as
    under DDP, and the rest trains as under DDP (plain and bucket-view gradients)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(
            "gloo", init_method=f"file://{sys.argv[1]}/ddp_store", rank=rank, world_size=size
        )
    ddp, _ = _train_freezing("ddp")
    problems = []
    for how in ("cring", "cring_buckets"):
        model, frozen_at = _train_freezing(how)
        for name, (p, before) in zip(("weight", "bias"), zip(model[0].parameters(), frozen_at)):
            if not torch.equal(p.detach(), before):
                problems.append(f"{how}: frozen layer 0 {name} moved by {(p - before).abs().max()}")
        # DDP sums gradients divided by size, cring divides the sum: the same bits when
        # size is a power of two, else within rounding
        d = (vector(model) - vector(ddp)).abs().max().item()
        tol = 0.0 if size & (size - 1) == 0 else 1e-12 * max(1.0, vector(ddp).abs().max().item())
        if d > tol:
            problems.append(f"{how}: parameters differ from DDP's by {d:.3g} (tolerance {tol})")
    return "; ".join(problems) or None


def unfreezing():
    """A layer frozen when DistributedOptimizer is built and unfrozen later is
    averaged from then on: it moves, and every rank ends with the same weights."""
    model = _freeze_model(seed=5)
    model[0].requires_grad_(False)
    opt = DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    before = vector(model).clone()
    for step in range(4):
        if step == 1:
            model[0].requires_grad_(True)
        x, y = batch(step, 1, rank)
        opt.zero_grad()
        F.mse_loss(model(x).squeeze(1), y).backward()
        opt.step()
    mine = vector(model)
    every = cring.allgather(mine.unsqueeze(0))
    if (mine - before)[: model[0].weight.numel()].abs().max() == 0:
        return "the unfrozen layer did not move"
    if not all(torch.equal(every[r], mine) for r in range(size)):
        return "ranks differ after training an unfrozen layer (its gradient was not averaged)"
    # a group added later with a frozen parameter first: unfrozen, it gets a name of its
    # own (named by position, as at build), never the name of the group's other parameter
    a = torch.nn.Parameter(torch.full((3,), 0.5), requires_grad=False)
    b = torch.nn.Parameter(torch.full((3,), -0.5))
    opt.add_param_group({"params": [a, b]})
    names = opt._parameter_names
    if names[a] == names[b]:
        return f"two parameters of an added group share the name {names[a]!r}"
    for step in range(3):
        if step == 1:
            a.requires_grad_(True)
        opt.zero_grad()
        ((a * (rank + 1.0)).sum() + (b * (rank + 2.0)).sum()).backward()
        opt.step()
    mean_a = sum(r + 1.0 for r in range(size)) / size
    mean_b = sum(r + 2.0 for r in range(size)) / size
    if not torch.allclose(a.detach(), torch.full((3,), 0.5 - 0.1 * 2 * mean_a)):
        return f"added, unfrozen parameter: {a.detach().tolist()} (want 2 averaged steps)"
    if not torch.allclose(b.detach(), torch.full((3,), -0.5 - 0.1 * 3 * mean_b)):
        return f"added parameter: {b.detach().tolist()} (want 3 averaged steps)"
    return None


checks.check("arguments", arguments)
checks.check("wrapper is the optimizer", wrapper_is_the_optimizer)
checks.check("zero_grad while in flight", zero_grad_while_in_flight)
checks.check("too many backward passes", too_many_backwards)
checks.check("skip_synchronize", skip_synchronize)
checks.check("sparse gradients", sparse_gradients)
checks.check("compression", compression)
checks.check("broadcast adam", lambda: broadcast_state("adam"))
checks.check("broadcast sgd", lambda: broadcast_state("sgd"))
checks.check("fresh everywhere", fresh_everywhere)
checks.check("mismatched layout", mismatched_layout)
checks.check("freezing", freezing)
checks.check("unfreezing", unfreezing)
checks.info["states"] = states
cring.shutdown()
checks.finish()

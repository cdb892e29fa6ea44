"""Worker for test_comm_hooks.py: DistributedOptimizer(comm_hook=...) at 2 or
3 ranks, every check in one job (each launch imports torch on every rank).
argv: outdir gloo_file. Run with OMP_NUM_THREADS=1 (torch's PowerSGD hook
runs matmuls on gloo's callback thread, which otherwise takes two threads
and rounds differently from run to run).

  * powerSGD_hook (rank 2, start_powerSGD_iter=2) against torch DDP over
    gloo with torch's powerSGD_hook, 20 steps of a small MLP: final weights
    and the loss curve (the test decides what must hold at which size);
  * each built-in hook's result against the exact average, over several
    buckets (CRING_BUCKET_BYTES small) so they are started in order and
    staged hooks advance while later buckets start;
  * bytes each rank sent (engine_stats, over TCP) per synchronize() for a
    set of convolution-shaped gradients, per hook;
  * backward_passes_per_step, gradient_as_bucket_view and shard_state=1
    with a hook give what the plain settings give;
  * PowerSGDState across state_dict() and cring.torch.elastic.TorchState's
    commit / restore / sync;
  * (3 ranks) a process set of ranks 0 and 1, and an int8 bucket with fewer
    blocks than ranks.
Writes <outdir>/rank<R>.json (Checks) with the figures under "info".
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd
from torch.nn.parallel import DistributedDataParallel

import cring
import cring.torch as hvd
from cring.torch import hooks
from cring.torch.elastic import TorchState

from engine_common import Checks

torch.set_num_threads(1)
outdir, gloo_file = sys.argv[1], sys.argv[2]
hvd.init()
rank, size = hvd.rank(), hvd.size()
checks = Checks(outdir, rank, size)
STEPS = 20


def mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    )


def batches(n: int, seed: int = 100) -> list:
    g = torch.Generator().manual_seed(seed + rank)
    return [
        (torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g))
        for _ in range(n)
    ]


def train(net: torch.nn.Module, opt, data: list, passes: int = 1) -> list:
    losses = []
    for i in range(0, len(data), passes):
        opt.zero_grad()
        for x, y in data[i : i + passes]:
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            losses.append(loss.item())
        opt.step()
    return losses


def worst_rel(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(
        ((p - q).abs().max() / q.abs().max()).item() for p, q in zip(a.parameters(), b.parameters())
    )


def distributed(net, hook=None, state=None, **kwargs):
    return hvd.DistributedOptimizer(
        torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
        named_parameters=[
            (f"{kwargs.pop('prefix', 'm')}.{n}", p) for n, p in net.named_parameters()
        ],
        comm_hook=hook,
        comm_state=state,
        **kwargs,
    )


# ---- PowerSGD against torch DDP + gloo -----------------------------------------------------------


def powersgd_against_torch():
    dist.init_process_group("gloo", init_method=f"file://{gloo_file}", rank=rank, world_size=size)
    data = batches(STEPS)
    ref = mlp()
    ddp = DistributedDataParallel(ref)
    ddp.register_comm_hook(
        torch_psgd.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2),
        torch_psgd.powerSGD_hook,
    )
    ref_losses = train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9), data)
    dist.destroy_process_group()
    net = mlp()
    state = hooks.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2)
    losses = train(net, distributed(net, hooks.powerSGD_hook, state, prefix="psgd"), data)
    checks.info["torch_weights_rel"] = worst_rel(net, ref)
    checks.info["torch_loss_rel"] = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    checks.info["losses"] = losses
    checks.info["torch_losses"] = ref_losses
    if state.iter != 2 or len(state.error_dict) != 1:
        return f"state after 20 steps: iter {state.iter}, error buffers {len(state.error_dict)}"
    return None


# ---- each hook against the exact average ---------------------------------------------------------


def hooks_against_the_average():
    os.environ["CRING_BUCKET_BYTES"] = str(8 << 10)  # three buckets
    net = mlp(1)
    ((x, y),) = batches(1, seed=7)
    F.cross_entropy(net(x), y).backward()
    local = [p.grad.clone() for p in net.parameters()]
    exact = [cring.allreduce(g, op=cring.Average, name=f"exact.{i}") for i, g in enumerate(local)]
    bounds = {  # worst |error| / max |exact| per parameter
        "allreduce_hook": (hooks.allreduce_hook, None, 1e-6),
        "fp16_compress": (hooks.fp16_compress, None, 2e-3),
        "bf16_compress": (hooks.bf16_compress, None, 1.6e-2),
        "int8_hook": (hooks.int8_hook, hooks.Int8State(block_size=256), 2.5e-2),
        "powerSGD_hook before start": (
            hooks.powerSGD_hook,
            hooks.PowerSGDState(start_powerSGD_iter=5),
            1e-6,
        ),
    }
    problems = []
    for label, (hook, state, bound) in bounds.items():
        opt = distributed(net, hook, state, prefix=f"avg.{label.split()[0]}")
        if len(opt._cring_units) < 3:
            return f"{label}: only {len(opt._cring_units)} buckets"
        for p, g in zip(net.parameters(), local):
            p.grad = g.clone()
        opt.synchronize()
        worst = max(
            ((p.grad - e).abs().max() / e.abs().max()).item()
            for p, e in zip(net.parameters(), exact)
        )
        checks.info[f"error.{label}"] = worst
        if not worst <= bound:
            problems.append(f"{label}: error {worst:.3g} > {bound}")
        opt.zero_grad()
    # docs/hooks.md's example of a staged hook (sign and one scale per bucket, no error feedback)
    opt = distributed(net, sign_hook, None, prefix="avg.sign")
    for p, g in zip(net.parameters(), local):
        p.grad = g.clone()
    opt.synchronize()
    local_of = {id(p): g for p, g in zip(net.parameters(), local)}
    for u in opt._cring_units:
        flat = torch.cat([local_of[id(p)].reshape(-1) for p in u.params])
        every = cring.allgather(flat.view(1, -1), name=f"sign.check.{u.bucket.index()}")
        expected = (torch.sign(every) * every.abs().mean(1, keepdim=True)).mean(0)
        got = torch.cat([p.grad.reshape(-1) for p in u.params])
        if not torch.allclose(got, expected, rtol=1e-6, atol=0):
            problems.append(f"docs' sign_hook, bucket {u.bucket.index()}: not the expected mean")
    del os.environ["CRING_BUCKET_BYTES"]
    return "; ".join(problems) or None


def sign_hook(state, bucket):  # as in docs/hooks.md, "Writing a hook"
    buf, ps = bucket.buffer(), bucket.process_set
    scale = buf.abs().mean().reshape(1)
    signs = torch.sign(buf).to(torch.int8)
    scales, gathered = yield (
        cring.allgather_async(scale, name=f"{bucket.name()}.sign.scale", process_set=ps),
        cring.allgather_async(signs, name=f"{bucket.name()}.sign.values", process_set=ps),
    )
    rows = gathered.view(ps.size(), -1).float() * scales.view(-1, 1)
    buf.copy_(rows.mean(0))


# ---- bytes on the wire ---------------------------------------------------------------------------

CONV_SHAPES = [
    (256, 256, 3, 3),
    (512, 256, 1, 1),
    (1024, 512, 1, 1),
    (128, 128, 3, 3),
    (512,),
    (1024,),
]


def sent_bytes(hook, state, label: str, steps: int = 3) -> int:
    params = [torch.nn.Parameter(torch.zeros(s)) for s in CONV_SHAPES]
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(params, lr=0.0),
        named_parameters=[(f"bytes.{label}.{i}", p) for i, p in enumerate(params)],
        comm_hook=hook,
        comm_state=state,
    )
    g = torch.Generator().manual_seed(rank)
    counts = []
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        before = cring.engine_stats()["tcp_bytes_sent"]
        opt.synchronize()
        counts.append(cring.engine_stats()["tcp_bytes_sent"] - before)
        opt.zero_grad()
    return counts[-1]  # the steady state (PowerSGD: compressing, names cached)


def bytes_per_hook():
    if cring.transport() != "tcp":
        return None
    plain = sent_bytes(None, None, "none")
    figures = {"none": plain}
    figures["powerSGD_r4"] = sent_bytes(
        hooks.powerSGD_hook,
        hooks.PowerSGDState(matrix_approximation_rank=4, start_powerSGD_iter=2),
        "psgd",
    )
    figures["int8"] = sent_bytes(hooks.int8_hook, hooks.Int8State(), "int8")
    figures["fp16"] = sent_bytes(hooks.fp16_compress, None, "fp16")
    checks.info["bytes"] = figures
    ratios = {k: v / plain for k, v in figures.items()}
    if not (ratios["powerSGD_r4"] <= 0.1 and ratios["int8"] <= 0.3 and ratios["fp16"] <= 0.55):
        return f"byte ratios {ratios}"
    return None


# ---- the optimizer's other settings with a hook --------------------------------------------------


def settings_with_hooks():
    data = batches(6, seed=300)
    problems = []
    # backward_passes_per_step: the hook sees the accumulated gradient once
    a, b = mlp(2), mlp(2)
    train(a, distributed(a, prefix="bpps.plain", backward_passes_per_step=2), data, passes=2)
    train(
        b,
        distributed(b, hooks.allreduce_hook, prefix="bpps.hook", backward_passes_per_step=2),
        data,
        2,
    )
    if worst_rel(a, b) > 1e-6:
        problems.append(f"backward_passes_per_step=2: {worst_rel(a, b):.3g} from the plain path")
    # gradient_as_bucket_view: gradients are views into the hook's buckets, same training
    a, b = mlp(3), mlp(3)
    sa, sb = (hooks.PowerSGDState(start_powerSGD_iter=2, matrix_approximation_rank=2) for _ in "ab")
    train(a, distributed(a, hooks.powerSGD_hook, sa, prefix="view0"), data)
    opt = distributed(b, hooks.powerSGD_hook, sb, prefix="view1", gradient_as_bucket_view=True)
    train(b, opt, data)
    if worst_rel(a, b) > 1e-6:
        problems.append(f"gradient_as_bucket_view: {worst_rel(a, b):.3g} from without")
    unit = opt._cring_units[0]
    if unit.params[0].grad.data_ptr() != unit.bucket.gradients()[0].data_ptr():
        problems.append("gradient_as_bucket_view: .grad is not a view into the bucket")
    # shard_state=1: each rank steps its slice of the hook's result
    a, b = mlp(4), mlp(4)
    sa, sb = (hooks.PowerSGDState(start_powerSGD_iter=2, matrix_approximation_rank=2) for _ in "ab")
    train(a, distributed(a, hooks.powerSGD_hook, sa, prefix="zero0"), data)
    train(b, distributed(b, hooks.powerSGD_hook, sb, prefix="zero1", shard_state=1), data)
    if worst_rel(a, b) > 1e-6:
        problems.append(f"shard_state=1: {worst_rel(a, b):.3g} from unsharded")
    return "; ".join(problems) or None


# ---- the state across checkpoints and elastic resets ---------------------------------------------


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def state_survives():
    net = mlp(5)
    state = hooks.PowerSGDState(start_powerSGD_iter=2, matrix_approximation_rank=2)
    opt = distributed(net, hooks.powerSGD_hook, state, prefix="elastic")
    data = batches(8, seed=500)
    train(net, opt, data[:4])
    tstate = TorchState(net, opt, powersgd=state)
    tstate.commit()
    saved_errors = {k: v.clone() for k, v in state.error_dict.items()}
    saved_q = {k: v.clone() for k, v in state.q_memory_dict.items()}
    draws = state.rng.randint(1 << 30, size=3)
    train(net, opt, data[4:])
    tstate.restore()  # a reset: the same process takes its own errors back
    if not (same(state.error_dict, saved_errors) and same(state.q_memory_dict, saved_q)):
        return "restore() did not bring back the committed error feedback and Q"
    if list(state.rng.randint(1 << 30, size=3)) != list(draws):
        return "restore() did not bring back the random generator"
    tstate.sync()  # rank 0's state everywhere: the other ranks drop rank 0's residuals
    if rank != 0 and state.error_dict:
        return "sync(): a rank kept rank 0's error feedback"
    if rank == 0 and not same(state.error_dict, saved_errors):
        return "sync(): rank 0 lost its own error feedback"
    q0 = cring.broadcast(state.q_memory_dict[0], 0, name="elastic.q0")
    if not torch.equal(q0, state.q_memory_dict[0]) or state.iter != 2:
        return "sync(): Q or the step count differ from rank 0's"
    # a checkpoint file: written and read back by this rank at this size keeps the errors
    path = f"{outdir}/psgd{rank}.pt"
    torch.save(state.state_dict(), path)
    fresh = hooks.PowerSGDState(start_powerSGD_iter=2, matrix_approximation_rank=2)
    fresh.load_state_dict(torch.load(path))  # weights_only: tensors and numbers only
    if not same(fresh.error_dict, state.error_dict) or fresh.iter != state.iter:
        return "state_dict() through torch.save/load lost the state"
    train(net, opt, data[:2])  # and training goes on from there
    return None


# ---- 3 ranks: process sets, uneven int8 blocks --------------------------------------------------


def process_set_and_small_int8():
    ps = hvd.add_process_set([0, 1])
    data = batches(4, seed=700)
    a, b = mlp(6), mlp(6)
    state = hooks.PowerSGDState(start_powerSGD_iter=2, matrix_approximation_rank=2)
    train(a, distributed(a, hooks.powerSGD_hook, state, prefix="ps", process_set=ps), data)
    train(b, torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9), data)  # no communication
    gathered = cring.allgather(
        torch.cat([p.detach().reshape(1, -1) for p in a.parameters()], 1), name="ps.w"
    )
    problems = []
    if not torch.equal(gathered[0], gathered[1]):
        problems.append("ranks 0 and 1 of the set differ")
    if rank == 2 and worst_rel(a, b) != 0:
        problems.append("rank 2 (outside the set) did not train alone")
    if rank < 2 and worst_rel(a, b) == 0:
        problems.append("ranks of the set trained alone")
    hvd.remove_process_set(ps)
    # an int8 bucket of two blocks over three ranks: one rank averages no block
    p = torch.nn.Parameter(torch.zeros(300))
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD([p], lr=0.0),
        named_parameters=[("int8small", p)],
        comm_hook=hooks.int8_hook,
        comm_state=hooks.Int8State(block_size=256),
    )
    local = torch.randn(300, generator=torch.Generator().manual_seed(rank))
    p.grad = local.clone()
    opt.synchronize()
    exact = cring.allreduce(local, op=cring.Average, name="int8small.exact")
    if not ((p.grad - exact).abs().max() / exact.abs().max()).item() < 0.03:
        problems.append("int8 with fewer blocks than ranks")
    return "; ".join(problems) or None


checks.check("powerSGD against torch DDP", powersgd_against_torch)
checks.check("hooks against the exact average", hooks_against_the_average)
checks.check("bytes per hook", bytes_per_hook)
checks.check("settings with hooks", settings_with_hooks)
checks.check("state survives", state_survives)
if size == 3:
    checks.check("process set and small int8 buckets", process_set_and_small_int8)
checks.finish()

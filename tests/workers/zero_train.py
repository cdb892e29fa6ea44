"""Worker: DistributedOptimizer(shard_state=1 | 2) against the unsharded
DistributedOptimizer, same data, same start (float32, 20 steps, Adam and SGD
with momentum, two param groups with different learning rates, a parameter
count divisible by neither 2 nor 3). Also: the consolidated state dict
equals the unsharded one; consolidate_state_dict(to=0); a reloaded state
continues identically; how much state and gradient each rank keeps; which
collectives a step uses; arguments refused. Writes <outdir>/rank<R>.json."""

import copy
import sys

import torch
import torch.nn.functional as F
from zero_common import OPTIMIZERS, batch, make, max_diff, n_params, state_diff, train, vector

import cring
import cring.torch
from cring.torch import sharded

from engine_common import Checks

torch.set_num_threads(1)
cring.init()
rank, size = cring.rank(), cring.size()
checks = Checks(sys.argv[1], rank, size)
STEPS = 20
TOL = 1e-6
results: dict = {}


def same_everywhere(t: torch.Tensor) -> float:
    """How far this rank's tensor is from rank 0's."""
    ref = cring.broadcast(t.clone(), 0, name="zero.test.same")
    return max_diff(t, ref)


plain: dict = {}
for kind in OPTIMIZERS:
    model, opt = make(rank, kind, 0, f"plain.{kind}")
    train(model, opt, rank, STEPS)
    plain[kind] = (model, opt, copy.deepcopy(opt.state_dict()))


class Recorder:
    """Counts the cring collectives the optimizer module calls (they are looked
    up on the cring package at call time)."""

    NAMES = (
        "allreduce_async_",
        "grouped_allreduce_async_",
        "reducescatter_async",
        "grouped_reducescatter_async",
        "allgather_async",
        "grouped_allgather_async",
        "grouped_allgather",
        "allgather",
        "alltoall",
        "alltoall_async",
        "broadcast_",
        "broadcast_async_",
    )

    def __init__(self):
        self.calls: dict = {}
        self.saved = {}

    def __enter__(self):
        for name in self.NAMES:
            original = self.saved[name] = getattr(cring, name)

            def wrapper(*args, _name=name, _original=original, **kwargs):
                self.calls[_name] = self.calls.get(_name, 0) + 1
                return _original(*args, **kwargs)

            setattr(cring, name, wrapper)
        return self

    def __exit__(self, *exc):
        for name, original in self.saved.items():
            setattr(cring, name, original)


for kind in OPTIMIZERS:
    for stage in (1, 2):
        label = f"{kind} stage {stage}"

        def run(kind=kind, stage=stage, label=label):
            model, opt = make(rank, kind, stage, f"s{stage}.{kind}")
            train(model, opt, rank, STEPS - 1)
            with Recorder() as rec:
                train(model, opt, rank, 1, first=STEPS - 1)
            ref_model, _, ref_state = plain[kind]
            diff = max_diff(vector(model), vector(ref_model))
            shards = [s.hi - s.lo for s in opt._zero_shards.values() if s.param.requires_grad]
            state_numel = sum(
                v.numel()
                for st in opt.state.values()
                for v in st.values()
                if isinstance(v, torch.Tensor) and v.dim() == 1
            )
            grad_numel = sum(g.numel() for g in opt._zero_grads.values())
            full_grads = sum(p.grad.numel() for p in model.parameters() if p.grad is not None)
            results[label] = {
                "diff": diff,
                "ranks_differ": same_everywhere(vector(model)),
                "calls": rec.calls,
                "shard_numel": sum(shards),
                "state_numel": state_numel,
                "grad_numel": grad_numel,
                "full_grad_numel": full_grads,
                "n_params": n_params(model),
                "trainable_numel": sum(p.numel() for p in model.parameters() if p.requires_grad),
                "count": sum(1 for p in model.parameters()),
            }
            if diff > TOL:
                return f"parameters differ from the unsharded optimizer's by {diff:.3g}"
            full = opt.state_dict()
            problem = state_diff(full, ref_state)
            if problem:
                return f"state_dict: {problem}"
            opt.consolidate_state_dict(to=0)
            if rank == 0:
                problem = state_diff(opt.state_dict(), ref_state)
                if problem:
                    return f"consolidated on rank 0: {problem}"
            else:
                try:
                    opt.state_dict()
                    return "state_dict() after consolidate_state_dict(to=0) did not raise"
                except RuntimeError as e:
                    if "consolidate_state_dict(to=0)" not in str(e):
                        return f"unclear error: {e}"
            # a new sharded optimizer loading that state continues as the old one does
            again, opt2 = make(rank, kind, stage, f"s{stage}.{kind}.again")
            again.load_state_dict(model.state_dict())
            opt2.load_state_dict(full)
            train(model, opt, rank, 3, first=STEPS)
            train(again, opt2, rank, 3, first=STEPS)
            if max_diff(vector(model), vector(again)) > TOL:
                return "a reloaded optimizer continues differently"
            return None

        checks.check(label, run)


def closure_and_accumulation():
    """step(closure) and backward_passes_per_step=2 give the unsharded results."""
    out = {}
    for stage in (0, 1, 2):
        a, opt_a = make(rank, "adam", stage, f"closure{stage}")
        train(a, opt_a, rank, 4, closure=True)
        b, opt_b = make(rank, "sgd", stage, f"bpps{stage}", backward_passes_per_step=2)
        train(b, opt_b, rank, 4, bpps=2)
        out[stage] = (vector(a), vector(b))
    for stage in (1, 2):
        for i, what in enumerate(("step(closure)", "backward_passes_per_step=2")):
            d = max_diff(out[stage][i], out[0][i])
            if d > TOL:
                return f"stage {stage}, {what}: differs from unsharded by {d:.3g}"
    return None


checks.check("closure and accumulation", closure_and_accumulation)


def scheduler_made_before_wrapping():
    """An LR scheduler made on the optimizer before DistributedOptimizer
    wraps it (as Lightning's configure_optimizers does) patches the
    original's step; the wrapper's step must still run (reduce, shard), and
    the scheduler must count it (no 'lr_scheduler.step() before
    optimizer.step()' warning): all equal to a scheduler made after."""
    import warnings

    from zero_common import Net, adam

    from cring.torch.optimizer import DistributedOptimizer, broadcast_parameters

    out = {}
    for stage, before in ((0, False), (0, True), (1, True), (2, True)):
        model = Net(seed=100 + rank)
        broadcast_parameters(model.state_dict(), root_rank=0)
        inner = adam(model)
        sched = torch.optim.lr_scheduler.StepLR(inner, 1, 0.5) if before else None
        named = [(f"sched{stage}{before}.{n}", p) for n, p in model.named_parameters()]
        opt = DistributedOptimizer(inner, named_parameters=named, shard_state=stage)
        if sched is None:
            sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(3):
                train(model, opt, rank, 1, first=step)
                sched.step()
        if any("lr_scheduler.step()" in str(w.message) for w in caught):
            return f"stage {stage}: the scheduler did not see the step"
        out[(stage, before)] = (vector(model), opt.param_groups[0]["lr"])
    ref, lr = out[(0, False)]
    for key, (got, got_lr) in out.items():
        if max_diff(got, ref) > TOL or got_lr != lr:
            return f"{key}: differs by {max_diff(got, ref):.3g}, lr {got_lr} vs {lr}"
    return None


checks.check("scheduler made before wrapping", scheduler_made_before_wrapping)


def skip_synchronize_and_clip():
    """synchronize(), clip_grad_norm_ on the sharded gradients, step() in
    skip_synchronize(): as torch's clip_grad_norm_ on the full gradients."""
    out = {}
    for stage in (0, 1, 2):
        model, opt = make(rank, "sgd", stage, f"clip{stage}")

        def clip(opt, model=model, stage=stage):
            opt.synchronize()
            if stage == 0:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            else:
                norm = opt.clip_grad_norm_(0.05)
            out.setdefault(stage, []).append(float(norm))

        for step in range(3):
            opt.zero_grad()
            x, y = batch(step, rank)
            F.mse_loss(model(x, rank), y).backward()
            clip(opt)
            with opt.skip_synchronize():
                opt.step()
        out[stage] = (out[stage], vector(model))
    for stage in (1, 2):
        # torch sums float32 norms, we float64 ones: equal to float32 rounding
        norms = max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(out[stage][0], out[0][0]))
        d = max_diff(out[stage][1], out[0][1])
        if norms > 1e-5 or d > TOL:
            return f"stage {stage}: norms differ by {norms:.3g}, parameters by {d:.3g}"
    return None


checks.check("skip_synchronize and clip_grad_norm_", skip_synchronize_and_clip)


def refusals():
    model = torch.nn.Linear(3, 2)
    named = [("refuse." + n, p) for n, p in model.named_parameters()]
    try:
        cring.torch.DistributedOptimizer(
            torch.optim.LBFGS(model.parameters()), named_parameters=named, shard_state=1
        )
        return "LBFGS was accepted"
    except ValueError as e:
        if "element-wise" not in str(e) or "LBFGS" not in str(e):
            return f"unclear LBFGS error: {e}"
    for bad in (3, -1, True, "1"):
        try:
            cring.torch.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=named, shard_state=bad
            )
            return f"shard_state={bad!r} was accepted"
        except ValueError:
            pass
    try:
        cring.torch.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=named,
            shard_state=2,
            groups=1,
        )
        return "shard_state=2 with groups was accepted"
    except ValueError:
        pass

    class Custom(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"lr": 0.1})

        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.data.add_(p.grad, alpha=-group["lr"])

    try:
        cring.torch.DistributedOptimizer(
            Custom(model.parameters()), named_parameters=named, shard_state=1
        )
        return "an unknown optimizer was accepted"
    except ValueError as e:
        if "cring_elementwise" not in str(e):
            return f"the error does not say how to opt in: {e}"
    Custom.cring_elementwise = True
    opt = cring.torch.DistributedOptimizer(
        Custom(model.parameters()), named_parameters=named, shard_state=1
    )
    try:
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
        return "add_param_group was accepted"
    except NotImplementedError:
        pass
    return None


checks.check("refusals", refusals)
checks.info["scenarios"] = results
checks.info["elementwise"] = [c.__name__ for c in sharded.ELEMENTWISE]
cring.shutdown()
checks.finish()

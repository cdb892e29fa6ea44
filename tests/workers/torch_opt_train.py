"""Worker: training with DistributedOptimizer (float64, each rank on its own
data) against single-process training on the concatenated batch, computed
here with the same seeds. Scenarios: SGD with momentum, Adam,
backward_passes_per_step=2, groups (an int and lists), gradient_predivide_factor,
and a model of many small parameters for fusion and overlap.
Writes <outdir>/rank<R>.json: final parameters and relative errors per scenario."""

import sys

import torch

import cring

from engine_common import Checks
from torch_opt_common import rel_err, train_distributed, train_reference, vector

torch.set_num_threads(1)
cring.init()
rank, size = cring.rank(), cring.size()
checks = Checks(sys.argv[1], rank, size)
STEPS = 4


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3)


def adam(params):
    return torch.optim.Adam(params, lr=0.01, weight_decay=1e-3)


SCENARIOS = {
    # name: (optimizer, backward passes per step, DistributedOptimizer arguments)
    "sgd": (sgd, 1, {}),
    "adam": (adam, 1, {}),
    "sgd_bpps2": (sgd, 2, {}),
    "adam_bpps2": (adam, 2, {}),
    "sgd_groups2": (sgd, 1, {"groups": 2}),
    "sgd_groups_list": (
        sgd,
        1,
        {
            "groups": lambda m: [
                [m.layers[0].weight, m.layers[2].bias],
                [m.layers[1].weight, m.extra],
            ]
        },
    ),
    "adam_groups_list": (adam, 1, {"groups": lambda m: [list(m.parameters())]}),
    "sgd_predivide": (sgd, 1, {"gradient_predivide_factor": float(size)}),
}
results = {}
for name, (make_opt, bpps, kwargs) in SCENARIOS.items():

    def run(name=name, make_opt=make_opt, bpps=bpps, kwargs=kwargs):
        model, _ = train_distributed(rank, make_opt, STEPS, bpps=bpps, **dict(kwargs))
        ref = train_reference(size, make_opt, STEPS, bpps=bpps)
        got, want = vector(model), vector(ref)
        start = vector(train_reference(size, make_opt, 0))
        results[name] = {
            "params": got.tolist(),
            "rel_err": rel_err(got, want),
            "moved": rel_err(want, start),
        }
        if results[name]["rel_err"] > 1e-5:
            return f"relative error {results[name]['rel_err']:.3g} against one process"
        return None

    checks.check(name, run)


def many_small():
    """60 layers of 4x4: 121 trainable parameters. Every allreduce must have
    been started by the hooks before backward returned (none by step()), and
    the engine must fuse them into a few collectives per step."""
    net = {"width": 4, "depth": 60}
    submitted = []

    def on_backward(step, opt, model):
        # units whose gradients backward produced (on ranks but 0, `extra` has none: it is
        # submitted by step(), as zeros)
        units = [u for u in opt._cring_units if all(p.grad is not None for p in u.params)]
        submitted.append(sum(1 for u in units if u in opt._cring_handles) / len(units))

    steps = 6
    before = cring.engine_stats()
    model, opt = train_distributed(rank, sgd, steps, net_kwargs=net, on_backward=on_backward)
    after = cring.engine_stats()
    ref = train_reference(size, sgd, steps, net_kwargs=net)
    n_params = sum(1 for p in model.parameters() if p.requires_grad)
    # the broadcast of the initial parameters is fused too: count it as one collective
    collectives = after["collectives"] - before["collectives"] - 1
    results["many"] = {
        "params": vector(model).tolist(),
        "rel_err": rel_err(vector(model), vector(ref)),
        "trainable": n_params,
        "collectives_per_step": collectives / steps,
        "submitted_before_step": min(submitted),
    }
    if results["many"]["rel_err"] > 1e-5:
        return f"relative error {results['many']['rel_err']:.3g} against one process"
    return None


checks.check("many small parameters", many_small)
checks.info["scenarios"] = results
cring.shutdown()
checks.finish()

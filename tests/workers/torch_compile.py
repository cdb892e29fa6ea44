"""Worker: cring.torch's collectives under torch.compile (argv: outdir).

- A function calling hvd.allreduce, hvd.allgather and hvd.broadcast: Dynamo's
  explain finds one graph and no break, fullgraph=True compiles it with no
  warning from cring, and its values and gradients (the backward derived from
  the operators' formulas) equal eager's exactly, twice: compiled afresh and
  from the compile cache both ranks share.
- allgather with different first dimensions on the ranks, compiled: a
  ValueError naming the sizes, on every rank.
- A DistributedOptimizer training step (forward, backward, step, zero_grad)
  compiled with compiled autograd: no graph break whose stack is in cring,
  the ranks end equal, and the weights equal eager training's (to float
  rounding: Inductor's kernels are not bit-identical to eager's).
The graph counts and break reasons go into the result for the test to print.
Writes <outdir>/rank<R>.json (Checks)."""

import logging
import os
import re
import sys
import warnings

import torch
import torch.nn.functional as F

import cring.torch as hvd

from engine_common import Checks

torch.set_num_threads(1)
hvd.init()
rank, size = hvd.rank(), hvd.size()
checks = Checks(sys.argv[1], rank, size)
CRING_DIR = os.path.dirname(os.path.dirname(os.path.abspath(hvd.__file__)))
# The compiled collectives must equal eager's bit for bit: "aot_eager" runs the traced
# graph (forward and the derived backward, with cring's operators) on eager kernels.
# Inductor's own kernels (sin, sums) round differently from eager's, which says
# nothing about cring; the training step below runs on Inductor.
BACKEND = "aot_eager"


def collectives(x, w):
    y = hvd.allreduce(x * 2, name="compile.ar", op=hvd.Sum)
    z = hvd.allgather(y + 1, name="compile.ag")
    b = hvd.broadcast(z * w, root_rank=size - 1, name="compile.bc")
    return (b.sin() * 3).sum(), hvd.allreduce(z, name="compile.ar2")


def inputs():
    x = (torch.arange(6.0).reshape(2, 3) + rank).requires_grad_()
    w = torch.tensor(1.5 + rank, requires_grad=True)
    return x, w


def cring_warnings(caught) -> list:
    return [str(w.message)[:200] for w in caught if "cring" in str(w.message).lower()]


def three_collectives():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        explained = torch._dynamo.explain(collectives)(*inputs())
        runs = []
        for _ in range(2):  # the second compiles from the cache the ranks share
            torch._dynamo.reset()
            compiled = torch.compile(collectives, fullgraph=True, backend=BACKEND)
            got_x, got_w = inputs()
            got = compiled(got_x, got_w)
            got[0].backward()
            runs.append((got, got_x, got_w))
    want_x, want_w = inputs()
    want = collectives(want_x, want_w)
    want[0].backward()
    checks.info["collectives"] = {
        "graphs": explained.graph_count,
        "breaks": explained.graph_break_count,
        "reasons": [b.reason.splitlines()[0] for b in explained.break_reasons],
    }
    problems = []
    if explained.graph_break_count or explained.graph_count != 1:
        problems.append(f"{explained.graph_count} graphs, {explained.graph_break_count} breaks")
    if cring_warnings(caught):
        problems.append(f"warnings: {cring_warnings(caught)}")
    for k, (got, got_x, got_w) in enumerate(runs):
        for what, a, b in [
            ("loss", got[0], want[0]),
            ("allreduce of the gather", got[1], want[1]),
            ("x.grad", got_x.grad, want_x.grad),
            ("w.grad", got_w.grad, want_w.grad),
        ]:
            if not torch.equal(a.detach(), b.detach()):
                problems.append(f"compile {k}: {what}: compiled {a} != eager {b}")
    return "; ".join(problems) or None


def uneven_allgather():
    torch._dynamo.reset()
    try:
        torch.compile(lambda t: hvd.allgather(t, name="compile.uneven"), fullgraph=True)(
            torch.ones(1 + rank, 2)
        )
    except ValueError as e:
        return None if "same first dimension" in str(e) else f"unexpected message: {e}"
    return "no error for different first dimensions"


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def batch(step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(6, 4, generator=g), torch.randn(6, 1, generator=g)


class GraphBreaks(logging.Handler):
    """Where torch.compile broke the graph: the file and line of every break
    Dynamo logs (TORCH_LOGS=graph_breaks), with the first line of its reason."""

    def __init__(self):
        super().__init__()
        self.breaks: list = []

    def emit(self, record):
        message = record.getMessage()
        found = re.search(r"Graph break .*in user code at (\S+):(\d+)\n(.*)", message)
        if found:
            self.breaks.append((found.group(1), int(found.group(2)), found.group(3).strip()))


def training(compiled: bool, unfreeze_at=None):
    """Four steps, eager or compiled with compiled autograd; with unfreeze_at,
    the first layer is frozen when the optimizer is built and unfrozen at that
    step. Returns the parameters."""
    model = make_model()
    if unfreeze_at is not None:
        model[0].requires_grad_(False)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        named_parameters=model.named_parameters(),
    )

    def step(x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    with torch._dynamo.config.patch(compiled_autograd=compiled):
        fn = torch.compile(step) if compiled else step
        for s in range(4):
            if s == unfreeze_at:
                model[0].requires_grad_(True)
            fn(*batch(s))
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def compiled_unfreezing():
    """A layer frozen when the optimizer was built and unfrozen later is
    averaged by the compiled step too: ranks agree, and equal eager training."""
    torch._dynamo.reset()
    compiled = training(True, unfreeze_at=1)
    eager = training(False, unfreeze_at=1)
    every = hvd.allgather(compiled.unsqueeze(0), name="compile.unfrozen")
    problems = []
    if not all(torch.equal(every[r], compiled) for r in range(size)):
        problems.append("ranks differ: the unfrozen layer's gradient was not averaged")
    d = (compiled - eager).abs().max().item()
    if d > 1e-5:
        problems.append(f"compiled training differs from eager by {d:.3g}")
    return "; ".join(problems) or None


def compiled_training_step():
    import torch._dynamo.symbolic_convert  # noqa: F401  (creates the artifact's loggers)

    handler = GraphBreaks()
    torch._logging.set_logs(graph_breaks=True)
    # the artifact's loggers (torch.*.__graph_breaks) do not propagate: listen to each
    loggers = [
        logging.getLogger(name)
        for name in list(logging.root.manager.loggerDict)
        if name.endswith("__graph_breaks")
    ]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch._dynamo.reset()
            compiled = training(True)
    finally:
        torch._logging.set_logs()
        for logger in loggers:
            logger.removeHandler(handler)
    eager = training(False)
    # a break is cring's when Dynamo stopped in cring's code (torch's own breaks, in
    # Tensor.backward and inside torch.optim's step, are there for every optimizer)
    in_cring = [b for b in handler.breaks if b[0].startswith(CRING_DIR)]
    checks.info["training"] = {
        "breaks": len(handler.breaks),
        "breaks_in_cring": in_cring,
        "where": [
            f"{os.path.relpath(f, os.path.dirname(torch.__file__))}:{n} {why}"
            for f, n, why in handler.breaks
        ],
    }
    if not handler.breaks:
        return "no graph break was logged at all (torch's own in Tensor.backward expected)"
    every = hvd.allgather(compiled.unsqueeze(0), name="compile.check")
    problems = []
    if in_cring:
        problems.append(f"graph breaks in cring: {in_cring}")
    if cring_warnings(caught):
        problems.append(f"warnings: {cring_warnings(caught)}")
    if not all(torch.equal(every[r], compiled) for r in range(size)):
        problems.append("ranks differ after compiled training")
    d = (compiled - eager).abs().max().item()
    if d > 1e-5:
        problems.append(f"compiled training differs from eager by {d:.3g}")
    checks.info["training"]["max_diff_vs_eager"] = d
    return "; ".join(problems) or None


checks.check("three collectives", three_collectives)
checks.check("uneven allgather", uneven_allgather)
checks.check("compiled training step", compiled_training_step)
checks.check("compiled unfreezing", compiled_unfreezing)
hvd.shutdown()
checks.finish()

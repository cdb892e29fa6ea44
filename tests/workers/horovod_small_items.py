"""Worker (2 ranks, HOROVOD_NOT_A_KNOB=1 in the environment): Horovod's
behaviour on the smaller items of issue 27. argv: outdir.
  warning: the Horovod-knob RuntimeWarning points at this file's init() line;
  noncontiguous: out-of-place collectives copy a strided input (values right,
    named and unnamed, torch and NumPy, sync and async); in-place ones refuse it;
  grad_leaf: in-place collectives on a leaf that requires grad raise torch's
    RuntimeError on every rank while grad mode is on, and work under no_grad;
    DistributedOptimizer and broadcast_parameters still work on parameters;
  dtypes: int16/uint16/uint32/uint64 reduce; the unsupported-dtype error lists them;
  objects: broadcast_object sends a lambda (cloudpickle); an object the root
    cannot pickle (also: a lambda without cloudpickle, with an error that says
    to install it) raises on every rank instead of leaving the others waiting.
Writes <outdir>/rank<R>.json (Checks)."""

import sys
import threading
import warnings

import torch

import cring
import cring.torch as hvd

from engine_common import Checks

torch.set_num_threads(1)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    init_line = sys._getframe().f_lineno + 1
    hvd.init()
rank, size = hvd.rank(), hvd.size()
checks = Checks(sys.argv[1], rank, size)
TORCH_LEAF_MESSAGE = ""
try:
    torch.ones(1, requires_grad=True).add_(1)
except RuntimeError as e:
    TORCH_LEAF_MESSAGE = str(e)


def warning():
    mine = [w for w in caught if "Horovod settings" in str(w.message)]
    if len(mine) != 1:
        return f"expected one Horovod-knob warning, got {[str(w.message) for w in caught]}"
    w = mine[0]
    if w.category is not RuntimeWarning or "HOROVOD_NOT_A_KNOB" not in str(w.message):
        return f"unexpected warning {w.category.__name__}: {w.message}"
    if (w.filename, w.lineno) != (__file__, init_line):
        return f"warning points at {w.filename}:{w.lineno}, not {__file__}:{init_line}"
    return None


def base(r: int) -> torch.Tensor:
    return torch.arange(24.0).reshape(4, 6) + 100 * r  # strided views of it below


def noncontiguous():
    x = base(rank).t()  # (6, 4), strides (1, 6)
    assert not x.is_contiguous()
    every = [base(r).t() for r in range(size)]
    total = sum(every)
    cases = {
        "allreduce": (lambda: hvd.allreduce(x, op=hvd.Sum), total),
        "allreduce named": (lambda: hvd.allreduce(x, op=hvd.Sum, name="nc.ar"), total),
        "allreduce average": (lambda: hvd.allreduce(x), total / size),
        "allreduce_async": (
            lambda: hvd.synchronize(hvd.allreduce_async(x, op=hvd.Sum, name="nc.ara")),
            total,
        ),
        "grouped_allreduce": (lambda: hvd.grouped_allreduce([x, x[1:]], op=hvd.Sum)[1], total[1:]),
        "allgather": (lambda: hvd.allgather(x), torch.cat(every)),
        "allgather named": (lambda: hvd.allgather(x, name="nc.ag"), torch.cat(every)),
        "grouped_allgather": (lambda: hvd.grouped_allgather([x])[0], torch.cat(every)),
        "broadcast": (lambda: hvd.broadcast(x, 1), every[1]),
        "broadcast named": (lambda: hvd.broadcast(x, 1, name="nc.bc"), every[1]),
        "reducescatter": (
            lambda: hvd.reducescatter(x, op=hvd.Sum),
            total[rank * (6 // size) : (rank + 1) * (6 // size)],
        ),
        "alltoall": (
            lambda: hvd.alltoall(x),
            torch.cat([e[rank * (6 // size) : (rank + 1) * (6 // size)] for e in every]),
        ),
        "cring.allreduce numpy": (
            lambda: torch.from_numpy(cring.allreduce(x.numpy(), op=cring.Sum)),
            total,
        ),
        "cring.allgather numpy named": (
            lambda: torch.from_numpy(cring.allgather(x.numpy(), name="nc.np.ag")),
            torch.cat(every),
        ),
        "requires_grad allreduce": (
            lambda: hvd.allreduce(x.clone().t().t().requires_grad_(), op=hvd.Sum).detach(),
            total,
        ),
    }
    for label, (fn, want) in cases.items():
        got = fn()
        if got.shape != want.shape or not torch.equal(got, want):
            return f"{label}: got {got.tolist()}, want {want.tolist()}"
        if not torch.equal(x, base(rank).t()):
            return f"{label} changed its input"
    # in place: the caller's memory is written, so a strided one is still refused, on every rank
    for label, fn in {
        "allreduce_": lambda: hvd.allreduce_(base(rank).t(), op=hvd.Sum),
        "allreduce_ named": lambda: hvd.allreduce_(base(rank).t(), op=hvd.Sum, name="nc.ip"),
        "broadcast_": lambda: hvd.broadcast_(base(rank).t(), 0),
        "broadcast_ named": lambda: hvd.broadcast_(base(rank).t(), 0, name="nc.bip"),
        "cring.broadcast_ numpy": lambda: cring.broadcast_(base(rank).t().numpy(), 0),
    }.items():
        try:
            fn()
            return f"{label} accepted a non-contiguous tensor"
        except ValueError as e:
            if "not contiguous" not in str(e):
                return f"{label}: {e}"
    return None


def grad_leaf():
    if not TORCH_LEAF_MESSAGE.startswith("a leaf Variable that requires grad"):
        return f"torch's own message changed: {TORCH_LEAF_MESSAGE!r}"

    def leaf():
        return torch.nn.Parameter(torch.full((3,), float(rank + 1)))

    cases = {
        "allreduce_": lambda p: hvd.allreduce_(p, op=hvd.Sum, name="gl.ar"),
        "allreduce_ unnamed": lambda p: hvd.allreduce_(p, op=hvd.Sum),
        "allreduce_ scaled": lambda p: hvd.allreduce_(
            p, op=hvd.Sum, prescale_factor=1.0 + 0 * p[0].item()
        ),
        "allreduce_async_": lambda p: hvd.synchronize(hvd.allreduce_async_(p, op=hvd.Sum)),
        "grouped_allreduce_": lambda p: hvd.grouped_allreduce_([p], op=hvd.Sum)[0],
        "cring.allreduce_": lambda p: cring.allreduce_(p, op=cring.Sum, name="gl.car"),
        "broadcast_": lambda p: hvd.broadcast_(p, 1, name="gl.bc"),
        "broadcast_ unnamed": lambda p: hvd.broadcast_(p, 1),
        "broadcast_async_": lambda p: hvd.synchronize(hvd.broadcast_async_(p, 1)),
        "cring.broadcast_": lambda p: cring.broadcast_(p, 1),
    }
    total = float(sum(r + 1 for r in range(size)))
    for label, fn in cases.items():
        p = leaf()
        try:
            fn(p)
            return f"{label} accepted a leaf that requires grad"
        except RuntimeError as e:
            if not str(e).startswith(TORCH_LEAF_MESSAGE.rstrip(".")):
                return f"{label}: {type(e).__name__}: {e}"
        if not torch.equal(p.detach(), torch.full((3,), float(rank + 1))):
            return f"{label} changed the tensor it refused"
        with torch.no_grad():  # torch allows it here, so cring does too
            fn(p)
        want = 2.0 if label.startswith(("broadcast", "cring.broadcast")) else total
        if not torch.equal(p.detach(), torch.full((3,), want)):
            return f"{label} under no_grad: got {p.tolist()}, want {want}"
        fn(p.data)  # .data and non-leaf tensors are fine with grad mode on
        fn(p * 1)
    # the training path writes parameters under no_grad / through .data
    torch.manual_seed(rank)
    model = torch.nn.Linear(4, 2)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_parameters(model.named_parameters(), root_rank=0)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(3, 4) + rank).sum().backward()
        opt.step()
    flat = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
    gathered = hvd.allgather(flat.unsqueeze(0))
    if not torch.equal(gathered[0], gathered[-1]):
        return "DistributedOptimizer: ranks' parameters differ after two steps"
    return None


def dtypes():
    for dtype in (torch.int16, torch.uint16, torch.uint32, torch.uint64):
        x = torch.tensor([1, 2, 3], dtype=dtype) * (rank + 1)
        got = hvd.allreduce(x, op=hvd.Sum, name=f"dt.{dtype}")
        want = torch.tensor([1, 2, 3], dtype=torch.int64) * sum(r + 1 for r in range(size))
        if got.dtype != dtype or got.to(torch.int64).tolist() != want.tolist():
            return f"{dtype}: got {got.tolist()} ({got.dtype})"
    try:
        hvd.allreduce(torch.zeros(2, dtype=torch.complex64), name="dt.complex")
        return "complex64 was accepted"
    except TypeError as e:
        listed = str(e).split("supported:")[-1]
        for name in ("int16", "uint16", "uint32", "uint64", "float32", "bool"):
            if name not in listed:
                return f"the unsupported-dtype error leaves out {name}: {e}"
    return None


def objects():
    fn = hvd.broadcast_object(lambda v: v + 41 if rank == 0 else None, root_rank=0)
    if fn(1) != 42:
        return "a broadcast lambda (cloudpickle) did not arrive"
    # an object the root cannot pickle: every rank raises, none waits for bytes
    for blocked in (False, True):
        if blocked:
            sys.modules["cloudpickle"] = None  # as if it were not installed
        obj = threading.Lock() if not blocked else (lambda: 1)
        try:
            hvd.broadcast_object(obj if rank == 0 else None, root_rank=0)
            return f"an unpicklable object was broadcast (cloudpickle missing: {blocked})"
        except Exception as e:
            error, text = e, f"{type(e).__name__}: {e}"
        if rank == 0 and blocked and "install cloudpickle" not in text:
            return f"without cloudpickle the root's error does not say so: {text}"
        if rank != 0 and not (isinstance(error, RuntimeError) and "root rank 0" in text):
            return f"a non-root rank's error: {text}"
    del sys.modules["cloudpickle"]
    if hvd.broadcast_object({"after": rank}, root_rank=1) != {"after": 1}:
        return "broadcast_object after a failure"
    return None


checks.check("warning", warning)
checks.check("noncontiguous", noncontiguous)
checks.check("grad_leaf", grad_leaf)
checks.check("dtypes", dtypes)
checks.check("objects", objects)
hvd.shutdown()
checks.finish()

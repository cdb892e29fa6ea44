"""Worker for tests/test_process_sets.py: `process_sets.py MODE OUTDIR`.
Each mode runs one scenario on every rank and writes rank<R>.json with what a
user would see (values, error messages, timings)."""

import json
import os
import signal
import sys
import threading
import time

import numpy as np

import cring

mode, outdir = sys.argv[1], sys.argv[2]
result: dict = {}


def error_of(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001  (the test asserts the type and message)
        return [type(e).__name__, str(e)]
    return None


def values(ps):
    """Every collective on `ps`, with its expected values, for a member."""
    me, n, r = cring.rank(), ps.size(), ps.rank()
    members = ps.ranks
    out = {}
    x = np.arange(7, dtype=np.float32) + me
    out["allreduce_sum"] = cring.allreduce(x, op=cring.Sum, process_set=ps).tolist()
    expect = sum(np.arange(7, dtype=np.float32) + m for m in members)
    assert np.allclose(out["allreduce_sum"], expect), (out, expect)
    avg = cring.allreduce(x, name="avg", process_set=ps)
    assert np.allclose(avg, expect / n)
    y = np.full(5, float(me + 1), np.float64)
    cring.allreduce_(y, op=cring.Max, name="inplace", process_set=ps)  # named: the C path's shape
    assert np.all(y == max(members) + 1), y
    z = np.full(3, me, np.int64)
    cring.allreduce_(z, op=cring.Sum, process_set=ps)  # unnamed
    assert np.all(z == sum(members))
    g = cring.grouped_allreduce(
        [np.full(2, me, np.int32), np.full(3, 1.0, np.float32)], op=cring.Sum, process_set=ps
    )
    assert g[0].tolist() == [sum(members)] * 2 and g[1].tolist() == [n] * 3
    root = members[-1]  # a global rank, as in Horovod
    b = cring.broadcast(np.full(4, me, np.int32), root, process_set=ps)
    assert np.all(b == root), b
    b2 = np.full(4, me, np.float32)
    cring.broadcast_(b2, members[0], name="bc_", process_set=ps)
    assert np.all(b2 == members[0])
    rows = np.full((me + 1, 2), me, np.int32)
    gathered = cring.allgather(rows, process_set=ps)
    assert gathered.shape == (sum(m + 1 for m in members), 2), gathered.shape
    assert gathered[:, 0].tolist() == [m for m in members for _ in range(m + 1)]
    gg = cring.grouped_allgather(
        [np.array([me], np.int64), np.zeros(0, np.float32)], process_set=ps
    )
    assert gg[0].tolist() == members and gg[1].shape == (0,)
    rs = cring.reducescatter(np.ones((2 * n + 1, 3), np.float32), op=cring.Sum, process_set=ps)
    assert rs.shape == (2 + (1 if r < 1 else 0), 3) and np.all(rs == n), rs
    splits = [1] * n
    send = np.full((n, 2), me, np.int32)
    got, received = cring.alltoall(send, splits=splits, process_set=ps)
    assert got[:, 0].tolist() == members and list(received) == [1] * n
    handle = cring.allreduce_async(np.ones(3), op=cring.Sum, process_set=ps)
    assert cring.synchronize(handle).tolist() == [n] * 3
    hs = [
        cring.grouped_allreduce_async([np.ones(2)], op=cring.Sum, process_set=ps),
        cring.grouped_allgather_async([np.array([me])], process_set=ps),
        cring.grouped_reducescatter_async([np.ones((n, 1))], op=cring.Sum, process_set=ps),
    ]
    got = [cring.synchronize(h)[0].tolist() for h in hs]
    assert got == [[n, n], members, [[n]]], got
    cring.barrier(process_set=ps)
    out["size"], out["rank"] = n, r
    return out


cring.init()
me, size = cring.rank(), cring.size()
result["rank"] = me

if mode == "values":
    even = cring.add_process_set([r for r in range(size) if r % 2 == 0])
    odd = cring.add_process_set([r for r in range(size) if r % 2 == 1])
    mine = even if me % 2 == 0 else odd
    result["ids"] = [even.process_set_id, odd.process_set_id]
    result["mine"] = values(mine)
    # an overlapping set (every rank still calls add)
    head = cring.add_process_set([0, 1]) if size > 2 else None
    if head is not None and head.included():
        result["head"] = values(head)
    # the global set still works, and names of unnamed calls stayed in step
    total = cring.allreduce(np.ones(2), op=cring.Sum)
    result["global"] = total.tolist()
    result["global_ps"] = cring.allreduce(
        np.ones(2), op=cring.Sum, process_set=cring.global_process_set
    ).tolist()
    for ps in (head, odd, even):
        assert ps is None or cring.remove_process_set(ps)

elif mode == "concurrent":
    # sets {0,1} and {2,3}: set A's rank 0 sleeps before its work; set B must
    # finish all of its work meanwhile (its own engine), and each rank also
    # interleaves async handles on its set with global ones.
    a = cring.add_process_set([0, 1])
    b = cring.add_process_set([2, 3])
    mine = a if me < 2 else b
    cring.barrier()
    t0 = time.monotonic()
    if me == 0:
        time.sleep(3.0)
    handles = []
    for i in range(50):
        handles.append(
            cring.allreduce_async(
                np.full(100, i, np.float32), op=cring.Sum, name=f"s.{i}", process_set=mine
            )
        )
    for i, h in enumerate(handles):
        assert np.all(cring.synchronize(h) == 2 * i)
    result["set_done_s"] = time.monotonic() - t0
    # interleaved: a set handle and a global handle in flight together, from two threads
    errors = []

    def on_set():
        try:
            for i in range(30):
                v = cring.allreduce(np.ones(10), op=cring.Sum, name=f"t.{i}", process_set=mine)
                assert np.all(v == 2)
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    t = threading.Thread(target=on_set)
    t.start()
    for i in range(30):
        v = cring.allreduce(np.ones(10), op=cring.Sum, name=f"g.{i}")
        assert np.all(v == size)
    t.join()
    result["thread_errors"] = errors
    hs = [
        cring.allreduce_async(np.ones(4), op=cring.Sum, name="mix.set", process_set=mine),
        cring.allreduce_async(np.ones(4), op=cring.Sum, name="mix.global"),
    ]
    result["mixed"] = [cring.synchronize(h).tolist() for h in reversed(hs)]

elif mode == "mismatch":
    ranks = [0, 1] if me == 0 else [0]
    result["error"] = error_of(cring.add_process_set, ranks)
    # and the job goes on: a matching add works afterwards
    ok = cring.add_process_set([0])
    result["after_id"] = ok.process_set_id
    result["bad_rank"] = error_of(cring.add_process_set, [0, size])
    result["duplicate"] = error_of(cring.add_process_set, [0])
    result["all"] = error_of(cring.add_process_set, list(range(size)))
    result["sum"] = cring.allreduce(np.ones(1), op=cring.Sum).tolist()

elif mode == "outside":
    ps = cring.add_process_set([0])
    if me != 0:
        result["error"] = error_of(cring.allreduce, np.ones(2), process_set=ps)
        result["error_"] = error_of(cring.allreduce_, np.ones(2), name="x", process_set=ps)
        result["error_bc"] = error_of(cring.broadcast, np.ones(2), 0, process_set=ps)
        result["rank_err"] = error_of(ps.rank)
    else:
        result["value"] = cring.allreduce(np.ones(2), op=cring.Sum, process_set=ps).tolist()
        result["root_err"] = error_of(cring.broadcast, np.ones(2), size - 1, process_set=ps)
    result["unregistered"] = error_of(
        cring.allreduce, np.ones(2), process_set=cring.ProcessSet([0])
    )
    result["included"] = ps.included()
    cring.barrier()

elif mode == "readd":
    ps = cring.add_process_set([0, 1])
    first = ps.process_set_id
    assert cring.remove_process_set(ps)
    result["removed_use"] = error_of(cring.allreduce, np.ones(1), process_set=ps)
    result["remove_again"] = cring.remove_process_set(ps)
    result["remove_global"] = cring.remove_process_set(cring.global_process_set)
    again = cring.add_process_set([0, 1])
    result["ids"] = [first, again.process_set_id]
    if again.included():
        result["sum"] = cring.allreduce(np.ones(1), op=cring.Sum, process_set=again).tolist()
    cring.barrier()

elif mode == "reinit":
    ps = cring.ProcessSet([0, 1])
    cring.shutdown()
    cring.init(process_sets=[ps])
    result["id1"] = ps.process_set_id
    if ps.included():
        result["sum1"] = cring.allreduce(np.ones(1), op=cring.Sum, process_set=ps).tolist()
    cring.shutdown()
    result["after_shutdown_id"] = ps.process_set_id
    cring.init()
    ps2 = cring.add_process_set([0, 1])
    if ps2.included():
        result["sum2"] = cring.allreduce(np.ones(1), op=cring.Sum, process_set=ps2).tolist()
    result["global"] = cring.allreduce(np.ones(1), op=cring.Sum).tolist()

elif mode == "kill":
    # set [1, 2]; rank 2 dies in the middle of the set's allreduces
    ps = cring.add_process_set([1, 2])
    if ps.included():
        x = np.ones(1000, np.float32)
        for i in range(100000):
            if me == 2 and i == 20:
                os.kill(os.getpid(), signal.SIGKILL)
            t0 = time.monotonic()
            try:
                cring.allreduce_(x, name=f"k.{i}", op=cring.Sum, process_set=ps)
                x[:] = 1
            except cring.CRingError as e:
                result["raised"] = [type(e).__name__, str(e), time.monotonic() - t0]
                break
    else:
        time.sleep(1)

elif mode == "torch":
    import torch

    import cring.torch as hvd

    ps = hvd.add_process_set([0, 2])
    ok = True
    if ps.included():
        t = torch.full((3,), float(me), requires_grad=True)
        out = hvd.allreduce(t, op=hvd.Sum, process_set=ps)
        ok &= out.tolist() == [2.0] * 3
        out.sum().backward()
        ok &= t.grad.tolist() == [2.0] * 3  # the gradient allreduced over the set's 2 ranks
        g = hvd.allgather(torch.tensor([me]), process_set=ps)
        ok &= g.tolist() == [0, 2]
        ok &= hvd.broadcast_object({"me": me}, root_rank=2, process_set=ps) == {"me": 2}
        ok &= hvd.allgather_object(me, process_set=ps) == [0, 2]
        h = hvd.allreduce_async_(torch.ones(2), op=hvd.Sum, name="a", process_set=ps)
        ok &= hvd.synchronize(h).tolist() == [2.0, 2.0]
        model = torch.nn.Linear(4, 2)
        torch.manual_seed(me)
        for p_ in model.parameters():
            p_.data.normal_()
        hvd.broadcast_parameters(model.state_dict(), root_rank=2, process_set=ps)
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            named_parameters=model.named_parameters(),
            process_set=ps,
        )
        model(torch.full((8, 4), float(me))).sum().backward()
        opt.step()
        hvd.broadcast_optimizer_state(opt, root_rank=0, process_set=ps)
        w = hvd.allgather(model.weight.detach().reshape(1, -1), process_set=ps)
        ok &= bool(torch.allclose(w[0], w[1]))  # the set's ranks stepped alike
        hvd.barrier(process_set=ps)
    else:
        model = torch.nn.Linear(4, 2)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), process_set=ps)
        model(torch.ones(8, 4)).sum().backward()
        before = model.weight.grad.clone()
        opt.step()  # outside the set: its own gradient, no communication
        ok &= bool(torch.equal(before, model.weight.grad))
        try:
            hvd.allreduce(torch.ones(1), process_set=ps)
            ok = False
        except ValueError as e:
            ok &= "rank 1 is not in process set" in str(e)
    ok &= hvd.remove_process_set(ps)
    result["ok"] = bool(ok)

with open(os.path.join(outdir, f"rank{me}.json"), "w") as f:
    json.dump(result, f)
if mode != "kill":
    cring.shutdown()

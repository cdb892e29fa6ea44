"""Worker: large results from cring's result cache (docs/performance.md,
"Result memory"). Results of 1 MiB or more that cring allocates (out-of-place
allreduce, its async form, grouped allreduce, broadcast, reducescatter,
allgather) live in blocks that go back to a process-wide cache when the last
array, tensor or view of them is gone, and come out again for the next
result. Checked here, with NumPy arrays and CPU torch tensors:

- results kept alive while more calls run keep their values (a block is never
  handed out under a live result), and no two live results share memory;
- a view outlives its result: the block stays lent while any view lives;
- results are ordinary arrays and tensors (writable, in-place ops, pickle,
  torch.save, .numpy());
- a loop of large out-of-place calls maps no fresh memory (page faults per
  call, the cache's counters): the point of the cache;
- results dropped on other threads while this one keeps calling;
- results smaller than 1 MiB are NumPy's / torch's own, as before;
- after shutdown() the cache keeps nothing, and a result kept across it stays
  valid.

argv: outdir, mode. "main": all of the above. "cap": CRING_RESULT_CACHE_BYTES
is 8 MiB: the idle bytes stay within it and memory beyond it goes back to the
system. "off": CRING_RESULT_CACHE_BYTES=0: results are NumPy's / torch's own.
Writes <outdir>/rank<R>.json."""

import gc
import io
import pickle
import queue
import resource
import sys
import threading

import numpy as np
import torch

import cring

from engine_common import Checks, compare

MIB = 1 << 20
cring.init()
rank, size = cring.rank(), cring.size()
outdir, mode = sys.argv[1], sys.argv[2]
checks = Checks(outdir, rank, size)
checks.info["transport"] = cring.transport()
checks.info["mode"] = mode


def value(i):
    """Call i's input on this rank: every element the same small integer."""
    return float(rank + 1 + 10 * i)


def summed(i):
    return float(sum(r + 1 + 10 * i for r in range(size)))


def make(kind, n, v, dtype=np.float32):
    x = np.full(n, v, dtype)
    return torch.from_numpy(x) if kind == "torch" else x


def as_numpy(t):
    return t.numpy() if isinstance(t, torch.Tensor) else t


# Each collective that allocates its result, as (label, call(kind, i, n) ->
# result, expected(i, n) -> NumPy array). n: elements of float32 per rank.
def oop_allreduce(kind, i, n):
    return cring.allreduce(make(kind, n, value(i)), op=cring.Sum, name=f"rc.ar.{kind}")


def oop_allreduce_async(kind, i, n):
    h = cring.allreduce_async(make(kind, n, value(i)), op=cring.Sum, name=f"rc.ara.{kind}")
    return cring.synchronize(h)


def grouped(kind, i, n):
    xs = [make(kind, n, value(i)), make(kind, n // 2, value(i) + 1)]
    return cring.grouped_allreduce(xs, op=cring.Sum, name=f"rc.g.{kind}")[0]


def broadcast(kind, i, n):
    return cring.broadcast(make(kind, n, value(i)), 0, name=f"rc.b.{kind}")


def reducescatter(kind, i, n):
    return cring.reducescatter(make(kind, n, value(i)), op=cring.Sum, name=f"rc.rs.{kind}")


def allgather(kind, i, n):
    return cring.allgather(make(kind, n, value(i)), name=f"rc.ag.{kind}")


def rs_rows(n):
    return n // size + (1 if rank < n % size else 0)


CASES = [
    ("allreduce", oop_allreduce, lambda i, n: np.full(n, summed(i), np.float32)),
    ("allreduce_async", oop_allreduce_async, lambda i, n: np.full(n, summed(i), np.float32)),
    ("grouped_allreduce", grouped, lambda i, n: np.full(n, summed(i), np.float32)),
    ("broadcast", broadcast, lambda i, n: np.full(n, float(1 + 10 * i), np.float32)),
    ("reducescatter", reducescatter, lambda i, n: np.full(rs_rows(n), summed(i), np.float32)),
    (
        "allgather",
        allgather,
        lambda i, n: np.concatenate(
            [np.full(n, float(r + 1 + 10 * i), np.float32) for r in range(size)]
        ),
    ),
]
N = 3 * MIB // 4  # 3 MiB of float32: every case's result is over 1 MiB


def stats():
    return cring.result_cache_stats()


def minor_faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def rss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def check_kept(kind, label, call, expected):
    """Six results kept alive while the calls go on: each keeps its values,
    none shares memory with another, and they are the cache's blocks."""
    lent0 = stats()["lent_bytes"]
    kept = [call(kind, i, N) for i in range(6)]
    for i, r in enumerate(kept):
        problem = compare(as_numpy(r), expected(i, N))
        if problem:
            return f"result {i} of 6 kept: {problem}"
    arrays = [as_numpy(r) for r in kept]
    for a in range(6):
        for b in range(a + 1, 6):
            if np.shares_memory(arrays[a], arrays[b]):
                return f"results {a} and {b} share memory"
    if stats()["lent_bytes"] < lent0 + 6 * 3 * MIB // (size if label == "reducescatter" else 1):
        return f"the six results are not in lent blocks: {stats()}"
    return None


def check_view_outlives(kind, label, call, expected):
    """A view of a result, the result itself dropped, then more calls that
    reuse freed blocks: the view keeps its values."""
    r = call(kind, 0, N)
    view = r[1::2] if kind == "numpy" else r.view(-1)[1::2]
    want = expected(0, N)[1::2]
    del r
    gc.collect()
    others = [call(kind, i, N) for i in range(1, 4)]  # the blocks in and out of the cache
    del others
    others = [call(kind, i, N) for i in range(4, 7)]
    for j, o in enumerate(others):
        problem = compare(as_numpy(o), expected(4 + j, N))
        if problem:
            return f"a later result: {problem}"
    return compare(as_numpy(view), want)


def check_ordinary(kind):
    """What a user does with a result: write it, compute in place, pickle it,
    save it, view it as NumPy."""
    r = oop_allreduce(kind, 1, N)
    if kind == "numpy":
        if type(r) is not np.ndarray or not r.flags.writeable or not r.flags.c_contiguous:
            return f"not a writable contiguous ndarray: {type(r)} {r.flags}"
        r += 1.0
        r[0] = -5.0
        back = pickle.loads(pickle.dumps(r))
        buf = io.BytesIO()
        np.save(buf, r)
        buf.seek(0)
        loaded = np.load(buf)
    else:
        if type(r) is not torch.Tensor or r.dtype != torch.float32 or not r.is_contiguous():
            return f"not a contiguous float32 tensor: {type(r)} {r.dtype}"
        r.add_(1.0)
        r[0] = -5.0
        shared = r.numpy()
        shared[1] = -7.0
        if float(r[1]) != -7.0:
            return ".numpy() does not share the tensor's memory"
        r[1] = summed(1) + 1.0
        back = pickle.loads(pickle.dumps(r))
        buf = io.BytesIO()
        torch.save(r, buf)
        buf.seek(0)
        loaded = torch.load(buf)
        r2 = r.clone().requires_grad_()
        (r2 * 2).sum().backward()
        if float(r2.grad[0]) != 2.0:
            return "autograd through a result gave a wrong gradient"
    want = np.full(N, summed(1) + 1.0, np.float32)
    want[0] = -5.0
    for what, got in (("the result", r), ("its pickled copy", back), ("its saved copy", loaded)):
        problem = compare(as_numpy(got), want)
        if problem:
            return f"{what}: {problem}"
    return None


def check_no_fresh_memory(kind):
    """The point of the cache: a loop of 40 MiB out-of-place allreduces
    whose results are dropped maps no new memory and faults in no pages
    (without it, every call's result was mapped afresh: 530 faults per call
    with NumPy's huge pages, 10240 with torch's 4 KiB pages)."""
    n = 40 * MIB // 4
    x = make(kind, n, value(2))
    for _ in range(2):
        cring.allreduce(x, op=cring.Sum, name=f"rc.loop.{kind}")
    mapped, faults = stats()["mapped"], minor_faults()
    for _ in range(8):
        r = cring.allreduce(x, op=cring.Sum, name=f"rc.loop.{kind}")
        r = None
    faults, mapped = minor_faults() - faults, stats()["mapped"] - mapped
    if mapped or faults > 200:
        return f"8 calls mapped {mapped} new blocks and took {faults} page faults"
    r = cring.allreduce(x, op=cring.Sum, name=f"rc.loop.{kind}")
    return compare(as_numpy(r)[:: 1 << 16], np.full(n, summed(2), np.float32)[:: 1 << 16])


def check_threads(kind):
    """Results dropped on four other threads (their blocks go back there)
    while this thread keeps calling and keeps every fifth result: all the
    checked and kept values are right."""
    work: queue.Queue = queue.Queue()
    problems: list = []

    def consumer():
        while True:
            item = work.get()
            if item is None:
                return
            i, r = item
            problem = compare(as_numpy(r), np.full(N, summed(i), np.float32))
            if problem:
                problems.append(f"result {i} on a thread: {problem}")
            del r, item

    threads = [threading.Thread(target=consumer) for _ in range(4)]
    for t in threads:
        t.start()
    kept = []
    for i in range(40):
        r = oop_allreduce(kind, i, N)
        if i % 5 == 0:
            kept.append((i, r))
        work.put((i, r))
        del r
    for _ in threads:
        work.put(None)
    for t in threads:
        t.join(timeout=120)
    for i, r in kept:
        problem = compare(as_numpy(r), np.full(N, summed(i), np.float32))
        if problem:
            problems.append(f"kept result {i}: {problem}")
    return "; ".join(problems[:3]) or None


def check_small_unchanged(kind):
    """Below 1 MiB, results are NumPy's / torch's own arrays, as before."""
    r = oop_allreduce(kind, 0, 1000)
    if kind == "numpy":
        if not r.flags.owndata:
            return "a 4 KB result does not own its data"
    else:
        r.resize_(5000)  # a torch-allocated storage grows
        if r.numel() != 5000:
            return "a 4 KB result did not resize"
    return None


def check_resize(kind):
    """The documented difference of a cached result: it views cring's block,
    so it cannot grow in place (NumPy's ndarray.resize and torch's resize_
    to a larger size raise, as for any view); it can shrink, and
    np.resize / torch.cat make new ones."""
    r = oop_allreduce(kind, 0, N)
    try:
        if kind == "numpy":
            r.resize(2 * N)
        else:
            r.resize_(2 * N)
    except (ValueError, RuntimeError):
        pass
    else:
        return "a cached result grew in place"
    # (torch leaves a tensor whose resize_ failed with the new shape, as for
    # torch.from_numpy's tensors: start again from a new result)
    r = oop_allreduce(kind, 0, N)
    grown = np.resize(r, 2 * N) if kind == "numpy" else torch.cat([r, r])
    if grown.shape[0] != 2 * N:
        return f"a grown copy has shape {tuple(grown.shape)}"
    if kind == "torch":
        r.resize_(N // 2)
        if r.numel() != N // 2:
            return "a cached torch result did not shrink"
    return None


def check_shutdown_keeps_results():
    """shutdown() gives the idle blocks back; a result kept across it is
    still valid, and its block comes back to the cache when it goes."""
    r = oop_allreduce("numpy", 3, N)
    cring.shutdown()
    if stats()["idle_bytes"]:
        return f"idle blocks kept after shutdown: {stats()}"
    problem = compare(r, np.full(N, summed(3), np.float32))
    if problem:
        return f"a result kept across shutdown: {problem}"
    del r
    if stats()["idle_bytes"] < 3 * MIB:
        return f"the kept result's block did not come back: {stats()}"
    return None


if mode == "main":
    for kind in ("numpy", "torch"):
        for label, call, expected in CASES:
            checks.check(
                f"{kind} {label}: kept results",
                lambda k=kind, lab=label, c=call, e=expected: check_kept(k, lab, c, e),
            )
            checks.check(
                f"{kind} {label}: a view outlives its result",
                lambda k=kind, lab=label, c=call, e=expected: check_view_outlives(k, lab, c, e),
            )
        checks.check(f"{kind}: results are ordinary", lambda k=kind: check_ordinary(k))
        checks.check(
            f"{kind}: a loop maps no fresh memory", lambda k=kind: check_no_fresh_memory(k)
        )
        checks.check(f"{kind}: dropped on other threads", lambda k=kind: check_threads(k))
        checks.check(f"{kind}: small results unchanged", lambda k=kind: check_small_unchanged(k))
        checks.check(f"{kind}: resizing", lambda k=kind: check_resize(k))
    gc.collect()
    checks.info["stats"] = stats()
    checks.check("shutdown", check_shutdown_keeps_results)
    checks.finish()

elif mode == "cap":

    def check_cap():
        limit = stats()["limit_bytes"]
        if limit != 8 * MIB:
            return f"limit {limit}, CRING_RESULT_CACHE_BYTES says {8 * MIB}"
        kept = [oop_allreduce(kind, i, MIB) for i in range(6) for kind in ("numpy", "torch")]
        for j, r in enumerate(kept):  # 12 results of 4 MiB
            problem = compare(as_numpy(r), np.full(MIB, summed(j // 2), np.float32))
            if problem:
                return f"result {j}: {problem}"
        rss = rss_bytes()
        del kept, r
        gc.collect()
        st = stats()
        dropped = rss - rss_bytes()
        checks.info["rss_dropped_bytes"] = dropped
        if st["idle_bytes"] > limit or st["lent_bytes"]:
            return f"over the limit after dropping 48 MiB of results: {st}"
        if st["unmapped"] < 10:
            return f"only {st['unmapped']} blocks went back to the system: {st}"
        if dropped < 32 * MIB:  # 48 MiB dropped, at most 8 kept
            return f"the process's memory fell by {dropped} bytes only"
        return None

    checks.check("the limit holds", check_cap)
    checks.finish()

else:  # off

    def check_off():
        if stats()["limit_bytes"] != 0:
            return f"CRING_RESULT_CACHE_BYTES=0 but {stats()}"
        r = oop_allreduce("numpy", 0, N)
        if not r.flags.owndata:
            return "a NumPy result does not own its data with the cache off"
        t = oop_allreduce("torch", 0, N)
        t.resize_(2 * N)  # torch's own storage grows
        b = broadcast("numpy", 1, N)
        if not b.flags.owndata:
            return "a broadcast result does not own its data with the cache off"
        g = allgather("numpy", 2, N)  # the engine's memory, mapped for this result
        problem = compare(g, CASES[-1][2](2, N))
        if problem:
            return f"allgather: {problem}"
        del r, t, b, g
        gc.collect()
        return f"blocks kept with the cache off: {stats()}" if stats()["idle_bytes"] else None

    checks.check("the cache off", check_off)
    checks.finish()

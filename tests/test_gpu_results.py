"""Out-of-place results of CUDA tensors own their memory (issue 26, item 4),
on CPU against the test doubles, whose cudaFree and cudaFreeAsync overwrite
freed memory with 0xDB so a result read after its memory went shows it:

- at 2 and 3 ranks (tests/gpu/results_worker.py), 40 results of fake CUDA
  tensors (allgather even and uneven, reducescatter, out-of-place allreduce
  and broadcast, seven dtypes) keep only their NumPy views while 40 later
  collectives and allocations run, and every one is exact at the end; the
  allgather results' device memory is freed when the last view goes (one
  cudaFreeAsync each), not before, and no device-wide cudaFree runs at all
  (issue 33, finding 6);
- a CuPy-like producer (module-level empty/from_dlpack, no Array-API
  namespace) gets results of its own kind, exact;
- a device result is handed out once: its memory moves from the handle into
  the DLPack export, whose deleter frees it, whatever the handle does,
  ordered on the stream it was handed out on (torch's current stream).
Every process has a hard timeout.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import test_gpu_loader as loader

TIMEOUT_S = 120


def run_results(np_: int, env: dict, outdir) -> list:
    cmd = [
        sys.executable,
        "-m",
        "cring.run",
        "-np",
        str(np_),
        sys.executable,
        str(loader.GPU_TESTS / "results_worker.py"),
        str(outdir),
    ]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"results_worker.py on {np_} ranks hung\n{e.stdout}\n{e.stderr}")
    if proc.returncode != 0:
        pytest.fail(
            f"results_worker.py on {np_} ranks exited {proc.returncode}\n"
            f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
        )
    return [json.loads((outdir / f"rank{r}.json").read_text()) for r in range(np_)]


@pytest.mark.parametrize("np_", [2, 3])
def test_results_stay_exact_while_later_work_runs(fakes, tmp_path, np_):
    env = loader.clean_env(
        CRING_NCCL_LIBRARY=fakes["nccl"],
        CRING_CUDART_LIBRARY=fakes["cudart"],
        CRING_FAKE_CUDA_LOG=str(tmp_path / "cuda.log"),
    )
    for res in run_results(np_, env, tmp_path):
        assert res["size"] == np_ and res["checked"] == 40
        assert res["bad"] == [], res["bad"]
        # 16 of the 40 are allgathers (engine-allocated device memory): each
        # freed once, when its last view went, and not earlier, ordered on a
        # stream; and nothing, results, fusion buffers or later allgathers,
        # was ever freed by a device-wide cudaFree (issue 33, finding 6)
        assert res["frees_released"] == 16
        assert res["device_wide_frees"] == 0
        assert set(res["cupy_kinds"]) == {"allgather", "allreduce", "broadcast", "reducescatter"}
        assert set(res["cupy_kinds"].values()) == {"fake_cupy"}, res["cupy_kinds"]
        assert res["stats"]["staged_bytes"] == 0  # all through the NCCL path


def test_a_device_result_is_handed_out_once(fakes):
    code = """
        import gc, json, numpy as np
        import cring
        from cring import _C, _gpu
        from fake_cuda import FakeCudaTensor as F, consume
        cring.init()
        x = F(np.arange(6, dtype=np.float32))
        h = cring.allgather_async(x, name="once")
        res = cring.synchronize(h)
        inner = h._h
        try:
            _C.gpu.output_capsule(inner, 0, 0, [6], "float32")
            again = "no error"
        except ValueError as e:
            again = str(e)
        view = res.array
        del res, h, inner, x
        gc.collect()
        junk = [cring.allgather(F(np.full(6, 7, np.float32)), name=f"j{k}").array.copy()
                for k in range(5)]
        print(json.dumps({"again": again, "view": view.tolist()}))
        cring.shutdown()
    """
    env = loader.clean_env(CRING_NCCL_LIBRARY=fakes["nccl"], CRING_CUDART_LIBRARY=fakes["cudart"])
    out = loader.result(loader.run_py(code, env))
    assert "handed out already" in out["again"]
    assert out["view"] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]  # the handle is gone, the view is not


TORCH_ROOMS = """
import gc, json, os
import torch, cring
from cring import _gpu
import fake_torch_cuda
from fake_torch_cuda import cuda

# torch without CUDA, dressed as a CUDA build (tests/gpu/fake_torch_cuda.py,
# as test_gpu_engine's fast-path tests do): tensors say is_cuda and export
# their memory as kDLCUDA, the current stream is 0x4242, torch.empty is the
# caching allocator's stand-in, and from_dlpack takes the engine's memory
fake_torch_cuda.install()

cring.init()
r, p = cring.rank(), cring.size()
allocs = lambda: _gpu.stats()["device_allocs"]
out = {}
kept = []
for k in range(10):
    x = cuda(torch.arange(6, dtype=torch.float64).reshape(3, 2) + 100 * r + k)
    before = allocs()
    y = cring.allgather(x, name=f"even{k}")
    out.setdefault("even_allocs", []).append(allocs() - before)
    kept.append((y, torch.cat([torch.arange(6, dtype=torch.float64).reshape(3, 2) + 100 * q + k
                               for q in range(p)])))
    cring.allgather(cuda(torch.ones(5, dtype=torch.int32) * k), name=f"later{k}")
before = allocs()
u = cring.allgather(cuda(torch.full((r + 1, 2), r, dtype=torch.int64)), name="uneven")
out["uneven_allocs"] = allocs() - before
out["uneven_ok"] = u.tolist() == [[q, q] for q in range(p) for _ in range(q + 1)]
def calls(word):
    with open(os.environ["CRING_FAKE_CUDA_LOG"]) as f:
        return [l.split()[2:] for l in f if l.split()[:2] == [f"pid={os.getpid()}", word]]
before = len(calls("freeasync"))
del u  # the engine's memory (rank 0): freed on the stream it was handed out on
gc.collect()
out["freed_on"] = [c[0] for c in calls("freeasync")[before:]]
out["device_wide_frees"] = len(calls("free"))
g = cring.grouped_allgather([cuda(torch.full((2,), r, dtype=torch.int8)),
                             cuda(torch.tensor(float(r)))], name="group")
out["group"] = [g[0].tolist(), g[1].tolist()]
# alltoall: room of the input's size; an even exchange fits, so no cudaMalloc
a = cuda(torch.arange(4 * p, dtype=torch.float32).reshape(2 * p, 2) + 100 * r)
before = allocs()
y, got = cring.alltoall(a, name="a2a-even")
out["a2a_even_allocs"] = allocs() - before
sent = [torch.arange(4 * p, dtype=torch.float32).reshape(2 * p, 2) + 100 * q for q in range(p)]
out["a2a_even_ok"] = list(got) == [2] * p and torch.equal(
    y, torch.cat([sent[q][2 * r : 2 * r + 2] for q in range(p)])
)
# rank 0 sends every row to rank 1 (rank 0 receives none, rank 1 twice its own)
splits = [0, 2 * p] if r == 0 else [p, p]
before = allocs()
y, got = cring.alltoall(a, splits=splits, name="a2a-uneven")
out["a2a_uneven_allocs"] = allocs() - before
out["a2a_uneven_rows"] = [y.shape[0], list(got)]
out["kinds"] = sorted({type(y).__name__ for y, _ in kept})
out["bad"] = [i for i, (y, e) in enumerate(kept) if not torch.equal(y, e)]
out["rank"], out["size"] = r, p
print(json.dumps(out))
cring.shutdown()
"""


def test_torch_results_come_from_torchs_allocator(fakes, tmp_path):
    """Through stand-ins for torch's CUDA functions: a torch CUDA allgather
    lends the engine room from torch.empty (torch's caching allocator on a
    GPU), so results whose ranks' parts are no larger than this rank's cost
    no cudaMalloc; a larger uneven result falls back to the engine's memory
    handed over through from_dlpack. Exact, at 2 ranks."""
    pytest.importorskip("torch")
    script = tmp_path / "torch_rooms.py"
    script.write_text(TORCH_ROOMS)
    env = loader.clean_env(
        CRING_NCCL_LIBRARY=fakes["nccl"],
        CRING_CUDART_LIBRARY=fakes["cudart"],
        CRING_FAKE_CUDA_LOG=str(tmp_path / "cuda.log"),
    )
    cmd = [sys.executable, "-m", "cring.run", "-np", "2", sys.executable, str(script)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    outs = sorted(
        (json.loads(line.split("] ", 1)[1]) for line in proc.stdout.splitlines() if "{" in line),
        key=lambda o: o["rank"],
    )
    assert [o["rank"] for o in outs] == [0, 1]
    for o in outs:
        assert o["bad"] == [] and o["kinds"] == ["Tensor"]
        assert o["even_allocs"] == [0] * 10  # every even result in torch's memory
        assert o["uneven_ok"]
        assert o["group"] == [[0, 0, 1, 1], [0.0, 1.0]]
    # rank 0 lent room for 2 rows of 3: the engine's memory; rank 1 lent 4
    assert [o["uneven_allocs"] for o in outs] == [1, 0]
    # rank 0's went back when dropped, ordered on torch's current stream
    # (0x4242), where synchronize() had put the result: no device-wide wait
    assert [o["freed_on"] for o in outs] == [["stream=0x4242"], []]
    assert [o["device_wide_frees"] for o in outs] == [0, 0]
    # alltoall: the even exchange lands in the lent room; in the uneven one
    # rank 0 receives p of its 2p rows (fits), rank 1 receives 3p (does not)
    for o in outs:
        assert o["a2a_even_allocs"] == 0 and o["a2a_even_ok"], o
    assert [o["a2a_uneven_rows"] for o in outs] == [[2, [0, 2]], [6, [4, 2]]]
    assert [o["a2a_uneven_allocs"] for o in outs] == [0, 1]

"""Out-of-place results of CUDA tensors own their memory (issue 26, item 4),
on CPU against the test doubles, whose cudaFree overwrites freed memory with
0xDB so a result read after its memory went shows it:

- at 2 and 3 ranks (tests/gpu/results_worker.py), 40 results of fake CUDA
  tensors (allgather even and uneven, reducescatter, out-of-place allreduce
  and broadcast, seven dtypes) keep only their NumPy views while 40 later
  collectives and allocations run, and every one is exact at the end; the
  allgather results' device memory is freed when the last view goes (one
  cudaFree each), not before;
- a CuPy-like producer (module-level empty/from_dlpack, no Array-API
  namespace) gets results of its own kind, exact;
- a device result is handed out once: its memory moves from the handle into
  the DLPack export, whose deleter frees it, whatever the handle does.
Every process has a hard timeout.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import test_gpu_loader as loader

fakes = loader.fakes  # the fixture that builds the test doubles
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
        # freed once, when its last view went, and not earlier
        assert res["frees_released"] == 16
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

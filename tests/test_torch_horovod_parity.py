"""cring.torch where Horovod's own test suite reads its answers (issue 26,
item 1's Python layer), on CPU:

- nccl_built() is the NCCL version code Horovod's tests compare (`< 2700`),
  0 without NCCL; the other *_built()/*_enabled() answers are booleans, as
  Horovod's (mpi_threads_supported() is False where Horovod's would raise);
- a call mixing CUDA and CPU tensors raises an error that is a RuntimeError
  (what Horovod's tests and users catch) and still a ValueError, through cring
  and through cring.torch (not turned into HorovodInternalError);
- SyncBatchNorm runs Horovod's test_horovod_sync_batch_norm at 1 and 2 ranks:
  equal to BatchNorm1d over every rank's samples, and at one rank with one
  value per channel it refuses the batch exactly as BatchNorm1d does (Horovod's
  runs F.batch_norm at one rank, which refuses it too).
Every process has a hard timeout.
"""

from __future__ import annotations

import pytest
import test_gpu_loader as loader

from conftest import rank_results, run_ranks

torch = pytest.importorskip("torch")


def test_nccl_built_is_the_version_code(fakes):
    code = """
        import json, cring.torch as hvd
        print(json.dumps([hvd.nccl_built(), type(hvd.nccl_built()).__name__]))
    """
    env = loader.clean_env(CRING_NCCL_LIBRARY=fakes["nccl"], CRING_FAKE_NCCL_VERSION="22809")
    assert loader.result(loader.run_py(code, env)) == [22809, "int"]
    # an NCCL cring refuses (older than 2.10.3) is no NCCL to it
    env = loader.clean_env(CRING_NCCL_LIBRARY=fakes["nccl"], CRING_FAKE_NCCL_VERSION="2604")
    assert loader.result(loader.run_py(code, env)) == [0, "int"]
    env = loader.clean_env(CRING_NCCL_LIBRARY="/nonexistent/libnccl.so.2")
    assert loader.result(loader.run_py(code, env)) == [0, "int"]


def test_mixed_devices_raise_a_runtime_error(fakes):
    code = """
        import json, numpy as np, torch
        import cring, cring.torch as hvd
        from fake_cuda import FakeCudaTensor as F
        hvd.init()
        seen = {}
        for label, call in (
            ("cring", lambda: cring.grouped_allreduce([F(np.ones(3, np.float32)),
                                                       np.ones(3, np.float32)], name="m1")),
            ("cring.torch", lambda: hvd.grouped_allreduce([torch.ones(3),
                                                           F(np.ones(3, np.float32))], name="m2")),
            ("cring allgather", lambda: cring.grouped_allgather([np.ones(2, np.float32),
                                                                F(np.ones(2, np.float32))])),
        ):
            try:
                call()
                seen[label] = None
            except Exception as e:
                seen[label] = [type(e).__name__, isinstance(e, RuntimeError),
                               isinstance(e, ValueError),
                               isinstance(e, hvd.HorovodInternalError), str(e)]
        after = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="after")
        seen["after"] = after.tolist()
        hvd.shutdown()
        print(json.dumps(seen))
    """
    env = loader.clean_env(CRING_NCCL_LIBRARY=fakes["nccl"], CRING_CUDART_LIBRARY=fakes["cudart"])
    seen = loader.result(loader.run_py(code, env))
    for label in ("cring", "cring.torch", "cring allgather"):
        assert seen[label] is not None, f"{label}: mixing devices did not raise"
        name, is_runtime, is_value, is_internal, message = seen[label]
        assert is_runtime and is_value and not is_internal, seen[label]
        assert "same device" in message and "not CUDA tensors" in message, message
    assert seen["after"] == [1.0, 1.0]  # the job goes on


def test_built_functions_answer_with_horovods_types():
    import cring.torch as hvd

    for f in (hvd.mpi_built, hvd.mpi_enabled, hvd.gloo_built, hvd.gloo_enabled, hvd.ddl_built):
        assert f() is False
    assert hvd.ccl_built() is False and hvd.rocm_built() is False
    assert type(hvd.cuda_built()) is bool
    # Horovod's raises ValueError without MPI; cring answers False (documented)
    assert hvd.mpi_threads_supported() is False


@pytest.mark.parametrize("np_", [1, 2])
def test_sync_batch_norm_runs_horovods_test(tmp_path, np_):
    run_ranks(np_, "horovod_sync_bn.py", str(tmp_path), timeout=180)
    for res in rank_results(tmp_path, np_):
        assert res["size"] == np_
        first, second = res["cases"]
        assert first["checks"] and all(first["checks"].values()), first
        if np_ == 1:  # one value per channel in all: refused as BatchNorm1d refuses it
            assert "Expected more than 1 value per channel" in second["refused"]
            assert second["sync_refused"] == second["refused"]
        else:  # one value per channel on each rank, two in all: computed
            assert second["checks"] and all(second["checks"].values()), second

"""Horovod's public module paths with `horovod` renamed to `cring`: every one
imports, and the names Horovod's modules export are cring's own objects (the
same class or function as in cring.torch / cring.ray), or, for Horovod's
internals cring has no counterpart of, an AttributeError that says what to
use instead. In-process imports only (no ranks)."""

from __future__ import annotations

import importlib

import pytest

pytest.importorskip("torch")

import cring  # noqa: E402
import cring.torch as hvd  # noqa: E402

# Horovod's module path (renamed) -> {name it exports: the cring object it must be}
TORCH_PATHS = {
    "cring.torch.mpi_ops": {
        "allreduce": hvd.allreduce,
        "allreduce_async_": hvd.allreduce_async_,
        "allgather": hvd.allgather,
        "broadcast": hvd.broadcast,
        "broadcast_": hvd.broadcast_,
        "reducescatter": hvd.reducescatter,
        "alltoall": hvd.alltoall,
        "grouped_allreduce": hvd.grouped_allreduce,
        "synchronize": hvd.synchronize,
        "poll": hvd.poll,
        "join": hvd.join,
        "barrier": hvd.barrier,
        "init": hvd.init,
        "shutdown": hvd.shutdown,
        "size": hvd.size,
        "rank": hvd.rank,
        "local_rank": hvd.local_rank,
        "Average": hvd.Average,
        "Sum": hvd.Sum,
        "Adasum": hvd.Adasum,
        "ProcessSet": hvd.ProcessSet,
        "global_process_set": hvd.global_process_set,
        "add_process_set": hvd.add_process_set,
        "HorovodInternalError": hvd.HorovodInternalError,
        "nccl_built": hvd.nccl_built,
    },
    "cring.torch.compression": {
        "Compression": hvd.Compression,
        "Compressor": hvd.Compressor,
        "NoneCompressor": hvd.NoneCompressor,
        "FP16Compressor": hvd.FP16Compressor,
    },
    "cring.torch.functions": {
        "broadcast_parameters": hvd.broadcast_parameters,
        "broadcast_optimizer_state": hvd.broadcast_optimizer_state,
        "broadcast_object": hvd.broadcast_object,
        "allgather_object": hvd.allgather_object,
    },
    "cring.torch.optimizer": {"DistributedOptimizer": hvd.DistributedOptimizer},
    "cring.torch.sync_batch_norm": {"SyncBatchNorm": hvd.SyncBatchNorm},
    "cring.torch.elastic": {
        "run": hvd.elastic.run,
        "TorchState": hvd.elastic.TorchState,
        "ElasticSampler": hvd.elastic.ElasticSampler,
    },
    "cring.torch.elastic.sampler": {"ElasticSampler": hvd.elastic.ElasticSampler},
    "cring.torch.elastic.state": {"TorchState": hvd.elastic.TorchState},
    "cring.runner": {"run": cring.run},
}


def _same(got, want) -> bool:
    # cring.run is both the function and, once `import cring.run` ran, its callable module
    return got is want or (
        getattr(want, "__name__", None) == "cring.run"
        and got is importlib.import_module("cring._run_api").run
    )


@pytest.mark.parametrize("path", sorted(TORCH_PATHS))
def test_torch_and_runner_paths_resolve_to_cring_objects(path):
    module = importlib.import_module(path)
    for name, want in TORCH_PATHS[path].items():
        assert hasattr(module, name), f"{path}.{name} is missing"
        assert _same(getattr(module, name), want), f"{path}.{name} is not cring's object"


def test_horovods_example_imports():
    """The import lines of Horovod's PyTorch examples, renamed."""
    from cring.runner import run
    from cring.torch.elastic.sampler import ElasticSampler
    from cring.torch.elastic.state import TorchState

    assert ElasticSampler is hvd.elastic.ElasticSampler
    assert TorchState is hvd.elastic.TorchState
    assert run is importlib.import_module("cring._run_api").run
    assert importlib.import_module("cring.torch.elastic").__path__, "a package"
    state = importlib.import_module("cring.torch.elastic.state")
    with pytest.raises(AttributeError, match="state_dict"):
        state.set_handler_registry  # noqa: B018  (Horovod's registry: refused with a hint)


def test_ray_paths_resolve_to_cring_objects():
    pytest.importorskip("ray.train")
    import cring.ray as ring_ray
    from cring.ray import _hosts

    expected = {
        "cring.ray": {
            "RayExecutor": ring_ray.RayExecutor,
            "ElasticRayExecutor": ring_ray.ElasticRayExecutor,
        },
        "cring.ray.runner": {
            "RayExecutor": ring_ray.RayExecutor,
            "MiniSettings": ring_ray.RaySettings,
        },
        "cring.ray.elastic": {
            "ElasticRayExecutor": ring_ray.ElasticRayExecutor,
            "RayHostDiscovery": _hosts.RayHostDiscovery,
            "TestDiscovery": _hosts.TestDiscovery,
        },
        "cring.ray.elastic_v2": {
            "RayHostDiscovery": _hosts.RayHostDiscovery,
            "TestDiscovery": _hosts.TestDiscovery,
        },
        "cring.ray.ray_logger": {},
    }
    for path, names in expected.items():
        module = importlib.import_module(path)
        for name, want in names.items():
            assert getattr(module, name) is want, f"{path}.{name}"
    logger = importlib.import_module("cring.ray.ray_logger")
    assert callable(logger.log) and callable(logger.configure)
    # Horovod's internals: a clear error naming what to use
    for path, name, hint in [
        ("cring.ray.runner", "Coordinator", "RayExecutor"),
        ("cring.ray.elastic_v2", "ElasticParams", "min_workers"),
        ("cring.ray.strategy", "ColocatedStrategy", "num_hosts"),
        ("cring.ray.strategy", "PGStrategy", "placement"),
    ]:
        with pytest.raises(AttributeError, match=hint):
            getattr(importlib.import_module(path), name)

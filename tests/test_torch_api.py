"""cring.torch, the drop-in for horovod.torch (issue: torch layer, items 1 and
2): `import cring.torch as hvd` and a Horovod script keeps working. The
collectives, their gradients and their errors run on real ranks with a hard
timeout (workers/torch_api_*.py); names, signatures, compressors and the
errors that need no ranks are checked in this process."""

import inspect

import pytest

from conftest import rank_results, run_ranks

torch = pytest.importorskip("torch")

import cring  # noqa: E402
import cring.torch as hvd  # noqa: E402

TIMEOUT_S = 120


@pytest.fixture(scope="module", params=[2, 3], ids=["np2", "np3"])
def main_run(request, tmp_path_factory):
    """One run of workers/torch_api_main.py per world size: its per-rank results."""
    out = tmp_path_factory.mktemp(f"torch_api_np{request.param}")
    proc = run_ranks(request.param, "torch_api_main.py", str(out), timeout=TIMEOUT_S, check=False)
    return request.param, proc, rank_results(out, request.param) if proc.returncode == 0 else None


def test_collectives_gradients_and_errors_on_real_ranks(main_run):
    """Every collective of horovod.torch in all its forms, checked against
    NumPy references; gradients through allreduce, grouped_allreduce,
    allgather, grouped_allgather, broadcast, reducescatter and
    grouped_reducescatter and alltoall against analytic values; join() with
    uneven batches through DistributedOptimizer against a single-process
    replay; and the errors (mismatch on every rank, duplicate in-flight
    names, root out of range, unsupported dtypes, average with op, process
    sets, alltoall splits, Adasum)."""
    np_, proc, results = main_run
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    for r, result in enumerate(results):
        assert result["failures"] == [], result["failures"]
        assert result["cases"] == 22, result
        # the five mismatches were errors of the engine on every rank
        assert result["engine_errors"] == 5, result
        assert f"[{r}] rank {r}: 22 checks, 0 failed" in proc.stdout


def test_grouped_allreduce_with_mixed_dtypes(main_run):
    _, proc, results = main_run
    assert results is not None, proc.stdout[-6000:]
    problems = [r["mixed_dtype_group_problem"] for r in results]
    assert problems == [None] * len(results), problems[0]


def test_communication_failure_is_horovod_internal_error():
    """A stalled collective shut down by CRING_STALL_SHUTDOWN_SECONDS raises
    HorovodInternalError on every rank (also a cring.TimeoutError, with the
    cring error as __cause__); so does new work on the broken communicator;
    hvd.shutdown() + hvd.init() recover, as Horovod's elastic loop expects."""
    proc = run_ranks(
        2,
        "torch_api_failure.py",
        timeout=TIMEOUT_S,
        env={"CRING_STALL_CHECK_SECONDS": "1", "CRING_STALL_SHUTDOWN_SECONDS": "1"},
    )
    for r in range(2):
        assert (
            f"[{r}] rank {r}: HorovodInternalError TimeoutInternalError timeout=True "
            f"cause=TimeoutError: allreduce of tensor 'only.{r}' failed"
        ) in proc.stdout
        assert f"[{r}] rank {r}: refused: HorovodInternalError cause=TimeoutError" in proc.stdout
        assert f"[{r}] rank {r}: works after re-init: [1.0, 1.0]" in proc.stdout


def test_horovod_style_training_script():
    """A Horovod training script with only the import changed: different
    initial weights made equal by broadcast_parameters, DistributedOptimizer,
    broadcast_optimizer_state, allreduce of the loss, allgather_object; the
    weights match single-process full-batch training."""
    proc = run_ranks(2, "torch_api_dropin.py", timeout=TIMEOUT_S)
    for r in range(2):
        assert f"[{r}] rank {r}: dropin ok" in proc.stdout, proc.stdout


# ---- in this process: names, signatures, compressors, local errors ---------------------------

G = hvd.global_process_set
NONE = hvd.Compression.none
HOROVOD_SIGNATURES = {
    "allreduce": [
        "tensor",
        ("average", None),
        ("name", None),
        ("compression", NONE),
        ("op", None),
        ("prescale_factor", 1.0),
        ("postscale_factor", 1.0),
        ("process_set", G),
    ],
    "grouped_allreduce": [
        "tensors",
        ("average", None),
        ("name", None),
        ("compression", NONE),
        ("op", None),
        ("prescale_factor", 1.0),
        ("postscale_factor", 1.0),
        ("process_set", G),
    ],
    "allgather": ["tensor", ("name", None), ("process_set", G)],
    "allgather_async": ["tensor", ("name", None), ("process_set", G)],
    "grouped_allgather": ["tensors", ("name", None), ("process_set", G)],
    "grouped_allgather_async": ["tensors", ("name", None), ("process_set", G)],
    "broadcast_object": ["obj", ("root_rank", 0), ("name", None), ("process_set", G)],
    "allgather_object": ["obj", ("name", None), ("process_set", G)],
    "reducescatter": [
        "tensor",
        ("name", None),
        ("compression", NONE),
        ("op", hvd.Average),
        ("process_set", G),
        ("prescale_factor", 1.0),
        ("postscale_factor", 1.0),
    ],
    "reducescatter_async": [
        "tensor",
        ("name", None),
        ("op", hvd.Average),
        ("process_set", G),
        ("prescale_factor", 1.0),
        ("postscale_factor", 1.0),
    ],
    "grouped_reducescatter": [
        "tensors",
        ("name", None),
        ("compression", NONE),
        ("op", hvd.Average),
        ("process_set", G),
        ("prescale_factor", 1.0),
        ("postscale_factor", 1.0),
    ],
    "grouped_reducescatter_async": [
        "tensors",
        ("name", None),
        ("op", hvd.Average),
        ("process_set", G),
        ("prescale_factor", 1.0),
        ("postscale_factor", 1.0),
    ],
    "alltoall": ["tensor", ("splits", None), ("name", None), ("process_set", G)],
    "join": [("device", -1)],
    "barrier": [("process_set", G)],
    "poll": ["handle"],
    "synchronize": ["handle"],
}
for _f in ("allreduce_", "allreduce_async", "allreduce_async_"):
    HOROVOD_SIGNATURES[_f] = [p for p in HOROVOD_SIGNATURES["allreduce"] if p[0] != "compression"]
for _f in ("grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_"):
    HOROVOD_SIGNATURES[_f] = [
        p for p in HOROVOD_SIGNATURES["grouped_allreduce"] if p[0] != "compression"
    ]
for _f in ("broadcast", "broadcast_", "broadcast_async", "broadcast_async_"):
    HOROVOD_SIGNATURES[_f] = ["tensor", "root_rank", ("name", None), ("process_set", G)]


@pytest.mark.parametrize("function", sorted(HOROVOD_SIGNATURES))
def test_signature_matches_horovod(function):
    params = list(inspect.signature(getattr(hvd, function)).parameters.values())
    got = [p.name if p.default is inspect.Parameter.empty else (p.name, p.default) for p in params]
    assert got == HOROVOD_SIGNATURES[function]


def test_horovod_names_exist():
    names = (
        """init shutdown is_initialized rank size local_rank local_size cross_rank
        cross_size start_timeline stop_timeline mpi_built mpi_enabled mpi_threads_supported
        gloo_built gloo_enabled nccl_built ddl_built ccl_built cuda_built rocm_built
        Average Sum Adasum Min Max Product Compression HorovodInternalError
        HostsUpdatedInterrupt ProcessSet global_process_set add_process_set remove_process_set
        alltoall_async DistributedOptimizer broadcast_parameters broadcast_optimizer_state
        """.split()
        + list(HOROVOD_SIGNATURES)
    )
    assert [n for n in names if not hasattr(hvd, n)] == []
    assert [
        int(op) for op in (hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max, hvd.Product)
    ] == [0, 1, 2, 3, 4, 5]  # Horovod's values


def test_introspection_is_truthful():
    assert [
        f()
        for f in (
            hvd.mpi_built,
            hvd.mpi_enabled,
            hvd.mpi_threads_supported,
            hvd.gloo_built,
            hvd.gloo_enabled,
            hvd.ddl_built,
            hvd.ccl_built,
            hvd.rocm_built,
        )
    ] == [False] * 8
    assert hvd.cring_built() is True
    # NCCL and CUDA are loaded at run time: "built" means "usable here"; NCCL's
    # answer is its version code, 0 without it (Horovod's tests compare it)
    code = hvd.nccl_built()
    assert type(code) is int
    assert code == (cring._gpu.nccl_info()["version_code"] if cring.nccl_available() else 0)
    assert hvd.cuda_built() is bool(cring.cuda_available())


def test_compressors_behave_like_horovods():
    x = torch.linspace(-2, 2, 7)
    for compressor, dtype in (
        (hvd.Compression.fp16, torch.float16),
        (hvd.Compression.bf16, torch.bfloat16),
    ):
        small, ctx = compressor.compress(x)
        assert small.dtype == dtype and ctx == torch.float32
        back = compressor.decompress(small, ctx)
        assert back.dtype == torch.float32 and torch.allclose(back, x, atol=1e-2)
        ints, ctx = compressor.compress(torch.arange(3))
        assert ints.dtype == torch.int64 and compressor.decompress(ints, ctx).dtype == torch.int64
    same, ctx = hvd.Compression.none.compress(x)
    assert same is x and hvd.Compression.none.decompress(same, ctx) is x
    assert issubclass(hvd.Compression.fp16, hvd.Compressor)


def test_errors_raised_before_any_communication():
    assert not hvd.is_initialized()
    x = torch.ones(3)
    with pytest.raises(ValueError, match="supersedes average"):
        hvd.allreduce(x, average=True, op=hvd.Sum)
    with pytest.raises(ValueError, match="not registered"):
        hvd.allreduce(x, process_set=hvd.ProcessSet([0, 1]))
    # not initialised: a ValueError, as in Horovod, and not a HorovodInternalError
    for fn in (
        hvd.rank,
        hvd.size,
        lambda: hvd.allreduce(x),
        lambda: hvd.broadcast_(x, 0),
        hvd.join,
        lambda: hvd.alltoall(x, splits=[3]),
    ):
        with pytest.raises(ValueError) as info:
            fn()
        assert not isinstance(info.value, hvd.HorovodInternalError)


def test_horovod_internal_error_wraps_communication_failures():
    from cring.torch import mpi_ops

    assert issubclass(hvd.HorovodInternalError, RuntimeError)
    assert issubclass(hvd.HorovodInternalError, cring.CRingError)
    peer = mpi_ops._internal_error(cring.PeerFailureError("rank 1 closed its connection"))
    assert isinstance(peer, hvd.HorovodInternalError)
    assert isinstance(peer, cring.PeerFailureError) and "rank 1" in str(peer)
    assert isinstance(mpi_ops._internal_error(cring.TimeoutError("t")), cring.TimeoutError)
    assert type(mpi_ops._internal_error(cring.CRingError("c"))) is hvd.HorovodInternalError
    for unchanged in (
        cring.MismatchError("m"),
        cring.NotInitializedError("n"),
        ValueError("v"),
        TypeError("t"),
    ):
        assert mpi_ops._internal_error(unchanged) is None

    def fail():
        raise cring.PeerFailureError("peer 1 died")

    with pytest.raises(hvd.HorovodInternalError) as info:
        mpi_ops._run(fail)
    assert isinstance(info.value.__cause__, cring.PeerFailureError)
    assert hvd.HostsUpdatedInterrupt(True).skip_sync is True

"""cring's GPU path on a machine without a GPU, against test doubles:
libfake_nccl.so and libfake_cudart.so (csrc/tests/fake_*.c, compiled here)
whose "device memory" is host memory, fed with FakeCudaTensor, a DLPack
producer that claims kDLCUDA (tests/gpu/fake_cuda.py).

Covered: finding the libraries (absent, a bad CRING_NCCL_LIBRARY, the
override, a missing symbol, too old a version, an nvidia-nccl wheel layout on
the import path), what nccl_available()/cuda_available() answer, the error a
CUDA tensor gets without NCCL, every collective through the engine and its NCCL
backend at world sizes 1 and 2 (rank 0's unique id reaching rank 1, grouped
calls fused into one NCCL call, the caller's stream reaching __dlpack__ and
ordering cring's stream through events,
mismatches raised on every rank, CUDA allreduces submitted in different orders
on different ranks), NCCL's asynchronous errors, and the host-staged path
(CRING_GPU_OPERATIONS=host) at world size 2 without NCCL. Every process has a
hard timeout. What only a real GPU can show is in tests/gpu/ (docs/gpu.md).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import fake_gpu
import pytest

ROOT = Path(__file__).resolve().parent.parent
GPU_TESTS = ROOT / "tests" / "gpu"
TIMEOUT_S = 120


clean_env = fake_gpu.clean_env  # the environment of a process on the fakes


def run_py(code: str, env: dict, check: bool = True) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"hung for {TIMEOUT_S} s\nstdout:\n{e.stdout}\nstderr:\n{e.stderr}")
    if check and proc.returncode != 0:
        pytest.fail(f"exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


def result(proc: subprocess.CompletedProcess) -> dict:
    """The JSON object a snippet printed on its last line."""
    return json.loads(proc.stdout.strip().splitlines()[-1])


def system_has(lib: str) -> bool:
    import ctypes

    try:
        ctypes.CDLL(lib)
        return True
    except OSError:
        return False


def nccl_installed() -> bool:
    """A system libnccl.so.2 or an nvidia-nccl wheel that cring would find."""
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations) if spec else []
    wheel = any((Path(r) / "nccl" / "lib" / "libnccl.so.2").exists() for r in roots)
    return wheel or system_has("libnccl.so.2")


# ---- finding the libraries ----------------------------------------------------------------------

ALLREDUCE_ONE_CUDA_TENSOR = """
import json, numpy as np, cring
from fake_cuda import FakeCudaTensor
cring.init(rank=0, size=1)
try:
    cring.allreduce_(FakeCudaTensor(np.ones(3, np.float32)), name="grad")
    print(json.dumps({"error": None}))
except Exception as e:
    print(json.dumps({"error": str(e), "type": type(e).__name__,
                      "cring_error": isinstance(e, cring.CRingError)}))
"""


@pytest.mark.skipif(nccl_installed(), reason="this machine has NCCL")
def test_without_nccl_a_cuda_tensor_says_what_to_install(fakes):
    env = clean_env(CRING_CUDART_LIBRARY=fakes["cudart"])
    proc = run_py(
        """
        import json, cring
        print(json.dumps({"nccl": cring.nccl_available()}))
    """,
        env,
    )
    assert result(proc) == {"nccl": False}
    out = result(run_py(ALLREDUCE_ONE_CUDA_TENSOR, env))
    assert out["cring_error"], out
    assert "NCCL was not found" in out["error"]
    assert "pip install nvidia-nccl-cu12" in out["error"]
    assert "nvidia-nccl-cu13" in out["error"]
    assert "CRING_GPU_OPERATIONS=host" in out["error"]


def test_a_bad_nccl_path_is_named(fakes, tmp_path):
    not_a_library = tmp_path / "libnccl.so.2"
    not_a_library.write_text("not an ELF file")
    for path in ("/nonexistent/dir/libnccl.so.2", str(not_a_library)):
        env = clean_env(CRING_NCCL_LIBRARY=path, CRING_CUDART_LIBRARY=fakes["cudart"])
        assert result(
            run_py(
                """
            import json, cring
            print(json.dumps({"nccl": cring.nccl_available()}))
        """,
                env,
            )
        ) == {"nccl": False}
        out = result(run_py(ALLREDUCE_ONE_CUDA_TENSOR, env))
        assert f"CRING_NCCL_LIBRARY={path} cannot be used" in out["error"], out
        assert "pip install nvidia-nccl" in out["error"]


def test_the_override_loads_that_library(fakes):
    env = clean_env(CRING_NCCL_LIBRARY=fakes["nccl"], CRING_CUDART_LIBRARY=fakes["cudart"])
    info = result(
        run_py(
            """
        import json, cring
        from cring import _gpu
        print(json.dumps({"nccl": cring.nccl_available(), "cuda": cring.cuda_available(),
                          "info": _gpu.nccl_info(), "cuda_info": _gpu.cuda_info()}))
    """,
            env,
        )
    )
    assert info["nccl"] is True and info["cuda"] is True
    assert info["info"]["path"] == fakes["nccl"]
    assert info["info"]["version"] == "2.27.3"
    assert info["cuda_info"]["path"] == fakes["cudart"]
    assert info["cuda_info"]["device_count"] == 1


def test_a_library_without_a_needed_symbol_is_refused(fakes):
    env = clean_env(
        CRING_NCCL_LIBRARY=fakes["nccl_no_allgather"], CRING_CUDART_LIBRARY=fakes["cudart"]
    )
    info = result(
        run_py(
            """
        import json
        from cring import _gpu
        print(json.dumps(_gpu.nccl_info()))
    """,
            env,
        )
    )
    assert info["available"] is False
    assert "has no ncclAllGather" in info["error"]


def test_too_old_an_nccl_is_refused(fakes):
    env = clean_env(
        CRING_NCCL_LIBRARY=fakes["nccl"],
        CRING_CUDART_LIBRARY=fakes["cudart"],
        CRING_FAKE_NCCL_VERSION="2708",
    )
    out = result(run_py(ALLREDUCE_ONE_CUDA_TENSOR, env))
    assert "NCCL 2.7.8 is too old" in out["error"], out


@pytest.mark.skipif(system_has("libnccl.so.2"), reason="this machine has a system NCCL")
def test_the_nccl_wheel_layout_on_the_import_path_is_found(fakes, tmp_path):
    site = tmp_path / "site-packages"
    lib_dir = site / "nvidia" / "nccl" / "lib"
    lib_dir.mkdir(parents=True)
    shutil.copy(fakes["nccl"], lib_dir / "libnccl.so.2")
    env = clean_env(CRING_CUDART_LIBRARY=fakes["cudart"])
    env["PYTHONPATH"] = os.pathsep.join((str(site), env["PYTHONPATH"]))
    info = result(
        run_py(
            """
        import json
        from cring import _gpu
        print(json.dumps(_gpu.nccl_info()))
    """,
            env,
        )
    )
    assert info["available"] is True, info
    assert info["path"] == str(lib_dir / "libnccl.so.2")


def test_the_real_nccl_wheel_loads_without_a_gpu(fakes):
    """With nvidia-nccl-cu12/13 installed (or CRING_TEST_NCCL_SITE naming a
    folder it was installed into): found on the import path, version >= 2.10.3."""
    site = os.environ.get("CRING_TEST_NCCL_SITE")
    if not site and not (nccl_installed() and not system_has("libnccl.so.2")):
        pytest.skip("no nvidia-nccl wheel installed")
    env = clean_env()
    if site:
        env["PYTHONPATH"] = os.pathsep.join((site, env["PYTHONPATH"]))
    info = result(
        run_py(
            """
        import json, cring
        from cring import _gpu
        print(json.dumps({"nccl": _gpu.nccl_info(), "cuda": _gpu.cuda_info(),
                          "cuda_available": cring.cuda_available()}))
    """,
            env,
        )
    )
    assert info["nccl"]["available"] is True, info
    assert info["nccl"]["path"].endswith("nvidia/nccl/lib/libnccl.so.2")
    assert info["nccl"]["version_code"] >= 21003
    if info["cuda"]["device_count"] == 0:  # no GPU: cuda_available() says so, with the reason
        assert info["cuda_available"] is False
        assert info["cuda"]["error"]


@pytest.mark.parametrize("devices,expect", [("1", True), ("0", False), ("error", False)])
def test_cuda_available_needs_a_device(fakes, devices, expect):
    env = clean_env(CRING_CUDART_LIBRARY=fakes["cudart"], CRING_FAKE_CUDA_DEVICES=devices)
    info = result(
        run_py(
            """
        import json, cring
        from cring import _gpu
        print(json.dumps({"cuda": cring.cuda_available(), "info": _gpu.cuda_info()}))
    """,
            env,
        )
    )
    assert info["cuda"] is expect
    if devices == "error":
        assert "driver version is insufficient" in info["info"]["error"]


def test_a_bad_gpu_operations_value_is_a_value_error(fakes):
    env = clean_env(
        CRING_NCCL_LIBRARY=fakes["nccl"],
        CRING_CUDART_LIBRARY=fakes["cudart"],
        CRING_GPU_OPERATIONS="gpu-please",
    )
    out = result(run_py(ALLREDUCE_ONE_CUDA_TENSOR, env))
    assert out["type"] == "ValueError"
    assert "CRING_GPU_OPERATIONS must be 'nccl' or 'host', got 'gpu-please'" in out["error"]


# ---- one process: the NCCL path ------------------------------------------------------------------


def test_world_size_one_through_nccl(fakes, tmp_path):
    log = tmp_path / "nccl.log"
    env = clean_env(
        CRING_NCCL_LIBRARY=fakes["nccl"],
        CRING_CUDART_LIBRARY=fakes["cudart"],
        CRING_FAKE_NCCL_LOG=str(log),
    )
    out = result(
        run_py(
            """
        import json, numpy as np, cring
        from cring import _gpu
        from fake_cuda import FakeCudaTensor as F
        cring.init(rank=0, size=1)
        x = F(np.arange(6, dtype=np.float32))
        y = cring.allreduce(x, op=cring.Average)
        g = cring.allgather(F(np.ones((2, 3), np.int32)))
        rs = cring.reducescatter(F(np.arange(4, dtype=np.float64)), op=cring.Sum)
        mixed = None
        try:
            cring.grouped_allreduce([F(np.ones(2, np.float32)), np.ones(2, np.float32)])
        except ValueError as e:
            mixed = str(e)
        stats = _gpu.stats()
        cring.shutdown()
        cring.init(rank=0, size=1)  # a new init gets a new communicator
        cring.allreduce_(x)
        stats2 = _gpu.stats()
        cring.shutdown()
        print(json.dumps({"y": y.array.tolist(), "y_type": type(y).__name__,
                          "g": g.array.tolist(), "rs": rs.array.tolist(), "mixed": mixed,
                          "stats": stats, "stats2": stats2}))
    """,
            env,
        )
    )
    assert out["y"] == list(range(6)) and out["y_type"] == "FakeCudaTensor"
    assert out["g"] == [[1, 1, 1], [1, 1, 1]]
    assert out["rs"] == [0.0, 1.0, 2.0, 3.0]
    assert "same device" in out["mixed"]
    assert out["stats"]["communicators"] == 1 and out["stats"]["groups"] == 3
    assert out["stats2"]["communicators"] == 2
    lines = log.read_text().splitlines()
    assert sum(" init rank=0 nranks=1 " in ln for ln in lines) == 2
    assert sum(" destroy rank=0" in ln for ln in lines) == 2  # shutdown() destroys them


def test_an_asynchronous_nccl_error_is_raised(fakes):
    env = clean_env(
        CRING_NCCL_LIBRARY=fakes["nccl"],
        CRING_CUDART_LIBRARY=fakes["cudart"],
        CRING_FAKE_NCCL_FAIL_AFTER="1",
    )
    out = result(
        run_py(
            """
        import json, numpy as np, cring
        from fake_cuda import FakeCudaTensor as F
        cring.init(rank=0, size=1)
        x = F(np.ones(3, np.float32))
        h = cring.allreduce_async_(x)
        errors = []
        # the error is the device's: known once the work has run, which
        # block_host waits for (a plain synchronize() may return before)
        for attempt in (lambda: cring.synchronize(h, block_host=True),
                        lambda: cring.allreduce_(x)):
            try:
                attempt()
                errors.append(None)
            except cring.CRingError as e:
                errors.append([type(e).__name__, str(e)])
        cring.shutdown()
        print(json.dumps(errors))
    """,
            env,
        )
    )
    assert out[0][0] == "PeerFailureError"
    assert "remote process exited" in out[0][1]
    assert out[1] is not None and "remote process exited" in out[1][1]


# ---- two processes ------------------------------------------------------------------------------


def run_world(np_: int, env: dict, outdir: Path) -> list:
    cmd = [
        sys.executable,
        "-m",
        "cring.run",
        "-np",
        str(np_),
        sys.executable,
        str(GPU_TESTS / "fake_worker.py"),
        str(outdir),
    ]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"fake_worker.py on {np_} ranks hung\nstdout:\n{e.stdout}\nstderr:\n{e.stderr}")
    if proc.returncode != 0:
        pytest.fail(
            f"fake_worker.py on {np_} ranks exited {proc.returncode}\n"
            f"stdout:\n{proc.stdout[-6000:]}\nstderr:\n{proc.stderr[-6000:]}"
        )
    return [json.loads((outdir / f"rank{r}.json").read_text()) for r in range(np_)]


def test_two_ranks_through_nccl(fakes, tmp_path):
    nccl_log, cuda_log = tmp_path / "nccl.log", tmp_path / "cuda.log"
    env = clean_env(
        CRING_NCCL_LIBRARY=fakes["nccl"],
        CRING_CUDART_LIBRARY=fakes["cudart"],
        CRING_FAKE_NCCL_LOG=str(nccl_log),
        CRING_FAKE_CUDA_LOG=str(cuda_log),
    )
    ranks = run_world(2, env, tmp_path)  # the worker checks every value itself
    for r in ranks:
        assert r["stats"]["communicators"] == 1  # one per device, created once
        assert r["stats"]["staged_bytes"] == 0  # nothing went through host memory
        assert r["mismatch"] and "ranks disagree on tensor 'mismatch'" in r["mismatch"]
        assert "shape float32 [4] vs float32 [5]" in r["mismatch"]
        # CUDA on one rank, CPU on another
        assert "tensor 'mixed_devices'" in r["mismatch"] and "cuda:0 tensor" in r["mismatch"]
        assert r["any_order"] == 6  # allreduces submitted in different orders all completed
        assert r["default_streams"] == [1, 1, 1]  # no framework stream: the legacy default
    lines = nccl_log.read_text().splitlines()
    inits = [re.search(r"init rank=(\d) nranks=2 id=(\S+)", ln) for ln in lines]
    inits = [m.groups() for m in inits if m]
    assert sorted(rank for rank, _ in inits) == ["0", "1"]
    assert inits[0][1] == inits[1][1]  # rank 0's unique id reached rank 1
    # the grouped call of three tensors (one empty) ran as one NCCL call on the
    # fused buffer of 1 + 1001 elements
    for rank in ("0", "1"):
        assert any(f"allreduce rank={rank} count=1002 " in ln for ln in lines)
    # the caller's stream got the producer's event; NCCL ran on cring's stream after it
    cuda = cuda_log.read_text().splitlines()
    for rank, stream in (("0", "0x1234"), ("1", "0x1235")):
        assert any("eventrecord " in ln and f"stream={stream}" in ln for ln in cuda)
        assert any(f"streamwait stream={stream} " in ln for ln in cuda)  # synchronize()
        assert any(
            f"allreduce rank={rank} count=4 " in ln and "stream=0xc0de" in ln for ln in lines
        )
    assert not any(" kind=H2D" in ln or " kind=D2H" in ln for ln in cuda)  # nothing staged
    assert not any(" sync stream" in ln or "eventsync" in ln for ln in cuda)  # no host wait
    assert any(" setdevice 0" in ln for ln in cuda)


def test_two_ranks_staged_through_host_memory(fakes, tmp_path):
    cuda_log = tmp_path / "cuda.log"
    env = clean_env(
        CRING_GPU_OPERATIONS="host",
        CRING_NCCL_LIBRARY="/nonexistent/libnccl.so.2",
        CRING_CUDART_LIBRARY=fakes["cudart"],
        CRING_FAKE_CUDA_LOG=str(cuda_log),
    )
    ranks = run_world(2, env, tmp_path)  # works without NCCL
    for r in ranks:
        assert r["nccl"]["available"] is False
        assert r["stats"]["communicators"] == 0
        assert r["stats"]["staged_bytes"] > 0
        assert r["stats"]["pinned_allocs"] <= 4  # pinned buffers are reused
    lines = cuda_log.read_text().splitlines()
    for stream in ("0x1234", "0x1235"):
        mine = [ln.split(" ", 1)[1] for ln in lines if f"stream={stream}" in ln]
        # device to host, wait for that stream only, CPU collective, host to device, wait
        assert mine == [
            "memcpy kind=D2H bytes=16 stream=" + stream,
            "sync stream=" + stream,
            "memcpy kind=H2D bytes=16 stream=" + stream,
            "sync stream=" + stream,
        ]

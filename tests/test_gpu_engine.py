"""The non-blocking, fused NCCL path of the engine (issue 16, items 3-4) on a
machine without a GPU, against the test doubles (csrc/tests/fake_*.c, built
by test_gpu_loader's `fakes` fixture) and FakeCudaTensor, at 2 and 3 ranks,
every process under a hard timeout:

- a CUDA allreduce_async_ submitted on one rank returns at once while another
  rank submits 2 s later, and its result is right after synchronize();
- 100 small CUDA tensors submitted asynchronously reach NCCL as at most 2
  collective calls (counted by the fake NCCL's log and by cring), exactly;
  small ones interleaved with large ones share calls with them (issue 26:
  on CUDA large tensors are packed too; tests/test_gpu_buckets.py has the
  gradient buckets);
- mismatches and different submission orders behave as for CPU tensors
  (tests/gpu/fake_worker.py, also at 3 ranks);
- a killed peer makes the survivors' CUDA allreduce raise PeerFailureError;
- the order of events on the fake runtime: an event recorded on the
  caller's stream, cring's stream waiting on it, NCCL on cring's stream;
- the C fast path of cring.allreduce_/allreduce_async_ (and cring.torch's)
  for torch CUDA tensors (torch dressed as a CUDA build): no frame of cring's
  Python code.
What only a real GPU shows is listed in docs/gpu.md.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import test_gpu_loader as loader

from test_bootstrap import free_port

GPU_TESTS, clean_env, run_world = loader.GPU_TESTS, loader.clean_env, loader.run_world

TIMEOUT_S = 90


def start_ranks(
    world_size: int, mode: str | list, env: dict, script: str = "engine_worker.py"
) -> list[dict]:
    """Run tests/gpu/<script> with argv mode (a word or a list) on every rank."""
    args = [mode] if isinstance(mode, str) else list(mode)
    port = str(free_port())
    procs = []
    for r in range(world_size):
        e = dict(
            env,
            CRING_RANK=str(r),
            CRING_SIZE=str(world_size),
            CRING_ADDR="127.0.0.1",
            CRING_PORT=port,
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(GPU_TESTS / script), *args],
                env=e,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=TIMEOUT_S))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"{script} {' '.join(args)} on {world_size} ranks hung")
    results = []
    for p, (out, err) in zip(procs, outs):
        lines = out.strip().splitlines()
        results.append(
            {
                "returncode": p.returncode,
                "stderr": err[-4000:],
                **(json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}),
            }
        )
    return results


def fake_env(fakes: dict, **extra: str) -> dict:
    return clean_env(
        CRING_NCCL_LIBRARY=fakes["nccl"],
        CRING_CUDART_LIBRARY=fakes["cudart"],
        CRING_FAKE_NCCL_TIMEOUT_S="20",
        **extra,
    )


@pytest.mark.parametrize("world_size", [2, 3])
def test_submission_never_waits_for_another_rank(fakes, world_size):
    ranks = start_ranks(world_size, "late", fake_env(fakes))
    for r in ranks:
        assert r["returncode"] == 0, r["stderr"]
        assert r["late_ok"] and r["blocked_ok"], r
        assert r["submit_s"] < 0.05, r  # rank 1 submits 2 s later: nobody waits for it here
    assert ranks[0]["sync_s"] > 1.5  # synchronize() waited for rank 1 to submit


@pytest.mark.parametrize("world_size", [2, 3])
def test_one_hundred_small_tensors_take_at_most_two_nccl_calls(fakes, tmp_path, world_size):
    log = tmp_path / "nccl.log"
    # the Python path of FakeCudaTensor costs tens of microseconds per call: a
    # cycle of 100 ms lets all 100 arrive before the first round takes them
    ranks = start_ranks(
        world_size, "fuse", fake_env(fakes, CRING_FAKE_NCCL_LOG=str(log), CRING_CYCLE_TIME="100")
    )
    lines = log.read_text().splitlines()
    for r in ranks:
        assert r["returncode"] == 0, r["stderr"]
        assert r["exact"], r
        assert 1 <= r["nccl_calls"] <= 2, r
        # cring's stream waited on every producer's event, and synchronize() made the
        # caller's stream wait on each handle's completion event
        assert r["stream_waits"] == 200
        assert r["fused_copies"] == 200  # packed into and out of the device fusion buffer
        calls = [ln for ln in lines if ln.startswith(f"pid={r['pid']} allreduce ")]
        assert 1 <= len(calls) <= 2, calls  # what the fake NCCL itself was called with
        assert sum(int(re.search(r"count=(\d+)", ln).group(1)) for ln in calls) == sum(
            k % 7 + 1 for k in range(100)
        )


def test_small_gradients_between_large_ones_share_nccl_calls(fakes):
    """20 tensors of 1 MiB interleaved with 40 small ones in one burst: on
    CUDA the large ones are packed too, so the burst is a call or two (about
    40 calls when a batch ended at each large tensor; 21-24 when the large
    ones ran alone)."""
    env = fake_env(fakes, CRING_CYCLE_TIME="100", CRING_FAKE_NCCL_SLOT_BYTES=str(32 << 20))
    for r in start_ranks(2, "mixed", env):
        assert r["returncode"] == 0, r["stderr"]
        assert r["exact"], r
        assert 1 <= r["nccl_calls"] <= 2, r


def test_mismatch_and_any_order_at_three_ranks(fakes, tmp_path):
    ranks = run_world(3, fake_env(fakes), tmp_path)  # the worker checks every value itself
    for r in ranks:
        assert r["mismatch"] and "ranks disagree on tensor 'mismatch'" in r["mismatch"]
        assert "tensor 'mixed_devices'" in r["mismatch"]
        assert r["any_order"] == 6
        assert r["stats"]["communicators"] == 1


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_killed_peer_raises_peer_failure(fakes, world_size):
    ranks = start_ranks(world_size, "kill", fake_env(fakes, CRING_TIMEOUT_SECONDS="120"))
    assert ranks[-1]["returncode"] == -9
    for r in ranks[:-1]:
        assert r["returncode"] == 0, r["stderr"]
        assert r["raised"] == "PeerFailureError", r
        assert r["after_s"] < 15, r


def test_events_order_the_callers_stream_and_crings(fakes, tmp_path):
    """The caller's stream gets an event at submission; cring's own stream
    waits on it before NCCL runs there; synchronize() makes the caller's
    stream wait on the completion event."""
    nccl_log, cuda_log = tmp_path / "nccl.log", tmp_path / "cuda.log"
    env = fake_env(fakes, CRING_FAKE_NCCL_LOG=str(nccl_log), CRING_FAKE_CUDA_LOG=str(cuda_log))
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            """
import json, numpy as np, cring
from cring import _gpu
from fake_cuda import FakeCudaTensor as F
cring.init(rank=0, size=1)
x = F(np.ones(5, np.float32))
with _gpu.use_stream(0x5150):
    h = cring.allreduce_async_(x, op=cring.Sum, name="x")
    assert cring.synchronize(h) is x
print(json.dumps({"x": x.array.tolist(), "stats": _gpu.stats()}))
cring.shutdown()
""",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["x"] == [1.0] * 5
    cuda = [ln.split(" ", 1)[1] for ln in cuda_log.read_text().splitlines()]
    created = [ln for ln in cuda if ln.startswith("streamcreate")]
    assert len(created) == 1 and "flags=1" in created[0]  # non-blocking
    cring_stream = re.search(r"stream=(0x[0-9a-f]+)", created[0]).group(1)
    rec = [ln for ln in cuda if ln.startswith("eventrecord") and "stream=0x5150" in ln]
    assert rec, cuda
    producer_event = re.search(r"event=(\d+)", rec[0]).group(1)
    waits = [ln for ln in cuda if ln.startswith("streamwait")]
    assert waits[0] == f"streamwait stream={cring_stream} event={producer_event} flags=0", cuda
    done = [ln for ln in cuda if ln.startswith("eventrecord") and f"stream={cring_stream}" in ln]
    done_event = re.search(r"event=(\d+)", done[-1]).group(1)
    assert f"streamwait stream=0x5150 event={done_event} flags=0" in waits  # synchronize()
    assert not any(ln.startswith(("sync ", "eventsync")) for ln in cuda)  # no host wait
    calls = [ln for ln in nccl_log.read_text().splitlines() if " allreduce " in ln]
    assert len(calls) == 1 and f"stream={cring_stream} " in calls[0]


# torch without CUDA, dressed as a CUDA build (tests/gpu/fake_torch_cuda.py:
# tensors say is_cuda and export their memory as kDLCUDA, the current stream
# is 0x4242, "CUDA" tensors come from a stand-in for torch's caching
# allocator and torch functions run in their stream's order); `frames`
# collects the Python frames of cring's package that run while `profile` is set
STAND_INS = """
import json, os, sys
import torch, cring
import cring.torch as hvd
from cring import _gpu
import fake_torch_cuda
from fake_torch_cuda import cuda

fake_torch_cuda.install()
cring.init(rank=0, size=1)
assert cring.nccl_available() and cring.cuda_available()  # what the first CUDA call does
PACKAGE = os.path.dirname(cring.__file__) + os.sep
frames = []


def profile(frame, event, arg):
    if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
        frames.append(frame.f_code.co_filename + ":" + frame.f_code.co_name)
"""

FAST_PATH = (
    STAND_INS
    + """
x = cuda(torch.ones(6))
before = _gpu.stats()
sys.setprofile(profile)
r1 = cring.allreduce_(x, op=cring.Sum, name="fast")
h = cring.allreduce_async_(x, op=cring.Sum, name="fast_async")
r3 = hvd.allreduce_(x, op=hvd.Sum, name="torch_fast")
h4 = hvd.allreduce_async_(x, name="torch_fast_async", op=hvd.Sum)
sys.setprofile(None)
r2 = cring.synchronize(h)
assert hvd.synchronize(h4) is x and r3 is x
after = _gpu.stats()
cring.shutdown()
print(json.dumps({"same": r1 is x and r2 is x, "x": x.tolist(), "frames": frames,
                  "events": after["events"] - before["events"],
                  "stream_waits": after["stream_waits"] - before["stream_waits"]}))
"""
)

ALLGATHER_FAST = (
    STAND_INS
    + """
x = cuda(torch.arange(6, dtype=torch.float32).reshape(3, 2))
before = _gpu.stats()
sys.setprofile(profile)
ys = [cring.allgather(x, name="fast_gather") for _ in range(3)]
sys.setprofile(None)
after = _gpu.stats()
cring.shutdown()
print(json.dumps({"values": [y.tolist() for y in ys], "kinds": [type(y).__name__ for y in ys],
                  "frames": frames,
                  "device_allocs": after["device_allocs"] - before["device_allocs"],
                  "stream_waits": after["stream_waits"] - before["stream_waits"]}))
"""
)


def run_stand_in_script(fakes, tmp_path, script: str) -> tuple[dict, str]:
    """Run a STAND_INS script against the fakes: (its JSON line, the fake
    runtime's log)."""
    pytest.importorskip("torch")
    cuda_log = tmp_path / "cuda.log"
    env = fake_env(fakes, CRING_FAKE_CUDA_LOG=str(cuda_log))
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), cuda_log.read_text()


def test_c_fast_path_for_torch_cuda_tensors(fakes, tmp_path):
    """cring.allreduce_ and allreduce_async_ (and cring.torch's) of a (pretend) torch CUDA tensor
    reach the queue from C: no frame of cring's Python code runs (the only
    frames are this test's stand-ins for torch's CUDA functions), the current
    stream is read and gets the producer's event, and it waits on the result."""
    out, cuda = run_stand_in_script(fakes, tmp_path, FAST_PATH)
    assert out["same"] and out["x"] == [1.0] * 6  # sums over one rank, in place
    assert out["frames"] == [], out["frames"]
    # a producer's event per call (4), a completion event per batch (calls that were
    # ready together share one)
    assert 6 <= out["events"] <= 8
    assert out["stream_waits"] == 8  # cring's stream on the producer, 0x4242 on the result
    assert cuda.count("eventrecord") == out["events"]
    assert "eventrecord event=1 stream=0x4242" in cuda  # the producer's, on its stream
    assert "streamwait stream=0x4242 " in cuda  # the caller's stream after the result


def test_c_fast_path_of_allgather_for_torch_cuda_tensors(fakes, tmp_path):
    """cring.allgather of a (pretend) torch CUDA tensor runs from C: no frame
    of cring's Python code, the result is room from torch's allocator
    (x.new_empty, so no cudaMalloc), right, and the caller's stream waits on
    it (cring's stream on the producer's event, the caller's on the result)."""
    out, cuda = run_stand_in_script(fakes, tmp_path, ALLGATHER_FAST)
    assert out["values"] == [[[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]] * 3
    assert out["kinds"] == ["Tensor"] * 3
    assert out["frames"] == [], out["frames"]
    assert out["device_allocs"] == 0
    assert out["stream_waits"] == 6
    assert "streamwait stream=0x4242 " in cuda

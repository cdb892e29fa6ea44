"""The background engine on real processes with hard timeouts: async handles
in any order, fusion, errors of one handle among many, duplicate names,
stall warnings and stall shutdown, timelines, poll(), threads, compression,
grouped collectives and scaling. Each worker packs many checks into one run
and writes <tmp>/rank<R>.json (see tests/workers/engine_common.py)."""

import json
import os
import re
import subprocess
import sys
import time

import pytest

import cring

from conftest import WORKERS, rank_results, run_ranks

TIMEOUT_S = 120  # per job; every job here normally ends within a few seconds


def assert_clean(proc, tmp_path, np_):
    """Every rank exited 0 and reported no failed check."""
    results = rank_results(tmp_path, np_) if proc.returncode == 0 else None
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]
    for r, res in enumerate(results):
        assert res["rank"] == r and res["size"] == np_
        assert res["failures"] == [], res["failures"]
    return results


def rank_lines(text, r):
    return [line[len(f"[{r}] ") :] for line in text.splitlines() if line.startswith(f"[{r}] ")]


# ---- items 1, 2, 12 and 13: ordering, fusion, mixed batches, over shm and TCP ----------------


@pytest.mark.parametrize("transport", ["auto", "tcp"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_out_of_order_fused_and_mixed(tmp_path, world_size, transport):
    """50 named async allreduces submitted in a different order on each rank
    (2 ranks: reversed on one; 3 ranks: a random permutation per rank), twice;
    1000 small async tensors, all right (the count of collectives they ran
    as is printed; see test_small_tensors_are_fused);
    broadcast/allgather/reducescatter/allreduce in one batch, per-rank order."""
    proc = run_ranks(
        world_size,
        "engine_core.py",
        str(tmp_path),
        env={"CRING_TRANSPORT": transport},
        timeout=TIMEOUT_S,
        check=False,
    )
    results = assert_clean(proc, tmp_path, world_size)
    for res in results:
        assert res["transport"] == ("shm" if transport == "auto" else "tcp")
        assert res["cases"] == 5
        delta = res["small_delta"]
        print(
            f"rank {res['rank']}: 1000 small allreduces ran as {delta['collectives']} "
            f"collectives ({delta['fused_tensors']} tensors fused)"
        )
        assert delta["tensors"] == 1000
        # how few collectives: test_small_tensors_are_fused
        # the second pass over the same names went through the response cache
        assert res["stats"]["cache_hits"] > 0, res["stats"]
        assert res["stats"]["errors"] == 0, res["stats"]


def test_small_tensors_are_fused(tmp_path):
    """1000 async allreduces of 16 float32 each, in a tight loop (twice) and
    paced 100 us apart (three times). The engine thread gathers for
    CRING_CYCLE_TIME (1 ms) before each round, so a tight loop fuses into a
    handful of collectives, and paced submissions into about one per
    millisecond of submitting (~100-150 here), far fewer than 1000."""
    proc = run_ranks(2, "engine_fusion.py", str(tmp_path), "100", timeout=TIMEOUT_S, check=False)
    if proc.returncode != 0:  # wrong values are not the expected failure (see raises=)
        raise RuntimeError(proc.stdout[-6000:] + proc.stderr[-3000:])
    results = rank_results(tmp_path, 2)
    for res in results:
        print(f"rank {res['rank']}: collectives per batch of 1000: {res['collectives']}")
    for res in results:
        for label, n in res["collectives"].items():
            limit = 50 if label.startswith("tight") else 250
            assert n < limit, f"rank {res['rank']} {label}: {n} collectives for 1000 tensors"


# ---- items 3 and 4: one bad handle among good ones; duplicate names ------------------------


@pytest.mark.parametrize("world_size", [2, 3])
def test_async_mismatch_and_duplicate_name(tmp_path, world_size):
    proc = run_ranks(world_size, "engine_errors.py", str(tmp_path), timeout=TIMEOUT_S, check=False)
    results = assert_clean(proc, tmp_path, world_size)
    for r in range(world_size):
        lines = rank_lines(proc.stdout, r)
        # every rank, also those that agreed with rank 0, raised for the bad name
        assert any(
            line.startswith("bad.shape: MismatchError:") and "rank 0 vs rank 1" in line
            for line in lines
        ), lines
        if world_size == 3:
            assert any(
                line.startswith("bad.op: MismatchError:") and "rank 0 vs rank 2" in line
                for line in lines
            ), lines
        assert any(
            line.startswith(f"dup.{r}: ValueError:") and "already in flight" in line
            for line in lines
        ), lines
        # the mismatches are the only errors the engine counted
        assert results[r]["errors"] == (2 if world_size == 3 else 1)


# ---- items 5 and 6: stalls --------------------------------------------------------------------


def test_stall_warning_names_missing_rank(tmp_path):
    """Rank 1 is 2.5 s late (twice: uncached, then cached name); with
    CRING_STALL_CHECK_SECONDS=1 ranks 0 and 2 warn, naming the tensor and
    rank 1, and the op then completes correctly."""
    t0 = time.monotonic()
    proc = run_ranks(
        3,
        "engine_stall.py",
        "warn",
        "2.5",
        env={"CRING_STALL_CHECK_SECONDS": "1"},
        timeout=TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for r in range(3):
        for rep in range(2):
            assert any(
                line.startswith(f"rank {r}: late_tensor pass {rep} ok")
                for line in rank_lines(proc.stdout, r)
            ), proc.stdout
    for r in (0, 2):
        warnings = [line for line in rank_lines(proc.stderr, r) if "stall:" in line]
        assert len(warnings) == 2, proc.stderr  # one per pass, not one per check
        for line in warnings:
            assert "tensor 'late_tensor'" in line, line
            assert "submitted by ranks [0, 2]" in line, line
            assert "missing ranks: [1]" in line, line
            assert "CRING_STALL_CHECK_SECONDS=1" in line, line
    assert time.monotonic() - t0 < 60


def test_stall_shutdown_fails_pending_handles(tmp_path):
    """Rank 1 never submits 'never_tensor'; with CRING_STALL_SHUTDOWN_SECONDS=2
    rank 0's synchronize raises cring.TimeoutError after about 2 s, both
    ranks then find the communicator broken, and shutdown() + init() work."""
    assert issubclass(cring.TimeoutError, cring.CRingError)
    t0 = time.monotonic()
    proc = run_ranks(
        2,
        "engine_stall.py",
        "shutdown",
        "3",
        env={"CRING_STALL_CHECK_SECONDS": "1", "CRING_STALL_SHUTDOWN_SECONDS": "2"},
        timeout=TIMEOUT_S,
        check=False,
    )
    wall_s = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    rank0 = rank_lines(proc.stdout, 0)
    failed = [line for line in rank0 if line.startswith("rank 0: TimeoutError after")]
    assert failed, out
    elapsed = float(re.search(r"after ([\d.]+) s", failed[0]).group(1))
    assert 1.9 <= elapsed < 15, failed[0]
    assert "never_tensor" in failed[0] and "CRING_STALL_SHUTDOWN_SECONDS=2" in failed[0]
    assert any(line.startswith("rank 0: refused after 0.0 s: TimeoutError") for line in rank0), out
    assert any(
        line.startswith("rank 1: ") and "Error" in line and "stalled" in line
        for line in rank_lines(proc.stdout, 1)
    ), out
    assert any(
        "stall: tensor 'never_tensor'" in line and "missing ranks: [1]" in line
        for line in rank_lines(proc.stderr, 0)
    ), out
    for r in range(2):
        assert f"rank {r}: works after re-init" in rank_lines(proc.stdout, r), out
    assert wall_s < 60, f"the job took {wall_s:.1f} s"


# ---- item 7: timelines ------------------------------------------------------------------------


def _rows(events):
    """pid -> row label (Horovod's layout: a process per tensor, pid 0 the rank)."""
    return {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}


def test_timeline_files(tmp_path):
    """HOROVOD_TIMELINE=<tmp>/trace.json at 2 ranks: that exact file (rank 0
    writes it, no per-rank suffix), valid JSON after every op while the job
    runs and at the end, with Horovod's event names (NEGOTIATE_ALLREDUCE, the
    top-level ALLREDUCE holding QUEUE and the transfer, CPU_ALLREDUCE here) on a row per tensor
    named as Horovod names it ("allreduce.tl.grad"); a timeline started and
    stopped from Python holds exactly the ops in between; mark_cycles adds
    CYCLE_START markers (off by default); all_ranks gives a file per rank."""
    proc = run_ranks(
        2,
        "engine_timeline.py",
        str(tmp_path),
        env={"HOROVOD_TIMELINE": str(tmp_path / "trace.json")},
        timeout=TIMEOUT_S,
        check=False,
    )
    assert_clean(proc, tmp_path, 2)
    assert not list(tmp_path.glob("trace.*.json")), list(tmp_path.iterdir())
    with open(tmp_path / "trace.json") as f:
        events = json.load(f)
    assert isinstance(events, list) and events
    rows = _rows(events)
    assert rows[0] == "rank 0"
    start_us = next(e for e in events if e.get("name") == "process_name")["args"]
    assert abs(start_us["start_time_since_epoch_in_micros"] / 1e6 - time.time()) < 3600
    spans = [e for e in events if e.get("ph") == "X"]
    assert all(e["pid"] in rows and e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    assert {
        "NEGOTIATE_ALLREDUCE",
        "NEGOTIATE_BROADCAST",
        "NEGOTIATE_ALLGATHER",
        "NEGOTIATE_REDUCESCATTER",
        "ALLREDUCE",
        "BROADCAST",
        "ALLGATHER",
        "REDUCESCATTER",
        "QUEUE",
        "CPU_ALLREDUCE",
        "CPU_BCAST",
    } <= {e["name"] for e in spans}, {e["name"] for e in spans}
    assert {
        "allreduce.tl.grad",
        "broadcast.tl.bcast",
        "allgather.tl.gather",
        "reducescatter.tl.scatter",
        "allreduce.tl.small.0",
        "allreduce.tl.small.39",
    } <= set(rows.values()), rows
    grad_pid = next(p for p, n in rows.items() if n == "allreduce.tl.grad")
    grad = {e["name"]: e for e in spans if e["pid"] == grad_pid}
    assert {"NEGOTIATE_ALLREDUCE", "ALLREDUCE", "QUEUE"} <= set(grad), grad
    top, queue = grad["ALLREDUCE"], grad["QUEUE"]
    # the activity nests inside the top-level op, which follows negotiation
    assert (
        top["ts"] <= queue["ts"] + 1e-3
        and queue["ts"] + queue["dur"] <= top["ts"] + top["dur"] + 1e-3
    )
    assert grad["NEGOTIATE_ALLREDUCE"]["ts"] <= top["ts"]
    assert top["args"]["dtype"] == "float32" and top["args"]["bytes"] == 4000
    assert not [e for e in events if e.get("ph") == "i"]  # no cycle markers unless asked
    # the Python-started timeline: rank 0 only, exactly the op in between
    with open(tmp_path / "py.json") as f:
        py_events = json.load(f)
    assert set(_rows(py_events).values()) == {"rank 0", "allreduce.py.after_start"}
    assert "ALLREDUCE" in {e["name"] for e in py_events if e.get("ph") == "X"}
    # mark_cycles=True: a global CYCLE_START instant per negotiation cycle
    with open(tmp_path / "cycles.json") as f:
        cycles = json.load(f)
    marks = [e for e in cycles if e.get("ph") == "i"]
    assert len(marks) >= 3 and {(e["name"], e["s"]) for e in marks} == {("CYCLE_START", "g")}
    # all_ranks=True: the per-rank files of before
    for r in range(2):
        with open(tmp_path / f"all.{r}.json") as f:
            assert "allreduce.all.ranks" in _rows(json.load(f)).values()


@pytest.mark.parametrize("how", ["environment", "cringrun"])
def test_timeline_mark_cycles_from_the_environment_or_cringrun(tmp_path, how):
    """HOROVOD_TIMELINE_MARK_CYCLES=1 beside HOROVOD_TIMELINE, or horovodrun's
    flags `cringrun --timeline-filename F --timeline-mark-cycles`, mark cycles
    in the file at that exact path."""
    path = tmp_path / "trace.json"
    if how == "environment":
        env = {"HOROVOD_TIMELINE": str(path), "HOROVOD_TIMELINE_MARK_CYCLES": "1"}
        proc = run_ranks(
            2, "engine_timeline.py", str(tmp_path), env=env, timeout=TIMEOUT_S, check=False
        )
    else:
        cmd = [sys.executable, "-m", "cring.run", "-np", "2", "--timeline-filename", str(path)]
        cmd += ["--timeline-mark-cycles", sys.executable, str(WORKERS / "engine_timeline.py")]
        env = dict(os.environ, CRING_TIMEOUT_SECONDS="60")
        proc = subprocess.run(
            [*cmd, str(tmp_path)], env=env, capture_output=True, text=True, timeout=TIMEOUT_S
        )
    assert_clean(proc, tmp_path, 2)
    with open(path) as f:
        events = json.load(f)
    assert len([e for e in events if e.get("name") == "CYCLE_START"]) >= 4
    assert "allreduce.tl.grad" in _rows(events).values()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to overlap")
def test_timeline_valid_json_for_a_concurrent_reader(tmp_path):
    """A reader in another process that parses the live file must never see
    it end anywhere but after the closing ']'."""
    proc = run_ranks(
        1, "engine_timeline_reader.py", str(tmp_path), "3", timeout=TIMEOUT_S, check=False
    )
    out = proc.stdout[-2000:] + proc.stderr[-2000:]
    if proc.returncode != 0 and "reader: torn read" not in proc.stdout:
        raise RuntimeError(out)  # a crash is not the expected failure (see raises=)
    assert proc.returncode == 0, out


# ---- items 8-11: poll, threads, compression, grouped, scaling ---------------------------------


@pytest.mark.parametrize("transport", ["auto", "tcp"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_poll_threads_compression_grouped(tmp_path, world_size, transport):
    proc = run_ranks(
        world_size,
        "engine_features.py",
        str(tmp_path),
        env={"CRING_TRANSPORT": transport},
        timeout=TIMEOUT_S,
        check=False,
    )
    results = assert_clean(proc, tmp_path, world_size)
    for res in results:
        assert res["cases"] == 10
        assert res["pending_polls"] >= 1  # poll() said False before the result was there
        assert res["fp16_rounded_fraction"] > 0.5 and res["bf16_rounded_fraction"] > 0.5

"""Process sets (issue 19, item 1): each set is its own communicator and
engine. Values of every collective on a set, two disjoint sets working at the
same time, membership that differs between ranks raising on every rank, a
rank outside a set, remove then add again, shutdown and init again, a set
member killed, and cring.torch's process_set= arguments. The worker is
tests/workers/process_sets.py (one scenario per mode)."""

import subprocess
import sys

import pytest

from conftest import WORKERS, rank_results, run_ranks
from test_bootstrap import clean_env, free_port


def run_mode(tmp_path, np_, mode, timeout=180, env=None):
    run_ranks(np_, "process_sets.py", mode, str(tmp_path), env=env, timeout=timeout)
    return rank_results(tmp_path, np_)


@pytest.mark.parametrize("np_", [2, 3, 4])
def test_every_collective_on_a_set(tmp_path, np_):
    # at 4 ranks also: each set's engine writes its own timeline (by the
    # set's rank 0, as the global one by rank 0) and autotune log (".ps<id>"
    # before the suffix), never over the global set's files
    env = None
    if np_ == 4:
        env = {
            "CRING_TIMELINE": str(tmp_path / "trace.json"),
            "CRING_AUTOTUNE": "1",
            "CRING_AUTOTUNE_LOG": str(tmp_path / "tune.csv"),
        }
    results = run_mode(tmp_path, np_, "values", env=env)
    for r in results:
        assert r["ids"] == [1, 2]
        members = [m for m in range(np_) if m % 2 == r["rank"] % 2]
        assert r["mine"]["size"] == len(members)
        assert r["mine"]["rank"] == members.index(r["rank"])
        assert r["global"] == [np_, np_] and r["global_ps"] == [np_, np_]
        if np_ > 2 and r["rank"] < 2:
            assert r["head"]["size"] == 2 and r["head"]["rank"] == r["rank"]
    if np_ == 4:
        # sets 1 {0,2} and 2 {1,3}, then 3 {0,1}: two ranks each
        traces = ["trace.json"] + [f"trace.ps{i}.json" for i in (1, 2, 3)]
        for name in traces:
            assert (tmp_path / name).stat().st_size > 0, name
        assert sorted(p.name for p in tmp_path.glob("trace*.json")) == sorted(traces)
        assert "inplace" in (tmp_path / "trace.ps2.json").read_text()
        assert "inplace" not in (tmp_path / "trace.json").read_text()
        for name in ("tune.csv", "tune.ps1.csv", "tune.ps2.csv", "tune.ps3.csv"):
            assert (tmp_path / name).read_text().startswith("trial,knob,"), name


def test_disjoint_sets_run_at_the_same_time(tmp_path):
    """Sets {0,1} and {2,3}: while rank 0 sleeps 3 s before its set's 50
    allreduces, set {2,3} finishes all of its own; then each rank runs its
    set's allreduces in a thread beside global ones, and keeps a set handle
    and a global handle in flight together."""
    results = run_mode(tmp_path, 4, "concurrent", timeout=240)
    for r in results:
        assert r["thread_errors"] == []
        assert r["mixed"] == [[4.0] * 4, [2.0] * 4]
    assert results[0]["set_done_s"] >= 2.9
    assert results[2]["set_done_s"] < 2.0 and results[3]["set_done_s"] < 2.0


def test_membership_mismatch_raises_on_every_rank(tmp_path):
    results = run_mode(tmp_path, 2, "mismatch")
    for r in results:
        kind, message = r["error"]
        assert kind == "ValueError"
        assert "rank(s) [0] gave [0, 1]" in message and "rank(s) [1] gave [0]" in message
        assert r["after_id"] == 1  # the job went on: the next add agreed
        assert r["bad_rank"][0] == "ValueError" and "[0, 2)" in r["bad_rank"][1]
        assert r["duplicate"][0] == "ValueError" and "exists" in r["duplicate"][1]
        assert r["all"][0] == "ValueError"
        assert r["sum"] == [2.0]


def test_rank_outside_the_set_gets_a_value_error(tmp_path):
    r0, r1 = run_mode(tmp_path, 2, "outside")
    assert r0["value"] == [1.0, 1.0] and r0["included"] is True
    assert r0["root_err"] == [
        "ValueError",
        "tensor 'broadcast.ps1.noname.0': root_rank 1 is not in process set 1 (ranks [0])",
    ]
    expected = ["ValueError", "rank 1 is not in process set 1 (ranks [0])"]
    assert r1["error"] == expected and r1["error_"] == expected and r1["error_bc"] == expected
    assert r1["rank_err"][0] == "ValueError" and r1["included"] is False
    for r in (r0, r1):
        assert r["unregistered"][0] == "ValueError" and "not registered" in r["unregistered"][1]


def test_remove_then_add_again(tmp_path):
    results = run_mode(tmp_path, 3, "readd")
    for r in results:
        assert r["removed_use"][0] == "ValueError"
        assert r["remove_again"] is False and r["remove_global"] is False
        assert r["ids"] == [1, 1]
    assert results[0]["sum"] == [2.0] and results[1]["sum"] == [2.0] and "sum" not in results[2]


def test_shutdown_and_init_again(tmp_path):
    results = run_mode(tmp_path, 3, "reinit")
    for r in results:
        assert r["id1"] == 1 and r["after_shutdown_id"] is None and r["global"] == [3.0]
    assert results[0]["sum1"] == [2.0] and results[1]["sum2"] == [2.0]


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_killed_member_makes_the_set_raise(tmp_path, transport):
    """Set [1, 2] of 3 ranks; rank 2 is killed mid-allreduce: rank 1 raises
    a CRingError (PeerFailureError, or TimeoutError) within
    CRING_TIMEOUT_SECONDS, and rank 0, outside the set, is unaffected."""
    port, timeout_s = str(free_port()), 20
    procs = []
    for r in range(3):
        env = clean_env(
            CRING_RANK=str(r),
            CRING_SIZE="3",
            CRING_ADDR="127.0.0.1",
            CRING_PORT=port,
            CRING_TRANSPORT=transport,
            CRING_TIMEOUT_SECONDS=str(timeout_s),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKERS / "process_sets.py"), "kill", str(tmp_path)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    try:
        outs = [p.communicate(timeout=timeout_s + 60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert procs[2].returncode == -9
    assert procs[0].returncode == 0 and procs[1].returncode == 0, outs
    r1 = rank_results(tmp_path, 2)[1]
    kind, message, seconds = r1["raised"]
    assert kind in ("PeerFailureError", "TimeoutError"), message
    assert seconds < timeout_s + 5


def test_torch_process_sets(tmp_path):
    pytest.importorskip("torch")
    results = run_mode(tmp_path, 3, "torch")
    for r in results:
        assert r["ok"], r

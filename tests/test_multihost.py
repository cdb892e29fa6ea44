"""Collectives across simulated hosts (tests/simhosts.py): the hierarchical
communicator (shared memory within a host, TCP across) and the flat ring,
every collective x dtype, a rank killed on one host, the O(log P) small
allreduce over TCP, and the per-transport byte counters."""

from __future__ import annotations

import pytest
import simhosts
from multihost_ranks import run

from conftest import rank_results, run_ranks

_WHY = simhosts.unavailable()
needs_hosts = pytest.mark.skipif(_WHY is not None, reason=f"simulated hosts: {_WHY}")


def _run(tmp_path, nhosts, per_host, mode, *args, env=None, layout="block", cring_timeout_s=30):
    codes, results, logs = run(
        nhosts,
        per_host,
        "multihost.py",
        [mode, str(tmp_path), *args],
        tmp_path,
        env=env,
        layout=layout,
        timeout_s=150,
        cring_timeout_s=cring_timeout_s,
    )
    return codes, results, logs


@pytest.mark.parametrize("hierarchical", [True, False], ids=["hier", "flat"])
@pytest.mark.parametrize("nhosts,layout", [(2, "block"), (3, "cyclic")], ids=["2x2", "3x2-cyclic"])
@needs_hosts
def test_every_collective_across_hosts(tmp_path, nhosts, layout, hierarchical):
    env = None if hierarchical else {"CRING_HIERARCHICAL": "0"}
    codes, results, logs = _run(tmp_path, nhosts, 2, "collectives", env=env, layout=layout)
    assert codes == [0] * (2 * nhosts), logs
    for r, res in enumerate(results):
        assert res["rank"] == r and res["size"] == 2 * nhosts
        assert (res["local_size"], res["cross_size"]) == (2, nhosts)
        assert res["transport"] == ("hier(shm+tcp)" if hierarchical else "tcp")
        assert res["failures"] == [], res["failures"][:5]
        assert res["cases"] > 150
        stats = res["stats"]
        assert stats["tcp_bytes_sent"] > 0 and stats["tcp_bytes_received"] > 0
        assert (stats["shm_bytes_sent"] > 0) == hierarchical


@needs_hosts
def test_uneven_hosts_use_the_flat_ring(tmp_path):
    codes, results, logs = _run(tmp_path, 2, 2, "tree", layout=[0, 0, 1])
    assert codes == [0, 0, 0], logs
    assert [r["transport"] for r in results] == ["tcp"] * 3
    assert all(r["failures"] == [] for r in results)


@needs_hosts
def test_rank_killed_on_one_host_fails_every_rank(tmp_path):
    timeout_s = 10
    codes, results, logs = _run(tmp_path, 3, 2, "kill", "3", cring_timeout_s=timeout_s)
    killed_at = float((tmp_path / "killed_at").read_text())
    assert codes[3] != 0
    for r, res in enumerate(results):
        if r == 3:
            continue
        assert res is not None, logs
        assert res["transport"] == "hier(shm+tcp)"
        assert res["error"] in ("PeerFailureError", "TimeoutError"), res
        assert res["raised_at"] - killed_at < timeout_s, res


@pytest.mark.parametrize("world_size", [3, 5, 8])
def test_tree_allreduce_over_tcp(tmp_path, world_size):
    """Recursive doubling with the fold for non-powers of two, on both sides
    of the tree/ring crossover (CRING_TREE_MAX_BYTES)."""
    run_ranks(world_size, "multihost.py", "tree", str(tmp_path), env={"CRING_TRANSPORT": "tcp"})
    for res in rank_results(tmp_path, world_size):
        assert res["transport"] == "tcp"
        assert res["failures"] == [] and res["cases"] == 100


@needs_hosts
def test_hierarchical_sends_fewer_tcp_bytes(tmp_path):
    nbytes = 8 << 20
    per_call = {}
    for label, env in (("hier", None), ("flat", {"CRING_HIERARCHICAL": "0"})):
        out = tmp_path / label
        codes, results, logs = _run(out, 2, 2, "bench", f"{nbytes}:2", env=env)
        assert codes == [0] * 4, logs
        per_call[label] = max(r["rows"][0]["per_call"]["tcp_bytes_sent"] for r in results)
    # flat ring over 4 ranks: 2 * 3/4 of the data per rank; hierarchical: each
    # local rank sends its half across, 2 * 1/2 * 1/2 of the data
    assert per_call["flat"] >= 1.4 * nbytes
    assert per_call["hier"] <= 0.55 * per_call["flat"], per_call

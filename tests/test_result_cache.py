"""Large results from cring's result cache (docs/performance.md, "Result
memory"; issue 35): out-of-place allreduce (and its async and grouped
forms), broadcast, reducescatter and allgather results of 1 MiB or more, as
NumPy arrays and CPU torch tensors, on 2 ranks over shared memory and TCP
and 3 over shared memory: kept results keep their values while more calls
run, views outlive their result, results are ordinary arrays and tensors, a
loop of large calls maps no fresh memory, results dropped on other threads,
small results unchanged, shutdown; CRING_RESULT_CACHE_BYTES bounds what the
cache keeps (the process's memory falls when results beyond it go) and 0
turns it off. The checks are in tests/workers/result_cache.py; the cache's
own rules (size classes, the limit, threads) in
csrc/tests/test_result_cache.c."""

import pytest

from conftest import rank_results, run_ranks

TIMEOUT_S = 300  # a job normally ends within 20 s


def run(tmp_path, world_size, mode, env):
    proc = run_ranks(
        world_size, "result_cache.py", str(tmp_path), mode, env=env, timeout=TIMEOUT_S, check=False
    )
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]
    results = rank_results(tmp_path, world_size)
    for r, res in enumerate(results):
        assert res["rank"] == r and res["size"] == world_size and res["mode"] == mode
        assert res["failures"] == [], res["failures"]
    return results


@pytest.mark.parametrize(
    "world_size,transport",
    [
        pytest.param(2, "auto", id="2-shm"),
        pytest.param(2, "tcp", id="2-tcp", marks=pytest.mark.slow),
        pytest.param(3, "auto", id="3-shm", marks=pytest.mark.slow),
    ],
)
def test_results_from_the_cache(tmp_path, world_size, transport):
    results = run(tmp_path, world_size, "main", {"CRING_TRANSPORT": transport})
    for res in results:
        assert res["transport"] == ("tcp" if transport == "tcp" else "shm")
        assert res["cases"] == 2 * (6 * 2 + 5) + 1, res["cases"]
        assert res["stats"]["reused"] > 0, res["stats"]


def test_cache_limit(tmp_path):
    results = run(tmp_path, 2, "cap", {"CRING_RESULT_CACHE_BYTES": str(8 << 20)})
    for res in results:
        assert res["cases"] == 1
        assert res["rss_dropped_bytes"] >= 32 << 20, res


def test_cache_off(tmp_path):
    results = run(tmp_path, 2, "off", {"CRING_RESULT_CACHE_BYTES": "0"})
    assert all(res["cases"] == 1 for res in results)

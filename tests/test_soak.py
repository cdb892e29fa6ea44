"""Soak: thousands of random-size, random-dtype, random-op allreduces across 2
ranks (synchronous, asynchronous in per-rank orders, and grouped with mixed
dtypes), every result checked exactly against NumPy, and resident memory flat
from after the warm-up to the end (issue 9, item 4).

CRING_SOAK_OPS sets how many tensors each run allreduces (default 5000);
CRING_SOAK_SEED replays a run (default: a fresh seed, printed on failure).
The worker is tests/workers/soak.py."""

from __future__ import annotations

import os
import random

import pytest

from conftest import rank_results, run_ranks
from test_bootstrap import clean_env

pytestmark = pytest.mark.slow

OPS = int(os.environ.get("CRING_SOAK_OPS", "5000"))
RSS_GROWTH_LIMIT_BYTES = 20 << 20  # after warm-up, over the whole run
DTYPES = ["float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64"]


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_soak_random_allreduces(tmp_path, transport):
    seed = int(os.environ.get("CRING_SOAK_SEED") or random.SystemRandom().randrange(2**31))
    timeout = max(300.0, OPS * 0.1)  # 5000 take ~10-30 s on two busy cores
    proc = run_ranks(
        2,
        "soak.py",
        str(tmp_path),
        str(OPS),
        str(seed),
        env=clean_env(CRING_TRANSPORT=transport, CRING_TIMEOUT_SECONDS="120"),
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, (
        f"soak failed (replay with CRING_SOAK_SEED={seed} CRING_SOAK_OPS={OPS})\n"
        f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    )
    results = rank_results(tmp_path, 2)
    expected_transport = "shm" if transport == "auto" else "tcp"
    for r in results:
        assert r["transport"] == expected_transport
        assert r["tensors"] >= OPS
        counts = r["counts"]
        # every dtype, op and mode took part
        for key in DTYPES + ["sum", "average", "min", "max", "product", "sync", "async", "grouped"]:
            assert counts.get(key, 0) > 0 or OPS < 500, (key, counts)
        assert r["stats"]["errors"] == 0
        growth = r["rss_end"] - r["rss_start"]
        mib = [round(s / 2**20, 1) for s in r["rss_samples"]]
        assert growth < RSS_GROWTH_LIMIT_BYTES, (
            f"rank {r['rank']}: resident memory grew {growth / 2**20:.1f} MiB over "
            f"{r['tensors']} allreduces (seed {seed}); samples in MiB: {mib}"
        )
        print(
            f"rank {r['rank']} {expected_transport}: {r['tensors']} tensors in {r['units']} "
            f"units, {r['seconds']:.1f} s, RSS {r['rss_start'] / 2**20:.1f} -> "
            f"{r['rss_end'] / 2**20:.1f} MiB (seed {seed})"
        )
    assert results[0]["tensors"] == results[1]["tensors"]

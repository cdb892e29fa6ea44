"""Gradient buckets on the CUDA path (issue 26, item 5; csrc/engine/bucket.c)
against the test doubles (csrc/tests/fake_*.c, built by test_gpu_loader's
`fakes` fixture) and FakeCudaTensor, every process under a hard timeout:

- ResNet-50's and ViT-B/16's gradients (sizes and backward order as data,
  tests/gpu/model_grads.py), submitted as DistributedOptimizer's hooks do
  (an allreduce_async_ each, paced like a backward pass, then a synchronize
  of each) reach NCCL in at most ceil(gradient bytes / 25 MiB) + 2 calls a
  step from the second step on, with exact sums, at 2 and 3 ranks; the
  timeline names each gradient's bucket, and a bucket holds at least 25 MiB
  or an eighth of the step (ViT-B/16: at most 9 buckets, not 14);
- a lone allreduce_async_ + synchronize does not wait for the rest of a
  bucket (median under 2 ms with a 200 ms cycle, so a wait of one cycle
  would show 100 times over), nor does a step missing a name hang, whether
  its handles are waited on or only polled;
- a rank that dies after submitting half of a bucket makes the others'
  held gradients raise PeerFailureError instead of hanging.
"""

from __future__ import annotations

import json
import math

import pytest
import test_gpu_engine as engine_tests
import test_gpu_loader as loader

GPU_TESTS = loader.GPU_TESTS

DDP_BUCKET_BYTES = 25 << 20


def start(world_size: int, args: list, env: dict) -> list[dict]:
    return engine_tests.start_ranks(world_size, args, env, script="bucket_worker.py")


def env_for(fakes: dict, **extra: str) -> dict:
    # a fused call may carry up to the 64 MiB fusion threshold
    return engine_tests.fake_env(fakes, CRING_FAKE_NCCL_SLOT_BYTES=str(64 << 20), **extra)


@pytest.mark.parametrize(
    "model, world_size, steps",
    [("resnet50", 2, 5), ("resnet50", 3, 4), ("vit_b_16", 2, 4)],
)
def test_a_backward_pass_reaches_nccl_in_ddp_sized_buckets(
    fakes, tmp_path, model, world_size, steps
):
    timeline = tmp_path / "trace.json"
    env = env_for(fakes, CRING_TIMELINE=str(timeline))
    ranks = start(world_size, ["replay", model, str(steps)], env)
    bound = math.ceil(ranks[0]["bytes"] / DDP_BUCKET_BYTES) + 2
    for r in ranks:
        assert r["returncode"] == 0, r["stderr"]
        assert r["exact"], r
        assert len(r["calls"]) == steps
        assert all(c <= bound for c in r["calls"][1:]), (bound, r["calls"])
    # every rank made the same calls (one NCCL launch each, in one order)
    assert len({tuple(r["calls"]) for r in ranks}) == 1
    # the timeline: in the last step every gradient waited for its bucket,
    # named by (plan, bucket); the plan covers every gradient in at most the
    # bound's buckets, each at most one fused call (the 64 MiB threshold)
    events = json.loads(timeline.read_text())  # rank 0 writes CRING_TIMELINE itself
    events = events["traceEvents"] if isinstance(events, dict) else events
    waits = [ev for ev in events if ev.get("name") == "WAIT_FOR_BUCKET"]
    assert waits, "no WAIT_FOR_BUCKET span in the timeline"
    last_plan = max(ev["args"]["plan"] for ev in waits)
    last = [ev for ev in waits if ev["args"]["plan"] == last_plan]
    assert len(last) == ranks[0]["tensors"]
    buckets = {ev["args"]["bucket"]: ev["args"] for ev in last}
    assert len(buckets) <= bound, buckets
    # each bucket but the last holds at least 25 MiB or an eighth of the step
    # (bucket.c), so a large model is not cut into DDP's 25 MB pieces: on a
    # GPU every bucket is a launch of its own (ViT-B/16: 7, not 14)
    cap = max(DDP_BUCKET_BYTES, ranks[0]["bytes"] / 8)
    assert len(buckets) <= math.floor(ranks[0]["bytes"] / cap) + 1, sorted(
        (a["bucket_bytes"], a["bucket_tensors"]) for a in buckets.values()
    )
    assert sum(a["bucket_tensors"] for a in buckets.values()) == ranks[0]["tensors"]
    assert all(a["bucket_bytes"] <= 64 << 20 for a in buckets.values())
    # a bucket goes when its last gradient is ready everywhere ("complete");
    # a rank descheduled for long on this loaded machine may make the idle
    # release take some ("idle"), never most
    releases = [ev["args"]["release"] for ev in last]
    assert set(releases) <= {"complete", "idle"}, set(releases)
    assert releases.count("complete") > len(releases) // 2, releases


def test_a_lone_call_does_not_wait_for_its_bucket(fakes):
    # a cycle of 200 ms: a call that waited for a round of the engine thread,
    # or for the idle release (200 ms), would show it 100 times over
    env = env_for(fakes, CRING_CYCLE_TIME="200")
    for r in start(2, ["lone"], env):
        assert r["returncode"] == 0, r["stderr"]
        assert r["exact"], r
        # each name of a planned bucket of 24 alone; one name again and again; new names
        assert r["planned_median_s"] < 0.002, r
        assert r["again_median_s"] < 0.002, r
        assert r["fresh_median_s"] < 0.002, r
        # a name alone right after a step: the ranks leave the step apart by
        # a few ms on this loaded machine, but nothing waits for the cycle
        assert r["after_step_median_s"] < 0.05, r
        # a step without one of its bucket's names: synchronize() releases
        # the bucket at once; poll() alone sees it released after the idle limit
        assert r["skip_waited_s"] < 1.0, r
        assert r["skip_polled_s"] < 5.0, r


def test_a_dead_peer_fails_held_gradients_instead_of_hanging(fakes):
    ranks = start(3, ["kill"], env_for(fakes))
    assert ranks[2]["returncode"] == -9  # SIGKILL
    for r in ranks[:2]:
        assert r["returncode"] == 0, r["stderr"]
        assert r["raised"] == "PeerFailureError", r
        assert r["after_s"] < 40, r

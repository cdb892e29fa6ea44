"""Handles that never block when dropped, and waits a signal interrupts
(issue 15 item 7), at 2 ranks through cring.torch (workers/handles.py)."""

import pytest

from conftest import rank_results, run_ranks


@pytest.mark.parametrize("kind", ["allreduce", "allgather", "broadcast"])
def test_dropped_handle_does_not_block(tmp_path, kind):
    """Horovod's duplicate-name tests: rank 0 drops an async handle and waits
    in a barrier that rank 1 passes before submitting the same name."""
    run_ranks(
        2,
        "handles.py",
        str(tmp_path),
        "dropped",
        kind,
        env={"CRING_TIMEOUT_SECONDS": "30"},
        timeout=90,
    )
    assert [r["problems"] for r in rank_results(tmp_path, 2)] == [[], []]


def test_sigint_interrupts_a_blocked_wait(tmp_path):
    """SIGINT while rank 0 waits for a collective rank 1 never submits raises
    KeyboardInterrupt within a second, and both ranks then go on and exit 0."""
    run_ranks(
        2, "handles.py", str(tmp_path), "sigint", env={"CRING_TIMEOUT_SECONDS": "60"}, timeout=120
    )
    results = rank_results(tmp_path, 2)
    assert [r["problems"] for r in results] == [[], []]
    for label in ("synchronize", "allreduce_ numpy", "allreduce_ torch", "allgather"):
        assert results[0][label] < 1.0, (label, results[0][label])

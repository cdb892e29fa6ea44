"""tests/ports.py: free_port() never hands a port to two processes at once
(pytest-xdist workers and other suites on the machine ask at the same time),
and a port is free again once the process that held it has exited."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

from ports import free_port

HERE = Path(__file__).parent
SPAN = 24  # a narrow range, so that two processes would collide without the locks
HOLDER = """
import json, sys
sys.path.insert(0, {here!r})
from ports import free_port
print(json.dumps([free_port({lo}, {hi}) for _ in range({n})]), flush=True)
sys.stdin.readline()  # hold them until the test says
"""


def _holder(lo: int, n: int) -> subprocess.Popen:
    code = HOLDER.format(here=str(HERE), lo=lo, hi=lo + SPAN, n=n)
    return subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def test_ports_held_by_another_process_are_not_handed_out():
    lo = random.randrange(20000, 30000 - SPAN)
    holder = _holder(lo, SPAN // 2)
    try:
        held = set(json.loads(holder.stdout.readline()))
        assert len(held) == SPAN // 2 and all(lo <= p < lo + SPAN for p in held), held
        mine = [free_port(lo, lo + SPAN) for _ in range(SPAN // 2)]
        in_range = [p for p in mine if lo <= p < lo + SPAN]
        assert len(set(mine)) == len(mine)  # never twice in one process either
        assert not held & set(mine), (sorted(held), sorted(mine))
        # ports some other program is listening on are skipped too: at most the
        # rest of the range is left, then the kernel picks one outside it
        assert len(in_range) <= SPAN - len(held)
    finally:
        holder.communicate("\n", timeout=60)


def test_ports_of_a_process_that_exited_are_free_again():
    lo = random.randrange(20000, 30000 - SPAN)
    first = _holder(lo, SPAN)
    out, _ = first.communicate("\n", timeout=60)
    held = {p for p in json.loads(out) if lo <= p < lo + SPAN}
    assert len(held) >= SPAN // 2, held  # most of the range was free
    second = _holder(lo, SPAN)
    try:
        again = set(json.loads(second.stdout.readline()))
        # the kernel dropped the first one's locks when it exited
        assert len(again & held) >= len(held) // 2, (sorted(held), sorted(again))
    finally:
        second.communicate("\n", timeout=60)

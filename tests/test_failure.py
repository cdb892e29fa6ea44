"""A rank that dies (SIGKILL) mid-allreduce makes every survivor raise
promptly (PeerFailureError, a CRingError) instead of hanging, over shared
memory and TCP; nothing is left in /dev/shm. The ranks are started directly
(not by cringrun, which would stop the survivors itself)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import WORKERS
from test_bootstrap import clean_env, free_port


def cring_shm_files() -> set:
    return {p.name for p in Path("/dev/shm").glob("cring-*")} if os.path.isdir("/dev/shm") else set()


@pytest.mark.parametrize("transport", ["auto", "tcp"])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_killed_rank_makes_survivors_raise(world_size, transport):
    before = cring_shm_files()
    port = str(free_port())
    procs = []
    for r in range(world_size):
        # a long timeout: detection must come from the death itself, not the clock
        env = clean_env(CRING_RANK=str(r), CRING_SIZE=str(world_size), CRING_ADDR="127.0.0.1",
                        CRING_PORT=port, CRING_TRANSPORT=transport,
                        CRING_TIMEOUT_SECONDS="120")
        procs.append(subprocess.Popen([sys.executable, str(WORKERS / "kill_peer.py"), "100000"],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outs = {}
    try:
        for r, p in enumerate(procs):
            outs[r] = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail("a survivor hung after its peer was killed")
    assert procs[1].returncode == -9  # the victim
    for r in range(world_size):
        if r == 1:
            continue
        out, err = outs[r]
        assert procs[r].returncode == 0, out + err[-3000:]
        m = re.search(rf"SURVIVOR {r} raised (\w+) after ([0-9.]+)s", out)
        assert m, f"rank {r} did not raise:\n{out}\n{err[-3000:]}"
        assert m.group(1) == "PeerFailureError", m.group(0)
        assert float(m.group(2)) < 10.0, m.group(0)
        assert f"SURVIVOR {r} next call raised" in out
    assert cring_shm_files() <= before, "shared-memory files left behind"

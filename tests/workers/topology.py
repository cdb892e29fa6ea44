"""Worker: init from whatever the environment provides, check a Sum allreduce,
print the topology as one JSON line prefixed with TOPOLOGY, re-initialise once
if asked (shutdown then init), and exit."""

import json
import sys

import numpy as np

import cring

reinit = "--reinit" in sys.argv
kwargs = {}
outdir = None
for arg in sys.argv[1:]:
    if arg.startswith("--kw="):
        kwargs = json.loads(arg[5:])
    if arg.startswith("--out="):
        outdir = arg[6:]

for attempt in range(2 if reinit else 1):
    cring.init(**kwargs)
    x = np.full(1_000_003, cring.rank(), dtype=np.float32)
    cring.allreduce_(x, op=cring.Sum)
    expected = sum(range(cring.size()))
    assert np.all(x == expected), (x[:4], expected)
    info = {
        "attempt": attempt,
        "rank": cring.rank(),
        "size": cring.size(),
        "local_rank": cring.local_rank(),
        "local_size": cring.local_size(),
        "cross_rank": cring.cross_rank(),
        "cross_size": cring.cross_size(),
        "transport": cring.transport(),
    }
    print("TOPOLOGY " + json.dumps(info), flush=True)
    if outdir:  # for launchers that do not keep output lines whole (mpirun)
        with open(f"{outdir}/rank{cring.rank()}-{attempt}.json", "w") as f:
            json.dump(info, f)
    cring.shutdown()
    assert not cring.is_initialized()

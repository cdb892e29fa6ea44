"""Worker for tests/test_hvd_parity.py: run with HOROVOD_* knobs set; reports
the CRING_* values cring.init() derived, the warnings it gave, and runs a few
allreduces (so that a HOROVOD_TIMELINE file gets events). Writes
<out>/rank<R>.json."""

import json
import os
import sys
import warnings

import numpy as np

import cring

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    cring.init()
    cring.shutdown()
    cring.init()  # a second init warns no more
for i in range(3):
    cring.allreduce(np.ones(4, np.float32), name=f"hvd_env.{i}")
res = {
    "rank": cring.rank(),
    "env": {k: v for k, v in os.environ.items() if k.startswith("CRING_") and "SECRET" not in k},
    "warnings": [str(w.message) for w in caught if "Horovod" in str(w.message)],
}
cring.shutdown()
with open(os.path.join(sys.argv[1], f"rank{res['rank']}.json"), "w") as f:
    json.dump(res, f)

"""Worker for tests/test_elastic.py: elastic training of four float64 numbers
with cring.elastic.ObjectState under `cringrun --elastic`.

Step s on a world of n ranks: rank r contributes (r + 1) * (s + 1) * V, the
contributions are averaged (cring.Average) and w <- 0.9 * w - 0.01 * average.
The state (step, w and the world size each step ran with) is committed every
--commit-every steps. Each worker writes <out>/worker<id>.json at the end.

  --steps, --commit-every, --kill, --kill-during, --out: see elastic_common.py
  --step-payload N  also allreduce N float32 per step (kills then land inside a
                    collective, most likely)
  --fake-timeout S  in generation 0 every rank raises cring.TimeoutError when
                    it is about to run step S (no one dies: workers must ask
                    cringrun for a new generation)
  --grow-at S F     at step S, while the world has fewer than 3 ranks, rank 0
                    writes 'localhost:4' to the discovery file F and every rank
                    commits until HostsUpdatedInterrupt (cringrun adds a worker)
  --grow-at-end F   after the last step, rank 0 writes 'localhost:4' to F and every
                    rank waits until cringrun has published a new generation, then
                    finishes without joining it
"""

import os
import time

import numpy as np

import cring
import cring.elastic

from elastic_common import Killer, parser

V = np.array([1.0, 0.5, 0.25, 0.125])

arguments = parser()
arguments.add_argument(
    "--step-payload",
    type=int,
    default=0,
    help="also allreduce this many float32 per step (longer collectives)",
)
arguments.add_argument("--fake-timeout", type=int)
arguments.add_argument("--grow-at", nargs=2)
arguments.add_argument("--grow-at-end")
args = arguments.parse_args()
me = Killer(args)
resets = []
payload = np.ones(args.step_payload, np.float32)

cring.init()
state = cring.elastic.ObjectState(step=0, w=np.ones(4), sizes=[])
state.register_reset_callbacks([lambda: resets.append((cring.rank(), cring.size()))])


@cring.elastic.run
def train(state):
    while state.step < args.steps:
        s = state.step
        me.before_step(s)
        if s == args.fake_timeout and os.environ["CRING_ELASTIC_GENERATION"] == "0":
            raise cring.TimeoutError("simulated time-out")
        if args.grow_at and s == int(args.grow_at[0]) and cring.size() < 3:
            if cring.rank() == 0:
                with open(args.grow_at[1], "w") as f:
                    f.write("localhost:4\n")
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # HostsUpdatedInterrupt ends this
                state.commit()
                time.sleep(0.05)
            raise SystemExit("no worker was added within 60 s")
        contribution = (cring.rank() + 1) * (s + 1) * V
        if payload.size:
            cring.allreduce_(payload, op=cring.Max, name="payload")
        cring.allreduce_(contribution, op=cring.Average, name="contribution")
        state.w = 0.9 * state.w - 0.01 * contribution
        state.sizes.append(cring.size())
        state.step += 1
        if state.step % args.commit_every == 0:
            state.commit()
    return state


train(state)
if args.grow_at_end:
    if cring.rank() == 0:
        with open(args.grow_at_end, "w") as f:
            f.write("localhost:4\n")
    worker = cring.elastic._current_worker()
    deadline = time.monotonic() + 60
    while worker.latest_generation() == worker.generation:
        if time.monotonic() > deadline:
            raise SystemExit("no generation was added within 60 s")
        time.sleep(0.05)
me.write_result(
    {
        "worker": me.worker_id,
        "rank": cring.rank(),
        "size": cring.size(),
        "w": state.w.tolist(),
        "sizes": state.sizes,
        "resets": resets,
        "generation": int(os.environ["CRING_ELASTIC_GENERATION"]),
    }
)
cring.shutdown()

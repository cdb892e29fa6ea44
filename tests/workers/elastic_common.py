"""What the elastic test workers (elastic_numbers.py, elastic_torch.py) share:
the common command line and the kills they inflict on themselves.

  --steps N           train until state.step reaches N
  --commit-every C    commit the state every C steps
  --kill W:S          worker W SIGKILLs itself when it is about to run step S
  --kill-during W:S   worker W, on reaching step S, starts a thread that
                      SIGKILLs it 0-5 ms later, wherever it is then
  --crash-at S        every worker raises RuntimeError when about to run step S
                      (a deterministic bug: replacements crash there too)
  --out DIR           where worker<id>.json goes
"""

import argparse
import json
import os
import random
import signal
import threading


def parser() -> argparse.ArgumentParser:
    """The arguments every elastic worker takes; a worker adds its own."""
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--commit-every", type=int, required=True)
    p.add_argument("--kill", action="append", default=[])
    p.add_argument("--kill-during")
    p.add_argument("--crash-at", type=int)
    p.add_argument("--out", required=True)
    return p


class Killer:
    """This worker (CRING_ELASTIC_WORKER_ID): its --kill/--kill-during, its result file."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.worker_id = int(os.environ["CRING_ELASTIC_WORKER_ID"])
        self.out = args.out
        kills = {int(w): int(s) for w, s in (item.split(":") for item in args.kill)}
        self.kill_step = kills.get(self.worker_id)
        self.kill_during = None
        self.crash_at = args.crash_at
        if args.kill_during and int(args.kill_during.split(":")[0]) == self.worker_id:
            self.kill_during = int(args.kill_during.split(":")[1])

    def before_step(self, step: int) -> None:
        if self.crash_at == step:
            raise RuntimeError(f"deterministic crash at step {step}")
        if self.kill_step == step:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kill_during == step:
            threading.Timer(
                random.uniform(0, 0.005), lambda: os.kill(os.getpid(), signal.SIGKILL)
            ).start()

    def write_result(self, result: dict) -> None:
        """Write <out>/worker<id>.json."""
        with open(os.path.join(self.out, f"worker{self.worker_id}.json"), "w") as f:
            json.dump(result, f)

"""Driver for tests/test_run_api.py: calls cring.run (as Horovod programs call
horovod.run) with functions of this __main__ module, which cloudpickle sends
by value, and prints one line 'OUTCOME <json>' describing what came back.

  run_api.py SCENARIO NP [HOSTS RSH]
  SCENARIO: ranks | fail | exit | module | horovod | hosts | usage | elastic
"""

import json
import os
import socket
import sys


def work(scale, offset=0):
    import numpy as np

    import cring

    cring.init()
    x = np.array([float(cring.rank() + 1)])
    cring.allreduce_(x, op=cring.Sum)
    out = {
        "rank": cring.rank(),
        "size": cring.size(),
        "sum": float(x[0]) * scale + offset,
        "pid": os.getpid(),
        "host": socket.gethostname(),
    }
    cring.shutdown()
    return out


def fail_on_rank_1():
    import numpy as np

    import cring

    cring.init()
    if cring.rank() == 1:
        raise ValueError(f"boom on rank {cring.rank()} of {cring.size()}")
    x = np.ones(1)
    cring.allreduce_(x, op=cring.Sum)  # the others wait for rank 1 here
    return "unreachable"


def exit_on_last_rank():
    import cring

    cring.init()
    if cring.rank() == cring.size() - 1:
        os._exit(7)
    cring.barrier()
    return "unreachable"


def elastic_loop(steps):
    import signal

    import numpy as np

    import cring
    import cring.elastic

    cring.init()

    @cring.elastic.run
    def loop(state):
        while state.step < steps:
            if state.step == 3 and os.environ["CRING_ELASTIC_WORKER_ID"] == "2":
                os.kill(os.getpid(), signal.SIGKILL)
            count = cring.allreduce(np.ones(1), op=cring.Sum)
            state.sizes.append(int(count[0]))
            state.step += 1
            state.commit()
        return {"rank": cring.rank(), "size": cring.size(), "sizes": state.sizes}

    return loop(cring.elastic.ObjectState(step=0, sizes=[]))


def main():
    scenario, np_ = sys.argv[1], int(sys.argv[2])
    outcome = {}
    try:
        if scenario == "ranks":
            import cring

            outcome["results"] = cring.run(work, args=(10,), kwargs={"offset": 1}, num_proc=np_)
        elif scenario == "module":
            import cring.run  # the launcher's module: still cring.run(fn) afterwards

            outcome["results"] = cring.run(work, args=(1,), num_proc=np_)
            outcome["main"] = callable(cring.run.main)
        elif scenario == "horovod":
            import cring as horovod  # the one-line change of a Horovod program

            outcome["results"] = horovod.run(work, args=(2,), np=np_, use_gloo=True, use_mpi=False)
        elif scenario == "hosts":
            import cring

            outcome["results"] = cring.run(
                work, args=(1,), hosts=sys.argv[3], rsh=sys.argv[4], store_addr="127.0.0.1"
            )
        elif scenario == "elastic":
            import cring

            outcome["results"] = cring.run(elastic_loop, args=(6,), num_proc=np_, min_num_proc=2)
        elif scenario == "fail":
            import cring

            cring.run(fail_on_rank_1, num_proc=np_)
        elif scenario == "exit":
            import cring

            cring.run(exit_on_last_rank, num_proc=np_)
        elif scenario == "usage":
            import cring

            cring.run(work, args=(1,), num_proc=np_, hosts="localhost:1")
    except Exception as exc:  # reported to the test
        outcome["error"] = {
            "type": type(exc).__name__,
            "message": str(exc),
            "rank": getattr(exc, "rank", None),
            "exit_code": getattr(exc, "exit_code", None),
            "exception": repr(getattr(exc, "exception", None)),
            "cause": repr(exc.__cause__),
        }
    print("OUTCOME " + json.dumps(outcome), flush=True)


if __name__ == "__main__":
    main()

"""The GPU test doubles' set-up, shared by tests/conftest.py's `fakes` fixture
and the tests that build environments for them: compiling libfake_nccl.so,
libfake_nccl_no_allgather.so and libfake_cudart.so (csrc/tests/fake_*.c)
and the environment their processes run in.

The fake runtime runs every stream's work late, on a thread of its own, after
a random delay seeded by CRING_FAKE_CUDA_SEED. The seed is chosen once per
pytest session here (unless set), exported to every process the tests start,
printed in pytest's header and in the report of every failed test that used
the doubles: `CRING_FAKE_CUDA_SEED=<seed> pytest ...` replays the delays.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GPU_TESTS = ROOT / "tests" / "gpu"
# knobs of the fake GPU that every test process inherits from the session
KNOBS = ("CRING_FAKE_CUDA_SEED", "CRING_FAKE_CUDA_DELAY_US", "CRING_FAKE_CUDA_HANG_S")
SEED = os.environ.setdefault("CRING_FAKE_CUDA_SEED", str(secrets.randbelow(10**9)))

_LIBRARIES = (
    ("nccl", ["fake_nccl.c", "fake_nccl_reduce.c"], []),
    ("nccl_no_allgather", ["fake_nccl.c", "fake_nccl_reduce.c"], ["-DFAKE_NCCL_WITHOUT_ALLGATHER"]),
    ("cudart", ["fake_cudart.c", "fake_device.c"], []),
)


def knobs() -> dict:
    """The fake GPU's knobs as this session set them (the seed at least)."""
    return {k: os.environ[k] for k in KNOBS if os.environ.get(k)}


def build(out: Path) -> dict:
    """Compile the doubles into `out`: {"nccl", "nccl_no_allgather", "cudart"}
    -> path. Raises RuntimeError when there is no C compiler."""
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        raise RuntimeError(f"no C compiler ({cc}) to build the test doubles")
    built = {}
    for name, sources, extra in _LIBRARIES:
        lib = out / f"libfake_{name}.so"
        subprocess.run(
            [cc, "-std=c11", "-O1", "-fPIC", "-shared", *extra]
            + [str(ROOT / "csrc" / "tests" / source) for source in sources]
            + ["-o", str(lib)]
            + ["-pthread", "-lrt", "-lm", "-ldl"],
            check=True,
            timeout=120,
        )
        built[name] = str(lib)
    return built


def clean_env(**extra: str) -> dict:
    """This process's environment without cring's, Horovod's and launchers'
    variables (the fake GPU's knobs kept), tests/gpu on PYTHONPATH (the
    stand-ins), a 60 s communication time-out, and `extra`."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("CRING_", "HOROVOD_", "OMPI_", "PMI", "SLURM_"))
        and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(knobs())
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(GPU_TESTS), env.get("PYTHONPATH")) if p)
    env["CRING_TIMEOUT_SECONDS"] = "60"
    env.update(extra)
    return env


class FakeGPU(dict):
    """What the `fakes` fixture gives: the libraries' paths by name (a dict,
    as before), the session's seed, and env() for a process on them."""

    @property
    def seed(self) -> str:
        return SEED

    def env(self, **extra: str) -> dict:
        """clean_env() with CRING_NCCL_LIBRARY and CRING_CUDART_LIBRARY set to
        the doubles, and `extra`."""
        return clean_env(
            CRING_NCCL_LIBRARY=self["nccl"], CRING_CUDART_LIBRARY=self["cudart"], **extra
        )

    def describe(self) -> str:
        return f"fake GPU: CRING_FAKE_CUDA_SEED={SEED} replays this session's delays"

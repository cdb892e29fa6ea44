# Which launcher started this process, read from the environment, the check
# of Trainer(devices=...) against it, strategy="auto" choosing cring under
# cring's own launchers, and which CUDA device each rank takes.
# Stdlib and cring._discovery only: nothing here imports Lightning or torch,
# starts processes or communicates.
"""Detection of an external launch (cringrun, Ray, Horovod, torchrun, MPI, SLURM)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Callable, Optional

from cring import _discovery

# ---- which launcher started this process ----------------------------------------------------


@dataclass(frozen=True)
class Launch:
    """A process started by an external launcher: one rank per process."""

    source: str  # "cring" (cringrun, Ray), "horovod", "torchrun", "openmpi", "pmi", "slurm"
    rank: int
    size: int
    local_rank: int
    local_size: Optional[int]  # None when the launcher does not say
    node_rank: int


def _int(env: Mapping[str, str], *names: str) -> Optional[int]:
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                raise ValueError(
                    f"environment variable {name}={value!r} is not an integer"
                ) from None
    return None


# launcher -> (local rank variables, local size variables, node rank variables)
_LOCAL_VARIABLES = {
    "cring": (("CRING_LOCAL_RANK",), ("CRING_LOCAL_SIZE",), ("CRING_NODE_RANK",)),
    "horovod": (("HOROVOD_LOCAL_RANK",), ("HOROVOD_LOCAL_SIZE",), ("HOROVOD_CROSS_RANK",)),
    "torchrun": (("LOCAL_RANK",), ("LOCAL_WORLD_SIZE",), ("GROUP_RANK", "NODE_RANK")),
    "openmpi": (("OMPI_COMM_WORLD_LOCAL_RANK",), ("OMPI_COMM_WORLD_LOCAL_SIZE",), ()),
    "pmi": (
        ("MPI_LOCALRANKID", "PMI_LOCAL_RANK", "PMIX_LOCAL_RANK"),
        ("MPI_LOCALNRANKS", "PMI_LOCAL_SIZE", "PMIX_LOCAL_SIZE"),
        (),
    ),
    "slurm": (("SLURM_LOCALID",), ("SLURM_NTASKS_PER_NODE",), ("SLURM_NODEID",)),
}


def external_launch(env: Optional[Mapping[str, str]] = None) -> Optional[Launch]:
    """The launch this process is part of, when a launcher started every rank
    (CRING_RANK/CRING_SIZE from cringrun or Ray, HOROVOD_*, torchrun's RANK/
    WORLD_SIZE, Open MPI, PMI, SLURM: the same order as cring.init()), else
    None. Lightning's own child processes (LOCAL_RANK without RANK) are not
    an external launch."""
    env = os.environ if env is None else env
    rank, size, source = _discovery._detect_rank_size(env)
    if rank is None or size is None:
        return None
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"{source} says this is rank {rank} of {size}, which is out of range")
    local_rank_vars, local_size_vars, node_vars = _LOCAL_VARIABLES[source]
    local_rank = _int(env, *local_rank_vars)
    try:
        local_size = _int(env, *local_size_vars)
    except ValueError:
        if source != "slurm":
            raise
        local_size = None  # SLURM_NTASKS_PER_NODE such as "2(x3)": not one number
    node_rank = _int(env, *node_vars)
    if local_rank is None:
        local_rank = 0 if size == 1 else rank % local_size if local_size else 0
    if node_rank is None:
        node_rank = rank // local_size if local_size else 0
    return Launch(source, rank, size, local_rank, local_size, node_rank)


def launched_by_cring(env: Optional[Mapping[str, str]] = None) -> bool:
    """True in a rank of a job of more than one rank that cring's own launchers
    started (cringrun, cring.run, cring.ray): where Trainer()/Fabric() with no
    strategy should be cring, as Lightning picks DDP by itself under torchrun."""
    env = os.environ if env is None else env
    launch = external_launch(env)
    return launch is not None and launch.source == "cring" and launch.size > 1


def choose_cring_when_launched_by_it(choose: Callable) -> Callable:
    """Wrap a Lightning connector's _choose_strategy (what strategy="auto" calls)
    so that it answers "cring" in a job cring's launchers started, and asks
    Lightning otherwise. Idempotent: wrapping the wrapper returns it."""
    if getattr(choose, "_cring_auto", False):
        return choose

    def _choose_strategy(self):
        if launched_by_cring():
            return "cring"
        return choose(self)

    _choose_strategy._cring_auto = True  # type: ignore[attr-defined]
    _choose_strategy.__doc__ = choose.__doc__
    return _choose_strategy


def check_devices(launch: Launch, num_devices: int, num_nodes: int) -> None:
    """With an external launcher, `devices` must be 1 (one rank per process)
    or the number of processes the launcher started on this host."""
    if num_devices == 1:
        return
    per_host = launch.local_size
    if per_host is None or num_devices != per_host:
        started = f"{per_host} processes on this host" if per_host else "one process per rank"
        raise ValueError(
            f"Trainer(devices={num_devices}) with strategy='cring': {launch.source} already "
            f"started {started} ({launch.size} in all), and cring never starts more under an "
            f"external launcher. Use devices=1 (one rank per process)"
            + (f" or devices={per_host}" if per_host else "")
        )
    if num_devices * num_nodes != launch.size:
        raise ValueError(
            f"Trainer(devices={num_devices}, num_nodes={num_nodes}) with strategy='cring' makes "
            f"{num_devices * num_nodes} ranks, but {launch.source} started {launch.size}; use "
            f"devices=1, or num_nodes={launch.size // num_devices}"
        )


# ---- which CUDA device this process trains on -----------------------------------------------

# Set by cring.ray for a GPU worker: the index, among the worker's visible CUDA devices, of
# the GPU Ray gave it. Anyone may set it under another launcher; Lightning's own launch
# ignores it (every child would inherit the same value).
CUDA_DEVICE_VARIABLE = "CRING_CUDA_DEVICE"


def cuda_device_index(
    launch: Optional[Launch],
    local_rank: int,
    requested: Sequence[int],
    visible_count: Callable[[], int],
    env: Optional[Mapping[str, str]] = None,
) -> int:
    """The index (among the visible CUDA devices) of the GPU this rank uses.

    `requested` is what Lightning parsed from Trainer(devices=...) on this host
    (devices=2 -> [0, 1], devices=[2, 3] -> [2, 3]); `visible_count` returns
    torch.cuda.device_count() and is called only when needed.

    - Lightning's own launch (launch is None): requested[local_rank], as DDP.
    - An external launcher: CRING_CUDA_DEVICE when set (cring.ray sets it);
      else requested[local_rank] when devices is the processes per host
      (torchrun's convention); else, for devices=1, the local rank, or 0 when
      a single device is visible (each rank has its own CUDA_VISIBLE_DEVICES,
      as under Ray, `srun --gpus-per-task=1` or a wrapper script); a single
      other device (devices=[k]) is used as given.
    """
    env = os.environ if env is None else env
    if launch is None:
        if not 0 <= local_rank < len(requested):
            raise ValueError(
                f"local rank {local_rank} has no CUDA device: the strategy was given "
                f"{len(requested)} ({list(requested)})"
            )
        return requested[local_rank]
    chosen = _int(env, CUDA_DEVICE_VARIABLE)
    if chosen is not None:
        if chosen < 0:
            raise ValueError(f"{CUDA_DEVICE_VARIABLE}={chosen} is not a CUDA device index")
        return chosen
    if len(requested) > 1:
        if not 0 <= local_rank < len(requested):
            raise ValueError(
                f"{launch.source} started local rank {local_rank}, but the strategy was given "
                f"{len(requested)} CUDA devices ({list(requested)})"
            )
        return requested[local_rank]
    if requested and requested[0] != 0:
        return requested[0]
    visible = visible_count()
    if visible < 1:
        raise ValueError(
            f"no CUDA device is visible to local rank {local_rank} ({launch.source}); check "
            "CUDA_VISIBLE_DEVICES, or use accelerator='cpu'"
        )
    if visible == 1:
        return 0
    if local_rank < visible:
        return local_rank
    raise ValueError(
        f"{launch.source} started local rank {local_rank}, but this host shows only {visible} "
        f"CUDA devices (one GPU per rank, cuda:<local rank>). Start at most {visible} processes "
        f"per host, or give each process one GPU with CUDA_VISIBLE_DEVICES (several ranks on "
        f"one GPU need CRING_GPU_OPERATIONS=host), or set {CUDA_DEVICE_VARIABLE} per process"
    )

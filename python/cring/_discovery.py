"""Rank discovery: who am I, how many are we, and where is the rendezvous store.

Reads, in order of precedence: keyword arguments to ``cring.init()``, then
``CRING_*`` variables (set by ``cringrun``), ``HOROVOD_*``, torchrun's
(``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``), Open MPI's
(``OMPI_COMM_WORLD_*``), PMI's (``PMI_RANK``/``PMI_SIZE``) and SLURM's
(``SLURM_PROCID``/``SLURM_NTASKS``). Local rank and size are not taken from the
environment: the C core computes them from host identities at rendezvous.

This module only decides addresses; it never talks to peers except through the
launcher-specific side channels (torch's store under torchrun, mpi4py or a
rendezvous file under mpirun) that exist precisely to share rank 0's address.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Optional

DEFAULT_TIMEOUT_S = 600.0


@dataclass
class Plan:
    """Everything ``_C.init`` needs, plus how the store is held."""

    rank: int
    size: int
    addr: str
    port: int
    serve_store: bool  # rank 0 starts the store inside _C.init
    secret: Optional[str]
    job_key: str
    transport: str
    timeout_s: float
    source: str  # which environment the rank came from, for messages
    store_server: Any = None  # a StoreServer this process started itself
    cleanup: Optional[Callable[[], None]] = None  # run once init succeeded


def _first_int(env: Mapping[str, str], *names: str) -> tuple[Optional[int], Optional[str]]:
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            try:
                return int(value), name
            except ValueError:
                raise ValueError(
                    f"environment variable {name}={value!r} is not an integer"
                ) from None
    return None, None


def _detect_rank_size(env: Mapping[str, str]) -> tuple[Optional[int], Optional[int], str]:
    """(rank, size, source) from the first launcher whose variables are set."""
    sources = [
        ("cring", ("CRING_RANK",), ("CRING_SIZE",)),
        ("horovod", ("HOROVOD_RANK",), ("HOROVOD_SIZE",)),
        ("torchrun", ("RANK",), ("WORLD_SIZE",)),
        ("openmpi", ("OMPI_COMM_WORLD_RANK",), ("OMPI_COMM_WORLD_SIZE",)),
        ("pmi", ("PMI_RANK", "PMIX_RANK"), ("PMI_SIZE",)),
        ("slurm", ("SLURM_PROCID",), ("SLURM_NTASKS", "SLURM_NPROCS")),
    ]
    for source, rank_names, size_names in sources:
        rank, _ = _first_int(env, *rank_names)
        size, _ = _first_int(env, *size_names)
        if rank is not None and size is not None:
            return rank, size, source
    return None, None, "single process"


def _slurm_first_host(nodelist: str) -> str:
    """First host of a SLURM host list such as 'node[07-09,12],login1'."""
    m = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if not m:
        return nodelist
    prefix, bracket = m.group(1), m.group(3)
    if not bracket:
        return prefix
    first = bracket.split(",")[0].split("-")[0]
    return prefix + first


def _job_id(env: Mapping[str, str], source: str) -> str:
    for name in (
        "CRING_JOB_ID",
        "TORCHELASTIC_RUN_ID",
        "PMIX_NAMESPACE",
        "OMPI_MCA_ess_base_jobid",
        "SLURM_JOB_ID",
    ):
        if env.get(name):
            value = env[name]
            if name == "SLURM_JOB_ID" and env.get("SLURM_STEP_ID"):
                value += "." + env["SLURM_STEP_ID"]
            return re.sub(r"[^A-Za-z0-9_.-]", "_", value)
    return "cring"


def _torchrun_exchange(plan: Plan, env: Mapping[str, str], start_store: Callable) -> None:
    """Under torchrun, MASTER_PORT is torch's own store: share our store's
    address through it instead of binding that port."""
    from datetime import timedelta

    import torch.distributed as dist  # present whenever torchrun is

    master_addr = env.get("MASTER_ADDR", "127.0.0.1")
    master_port = int(env["MASTER_PORT"])
    store = dist.TCPStore(
        master_addr, master_port, is_master=False, timeout=timedelta(seconds=plan.timeout_s)
    )
    key = f"cring/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/{plan.job_key}/store"
    if plan.rank == 0:
        addr = _reachable_addr(master_addr)
        server, port = start_store(addr, plan.secret)
        plan.store_server = server
        store.set(key, f"{addr}|{port}|{plan.secret or ''}")
        plan.addr, plan.port = addr, port
    else:
        addr, port, secret = store.get(key).decode().split("|", 2)
        plan.addr, plan.port, plan.secret = addr, int(port), secret or None
    plan.serve_store = False


def _reachable_addr(toward: str) -> str:
    """This host's address as seen when reaching `toward` (loopback stays loopback)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((toward, 9))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def _mpi_exchange(plan: Plan, env: Mapping[str, str], start_store: Callable) -> None:
    """Under mpirun with no address: rank 0 serves the store and tells the
    others through mpi4py, or, without mpi4py on a single host, through a
    private rendezvous file."""
    try:
        from mpi4py import MPI  # noqa: F401  (initialises MPI if needed)

        have_mpi4py = True
    except ImportError:
        have_mpi4py = False
    if have_mpi4py:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        record = None
        if plan.rank == 0:
            addr = socket.gethostname() if comm.Get_size() > 1 else "127.0.0.1"
            addr = _reachable_addr(addr) if addr != "127.0.0.1" else addr
            try:
                # Every rank on this host? Then stay on loopback.
                hosts = comm.gather(_host_key(), root=0)
            except Exception:
                hosts = None
            if hosts is not None and len(set(hosts)) == 1:
                addr = "127.0.0.1"
            server, port = start_store(addr, plan.secret)
            plan.store_server = server
            record = (addr, port, plan.secret)
        else:
            comm.gather(_host_key(), root=0)
        addr, port, secret = comm.bcast(record, root=0)
        plan.addr, plan.port, plan.secret = addr, port, secret
        plan.serve_store = False
        return

    local_size, _ = _first_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
    if local_size is not None and local_size != plan.size:
        raise RuntimeError(
            "cring.init: running under mpirun across several hosts without a rendezvous "
            "address; install mpi4py or set CRING_ADDR and CRING_PORT (rank 0's host and a "
            "free port)"
        )
    path = os.path.join(
        os.environ.get("TMPDIR", "/tmp"),
        f"cring-rdzv-{os.getuid()}-{plan.job_key.replace('/', '_')}",
    )
    if plan.rank == 0:
        server, port = start_store("127.0.0.1", plan.secret)
        plan.store_server = server
        tmp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"127.0.0.1|{port}|{plan.secret or ''}")
        os.replace(tmp, path)
        plan.addr, plan.port = "127.0.0.1", port

        def remove_file() -> None:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

        plan.cleanup = remove_file
    else:
        deadline = time.monotonic() + plan.timeout_s
        while True:
            try:
                with open(path) as f:
                    addr, port, secret = f.read().split("|", 2)
                break
            except (FileNotFoundError, ValueError):
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"cring.init: rank {plan.rank} found no rendezvous file {path} from rank 0"
                    ) from None
                time.sleep(0.01)
        plan.addr, plan.port, plan.secret = addr, int(port), secret or None
    plan.serve_store = False


def _host_key() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}|{boot}"


def plan_init(
    *,
    rank: Optional[int],
    size: Optional[int],
    addr: Optional[str],
    port: Optional[int],
    secret: Optional[str],
    transport: Optional[str],
    timeout_s: Optional[float],
    generation: int,
    start_store: Callable[[str, Optional[str]], tuple[Any, int]],
    env: Optional[Mapping[str, str]] = None,
) -> Plan:
    """Decide rank, size and rendezvous for this process.

    `start_store(addr, secret) -> (server, port)` starts a store server when
    rank 0 must hold one before the others can know its port.
    """
    env = os.environ if env is None else env
    env_rank, env_size, source = _detect_rank_size(env)
    rank = env_rank if rank is None else rank
    size = env_size if size is None else size
    if rank is None and size is None:
        rank, size = 0, 1
    if rank is None or size is None:
        raise ValueError("cring.init: give both rank= and size=, or neither")
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"cring.init: rank {rank} is out of range for size {size}")

    transport = (transport or env.get("CRING_TRANSPORT") or "auto").lower()
    if transport not in ("auto", "tcp", "shm"):
        raise ValueError(f"CRING_TRANSPORT must be auto, tcp or shm, got {transport!r}")
    if timeout_s is None:
        timeout_s = float(env.get("CRING_TIMEOUT_SECONDS") or DEFAULT_TIMEOUT_S)
    if secret is None:
        secret = env.get("CRING_SECRET") or None
    job_key = f"{_job_id(env, source)}/{generation}"
    elastic_generation, _ = _first_int(env, "CRING_ELASTIC_GENERATION")
    if elastic_generation is not None:
        # cringrun --elastic numbers the job's generations itself: survivors (after
        # several init()s) and workers started for this generation (first init())
        # must meet under the same key, whatever this process's own count.
        job_key = f"{_job_id(env, source)}/elastic.{elastic_generation}"

    plan = Plan(
        rank=rank,
        size=size,
        addr="",
        port=0,
        serve_store=False,
        secret=secret,
        job_key=job_key,
        transport=transport,
        timeout_s=timeout_s,
        source=source,
    )
    if size == 1:
        plan.addr = "127.0.0.1"
        return plan

    external = env.get("CRING_STORE_EXTERNAL", "") not in ("", "0")
    addr = addr or env.get("CRING_ADDR")
    port_env, _ = _first_int(env, "CRING_PORT")
    port = port if port is not None else port_env
    torchrun = source == "torchrun" and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if addr is None and port is None and not torchrun:
        addr = env.get("MASTER_ADDR")
        port, _ = _first_int(env, "MASTER_PORT")
    if addr is None and port is None and source == "slurm" and env.get("SLURM_JOB_NODELIST"):
        addr = _slurm_first_host(env["SLURM_JOB_NODELIST"])
        port = 15000 + int(re.sub(r"\D", "", env.get("SLURM_JOB_ID", "0")) or 0) % 20000

    if addr is not None or port is not None:
        if addr is None or port is None:
            raise ValueError(
                "cring.init: a rendezvous needs both an address and a port "
                "(addr=/port=, CRING_ADDR/CRING_PORT or MASTER_ADDR/MASTER_PORT)"
            )
        plan.addr, plan.port = addr, int(port)
        plan.serve_store = rank == 0 and not external
        return plan

    if plan.secret is None and rank == 0:
        plan.secret = secrets.token_hex(16)
    if torchrun:
        _torchrun_exchange(plan, env, start_store)
        return plan
    if source in ("openmpi", "pmi"):
        _mpi_exchange(plan, env, start_store)
        return plan
    raise ValueError(
        f"cring.init: rank {rank} of {size} ({source}) has no rendezvous address; set "
        "CRING_ADDR and CRING_PORT (or MASTER_ADDR and MASTER_PORT), or launch with cringrun"
    )

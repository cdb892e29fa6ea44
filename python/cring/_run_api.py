# cring.run(fn, ...): Horovod's horovod.run on cringrun. The caller's side:
# build cringrun's options, put the pickled call in the job's store, run the
# job in this process (cring.launch), collect the results. The ranks run
# cring.launch.run_worker. The launcher is imported only when run() is called,
# so that `import cring` stays light.
"""cring.run: run a Python function on N processes and get their results."""

from __future__ import annotations

import contextlib
import io
import pickle
import sys
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Optional

__all__ = ["RunError", "run"]

# Longest the caller waits for a rank's stored result once the job has ended
# (it is stored before the rank exits, so this is only a bound).
_RESULT_WAIT_S = 5.0


class RunError(RuntimeError):
    """A rank of a cring.run() job failed.

    ``rank`` is the rank that failed first; ``exception`` the exception it
    raised (None when it died without one, or the exception did not pickle;
    the error is then also chained as ``__cause__``); ``worker_traceback`` its
    traceback as text; ``exit_code`` the job's exit status (cringrun's)."""

    def __init__(
        self,
        message: str,
        rank: Optional[int],
        exception: Optional[BaseException] = None,
        worker_traceback: str = "",
        exit_code: int = 1,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.exception = exception
        self.worker_traceback = worker_traceback
        self.exit_code = exit_code


def _launcher_argv(
    num_proc: Optional[int],
    hosts: Optional[str],
    hostfile: Optional[str],
    ssh_port: Optional[int],
    ssh_identity_file: Optional[str],
    network_interfaces: Optional[Sequence[str]],
    elastic: dict,
    rsh: Optional[str],
    store_addr: Optional[str],
    env: Optional[dict],
) -> list[str]:
    argv: list[str] = []
    if num_proc is not None:
        argv += ["-np", str(num_proc)]
    for option, value in (
        ("-H", hosts),
        ("--hostfile", hostfile),
        ("--ssh-port", ssh_port),
        ("--ssh-identity-file", ssh_identity_file),
        ("--rsh", rsh),
        ("--store-addr", store_addr),
    ):
        if value is not None:
            argv += [option, str(value)]
    if network_interfaces:
        if len(network_interfaces) > 1:
            warnings.warn(
                f"cring.run: cringrun uses one network interface; using "
                f"{network_interfaces[0]!r} of {list(network_interfaces)}",
                stacklevel=3,
            )
        argv += ["--network-interface", network_interfaces[0]]
    if any(v is not None for v in elastic.values()):
        argv.append("--elastic")
        for option, value in elastic.items():
            if value is not None:
                argv += [option, str(value)]
    for name, value in (env or {}).items():
        argv += ["-x", f"{name}={value}"]
    return argv


class _Session:
    """What _launch calls around the job: store the call, then read the outcome."""

    def __init__(self, call: bytes) -> None:
        self._call = call
        self.results: dict[int, Any] = {}
        self.errors: list[dict] = []
        self.size = 0
        self.first_failed_rank: Optional[int] = None

    def started(self, variables: dict[str, str]) -> None:
        from cring._elastic_protocol import StoreClient
        from cring.launch.run_worker import Keys

        self._keys = Keys(variables["CRING_JOB_ID"])
        self._client = StoreClient(
            variables["CRING_ADDR"], int(variables["CRING_PORT"]), variables["CRING_SECRET"], 30.0
        )
        self._client.set(self._keys.call, self._call)

    def finished(self, job: Any, size: Optional[int]) -> None:
        """size None (elastic): the final ranks are those with a result, 0, 1, ..."""
        try:
            self.first_failed_rank = getattr(job, "first_failed_rank", None)
            count = self._client.add(self._keys.errors, 0)
            for n in range(1, count + 1):
                value = self._client.get(self._keys.error(n), _RESULT_WAIT_S)
                if value is not None:
                    self.errors.append(pickle.loads(value))
            rank = 0
            while not self.errors and (size is None or rank < size):
                value = self._client.get(self._keys.result(rank), 0.0)
                if value is None and size is None:
                    break
                if value is not None:
                    self.results[rank] = pickle.loads(value)
                rank += 1
            self.size = size if size is not None else len(self.results)
        finally:
            self._client.close()


def run(
    func: Callable[..., Any],
    args: Iterable[Any] = (),
    kwargs: Optional[dict] = None,
    num_proc: Optional[int] = None,
    min_num_proc: Optional[int] = None,
    max_num_proc: Optional[int] = None,
    slots: Optional[int] = None,
    reset_limit: Optional[int] = None,
    cooldown_range: Any = None,
    hosts: Optional[str] = None,
    hostfile: Optional[str] = None,
    host_discovery_script: Optional[str] = None,
    start_timeout: Optional[float] = None,
    ssh_port: Optional[int] = None,
    ssh_identity_file: Optional[str] = None,
    disable_cache: Any = None,
    output_filename: Optional[str] = None,
    verbose: Any = None,
    use_gloo: Any = None,
    use_mpi: Any = None,
    mpi_args: Any = None,
    network_interface: Optional[str] = None,
    network_interfaces: Optional[Sequence[str]] = None,
    executable: Optional[str] = None,
    np: Optional[int] = None,
    min_np: Optional[int] = None,
    max_np: Optional[int] = None,
    *,
    rsh: Optional[str] = None,
    store_addr: Optional[str] = None,
    env: Optional[dict] = None,
) -> list:
    """Run ``func(*args, **kwargs)`` on ``num_proc`` processes, the ranks of a
    cring job started as ``cringrun`` starts them (this host, or ``hosts`` /
    ``hostfile`` over ssh), and return their return values in rank order.

    Horovod's ``horovod.run``, so ``import cring as horovod`` keeps a
    program's ``horovod.run(...)`` working. ``func`` and its arguments are
    sent with cloudpickle (functions of ``__main__`` by value) through the
    job's rendezvous store; each rank calls ``cring.init()`` (or
    ``hvd.init()``) itself, as under cringrun. The ranks' output is printed
    with cringrun's ``[rank]`` prefixes.

    A rank that raises ends the job (cringrun stops the others) and run()
    raises :class:`RunError` naming the rank that failed first, with its
    exception's type, message and traceback (the exception itself is
    ``err.exception`` and the ``__cause__``). A rank that dies without an
    exception is named from cringrun's record of the first failure.

    Options as Horovod's: ``num_proc`` (or the deprecated ``np``; default 1,
    or the slots of ``hosts``), ``hosts`` ("h1:2,h2:4"), ``hostfile``,
    ``ssh_port``, ``ssh_identity_file``, ``network_interfaces`` (the first is
    used; ``network_interface`` "a,b" is the deprecated spelling),
    ``executable`` (the Python of the ranks, default sys.executable).
    ``min_num_proc``/``max_num_proc``/``host_discovery_script``/
    ``reset_limit`` make it an elastic job (cringrun --elastic); the results
    are then those of the final ranks. ``use_gloo``, ``use_mpi``,
    ``mpi_args``, ``disable_cache``, ``verbose``, ``start_timeout``,
    ``slots`` and ``cooldown_range`` are accepted and ignored (cring has one
    controller and no start-up checks; ``slots`` belongs to the discovery
    script's lines; ``cooldown_range`` to cringrun's blacklisting when it has
    one); ``output_filename`` is refused (NotImplementedError) rather than
    ignored. cring's own: ``rsh`` (cringrun --rsh), ``store_addr``
    (--store-addr) and ``env`` (a dict exported to every rank, -x).

    Raises ValueError for bad options (cringrun's usage errors), RunError
    when a rank fails.
    """
    if output_filename is not None:
        raise NotImplementedError(
            "cring.run: output_filename is not supported; the ranks' output is printed "
            "with [rank] prefixes"
        )
    if np is not None:
        warnings.warn("np is deprecated, use num_proc instead", DeprecationWarning, stacklevel=2)
        num_proc = np
    if min_np is not None:
        warnings.warn("min_np is deprecated, use min_num_proc", DeprecationWarning, stacklevel=2)
        min_num_proc = min_np
    if max_np is not None:
        warnings.warn("max_np is deprecated, use max_num_proc", DeprecationWarning, stacklevel=2)
        max_num_proc = max_np
    if network_interface is not None:
        warnings.warn(
            "network_interface is deprecated, use network_interfaces",
            DeprecationWarning,
            stacklevel=2,
        )
        network_interfaces = network_interface.split(",")
    if not callable(func):
        raise TypeError(f"cring.run: func must be callable, got {type(func).__name__}")
    if num_proc is None and hosts is None and hostfile is None:
        num_proc = 1
    from cring.launch.cli import parse_args
    from cring.launch.entry import _launch
    from cring.launch.run_worker import dumps

    call = dumps((func, tuple(args), dict(kwargs or {})), "the function and its arguments")
    elastic = {
        "--min-np": min_num_proc,
        "--max-np": max_num_proc,
        "--host-discovery-script": host_discovery_script,
        "--reset-limit": reset_limit,
    }
    argv = _launcher_argv(
        num_proc,
        hosts,
        hostfile,
        ssh_port,
        ssh_identity_file,
        network_interfaces,
        elastic,
        rsh,
        store_addr,
        env,
    )
    argv += ["--", executable or sys.executable, "-m", "cring.launch.run_worker"]
    usage = io.StringIO()
    try:
        with contextlib.redirect_stderr(usage):
            options = parse_args(argv)
    except SystemExit:
        lines = [line for line in usage.getvalue().splitlines() if line.strip()]
        raise ValueError(f"cring.run: {lines[-1] if lines else 'bad options'}") from None
    session = _Session(call)
    status = _launch(options, session)
    return _outcome(session, status)


def _outcome(session: _Session, status: int) -> list:
    if session.errors:
        first = session.errors[0]
        exc = None
        if first["exception"] is not None:
            try:
                exc = pickle.loads(first["exception"])
            except Exception:
                exc = None
        message = (
            f"cring.run: rank {first['rank']} of {session.size} failed: "
            f"{first['type']}: {first['message']}\n--- traceback of rank {first['rank']} ---\n"
            f"{first['traceback'].rstrip()}"
        )
        raise RunError(message, first["rank"], exc, first["traceback"], status or 1) from exc
    missing = [r for r in range(session.size) if r not in session.results]
    if status != 0 or missing or not session.size:
        rank = session.first_failed_rank
        if rank is None and missing:
            rank = missing[0]
        what = f"rank {rank}" if rank is not None else "the job"
        raise RunError(
            f"cring.run: {what} failed without a Python exception (cringrun's exit status "
            f"{status}; its message above says how); ranks without a result: {missing}",
            rank,
            exit_code=status or 1,
        )
    return [session.results[r] for r in range(session.size)]

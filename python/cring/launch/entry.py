# cringrun's entry point: parse the command line, plan the hosts, serve the
# job's rendezvous store, run the job (plain or elastic), return its status.
"""main() of cringrun."""

from __future__ import annotations

import os
import secrets
import sys
from collections.abc import Sequence
from typing import Any, Optional

from .cli import PROG, Options, parse_args
from .elastic_driver import ElasticJob
from .hosts import assign_ranks, interface_address, is_local, local_host_names, store_address
from .job import HostsPlan, Job, start_store
from .remote import forwarded_environment, remote_shell
from .signals import signals_blocked

__all__ = ["main"]


def job_variables(addr: str, port: int, secret: str, job_id: str) -> dict[str, str]:
    return {
        "CRING_ADDR": addr,
        "CRING_PORT": str(port),
        "CRING_SECRET": secret,
        "CRING_STORE_EXTERNAL": "1",
        "CRING_JOB_ID": job_id,
    }


def job_environment(port: int, secret: str, job_id: str, addr: str = "127.0.0.1") -> dict[str, str]:
    env = dict(os.environ)
    env.update(job_variables(addr, port, secret, job_id))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _store_address(options: Options) -> str:
    """Where the store listens and the ranks reach it (ValueError: bad interface)."""
    if options.store_addr is not None:
        return options.store_addr
    if options.network_interface is not None:
        return interface_address(options.network_interface)
    if options.hosts is None:
        return "127.0.0.1"
    names = local_host_names()
    return store_address([h.name for h in options.hosts if not is_local(h.name, names)])


def _hosts_plan(options: Options, variables: dict[str, str]) -> HostsPlan | None:
    if options.hosts is None:
        return None
    shell = remote_shell(
        options.rsh,
        options.ssh_port,
        options.ssh_identity_file,
        options.remote_python,
        os.environ,
    )
    remote_env = forwarded_environment(os.environ, options.exports)
    remote_env.update(variables)
    return HostsPlan(
        placements=assign_ranks(options.hosts, options.num_proc),
        shell=shell,
        remote_env=remote_env,
    )


def _launch(options: Options, session: Optional[Any] = None) -> int:
    """Serve the store, run the job, stop the store; the job's exit status.

    `session` (cring.run's): session.started(variables) once the store
    serves (the job's CRING_ADDR/PORT/SECRET/JOB_ID), and
    session.finished(job, size) after the job, while the store still serves.
    """
    secret = secrets.token_hex(16)
    job_id = secrets.token_hex(8)
    try:
        addr = _store_address(options)
    except ValueError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    try:
        with signals_blocked():  # the store's C thread inherits the mask
            server, port = start_store(secret, addr)
    except ImportError as exc:
        print(
            f"{PROG}: cannot start the rendezvous store: cring's C extension is not "
            f"importable ({exc}); build and install the package (pip install .)",
            file=sys.stderr,
        )
        return 1
    except Exception as exc:
        print(f"{PROG}: cannot start the rendezvous store: {exc}", file=sys.stderr)
        return 1
    try:
        env = job_environment(port, secret, job_id, addr)
        env.update(options.rank_variables())  # --autotune
        try:
            plan = _hosts_plan(
                options, {**job_variables(addr, port, secret, job_id), **options.rank_variables()}
            )
        except ValueError as exc:
            print(f"{PROG}: {exc}", file=sys.stderr)
            return 2
        job = ElasticJob(options, env, job_id, plan) if options.elastic else Job(options, env, plan)
        if session is not None:
            session.started(job_variables(addr, port, secret, job_id))
        status = job.run()
        if session is not None:
            session.finished(job, None if options.elastic else options.num_proc)
        return status
    finally:
        try:
            server.stop()
        except Exception as exc:
            print(f"{PROG}: warning: stopping the rendezvous store failed: {exc}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run cringrun with argv (default sys.argv[1:]); return the exit status."""
    if argv is None:
        argv = sys.argv[1:]
    try:
        options = parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error already printed
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    return _launch(options)

# cringrun's entry point: parse the command line, serve the job's rendezvous
# store, run the job (plain or elastic) and return its exit status.
"""main() of cringrun."""

from __future__ import annotations

import os
import secrets
import sys
from collections.abc import Sequence

from .cli import PROG, Options, parse_args
from .elastic_driver import ElasticJob
from .job import Job, start_store
from .signals import signals_blocked

__all__ = ["main"]


def job_environment(port: int, secret: str, job_id: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        CRING_ADDR="127.0.0.1",
        CRING_PORT=str(port),
        CRING_SECRET=secret,
        CRING_STORE_EXTERNAL="1",
        CRING_JOB_ID=job_id,
    )
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _launch(options: Options) -> int:
    secret = secrets.token_hex(16)
    job_id = secrets.token_hex(8)
    try:
        with signals_blocked():  # the store's C thread inherits the mask
            server, port = start_store(secret)
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
        env = job_environment(port, secret, job_id)
        env.update(options.rank_variables())  # --autotune
        if options.elastic:
            return ElasticJob(options, env, job_id).run()
        return Job(options, env).run()
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

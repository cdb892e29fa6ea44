# cringrun, the process launcher, as a package: cli (command line), hosts
# (host lists, placement), job (the ranks), remote + remote_wrapper (ranks on
# other hosts), output, signals, elastic_driver (--elastic) and entry (main).
# Must not import torch or any framework.
"""Launch N processes of one command as the ranks of a cring job.

Usage::

    cringrun -np N [--no-prefix] [--grace-seconds S] [--] command [args ...]
    cringrun -np N -H hostA:4,hostB:4 | --hostfile FILE [-x VAR[=VALUE]]
             [--rsh CMD] [--ssh-port P] [--ssh-identity-file F]
             [--network-interface IFACE | --store-addr ADDR] command [args ...]
    python -m cring.run -np N ... command [args ...]

Several hosts (docs/launcher.md): ranks fill the hosts' slots in order; ranks
on this machine start as below, the others through the remote shell and
remote_wrapper.py, which gets its environment (the secret included) on stdin
and stops its rank when the launcher goes away. Remote ranks get PATH,
PYTHONPATH, LD_LIBRARY_PATH, every CRING_* variable and the -x ones. The text
below describes ranks on this machine; remote ranks behave the same way
(prefixes, signals, exit codes).

Everything from the first argument that is not a launcher option (or
everything after ``--``) is the command; its own flags are never parsed here.
The command is executed directly (no shell). Rank 0 inherits the launcher's
standard input; the other ranks read from ``/dev/null``.

Environment of every rank: the launcher's environment plus

    CRING_RANK, CRING_SIZE              rank and number of ranks
    CRING_LOCAL_RANK, CRING_LOCAL_SIZE  the same (every rank is on this host)
    CRING_ADDR=127.0.0.1, CRING_PORT    the rendezvous store the launcher serves
    CRING_SECRET                        random per-job token the store requires
    CRING_STORE_EXTERNAL=1              the store already runs; rank 0 must not
                                        start one
    CRING_JOB_ID                        random id of this job
    PYTHONUNBUFFERED=1                  unless already set

Output: every line a rank writes to stdout is printed on the launcher's stdout
as ``[R] line`` (R = rank), and every stderr line on the launcher's stderr the
same way. Output is relayed as bytes, whole lines at a time, so lines of
different ranks never mix. A final line without a newline is printed with a
newline added; a single line longer than 1 MiB is split into 1 MiB pieces,
each with its own prefix. ``--no-prefix`` relays the bytes unchanged (still
whole lines at a time).

Stopping: each rank runs in its own process group (session); every signal the
launcher sends goes to the whole group, so it reaches the rank's children too.
SIGINT, SIGTERM and SIGHUP received by the launcher are forwarded to every
rank; a second one kills them at once. When a rank exits non-zero or is killed
by a signal, the launcher prints one line on stderr naming it and sends
SIGTERM to the other ranks. Ranks still running ``--grace-seconds`` (default
5) after a SIGTERM or forwarded signal are killed with SIGKILL. When the job
ends, processes left in the ranks' process groups are killed with SIGKILL.

Exit status:

    0        every rank exited with 0
    code     the first rank to fail exited with this code
    128+sig  the first rank to fail was killed by signal sig (137 = SIGKILL)
    130/143  the launcher received SIGINT / SIGTERM (129 for SIGHUP)
    126/127  the command could not be executed / was not found
    2        usage error
    1        the launcher itself failed (e.g. the store could not start)

The first cause wins: ranks that die because the launcher stopped them do not
change the status.

Elastic mode (docs/elastic.md)::

    cringrun --elastic -np K [--min-np M] [--max-np N]
             [--host-discovery-script S [--discovery-interval T]]
             [--reset-limit R] command [args ...]

Each process is a *worker* with an id that is never reused (0..K-1 at the
start; the output prefix is the worker id, not the rank). A worker that fails
(non-zero exit or signal) does not stop the others: the launcher publishes a
new *generation* in its store (the survivors in their previous rank order,
ranks 0..n-1) and the workers re-rendezvous into it (cring.elastic.run). If
fewer than M (default K) workers would remain, or R generations have already
been formed after the first, the job fails as above. The discovery script (an
executable printing 'host[:slots]' lines) is run every T seconds (default 1);
while it reports more slots on this host than there are workers (at most N),
new workers are started for a new generation; slots on other hosts are ignored
with a warning, unless -H/--hostfile is given: then every listed host gets
workers on its free slots and hosts that disappear lose theirs. Failed workers
are replaced only that way. Once a worker has exited 0 the job is finishing:
no generation is formed any more, and a later failure ends the job. Extra
environment of every worker: CRING_ELASTIC=1, CRING_ELASTIC_WORKER_ID,
CRING_ELASTIC_GENERATION. The exit status is 0 when every worker still in the
job exits 0.
"""

from __future__ import annotations

from .entry import main

__all__ = ["main"]

# The elastic driver of `cringrun --elastic`: forms generations of workers,
# publishes them in the launcher's store (cring._elastic_protocol), runs host
# discovery (adding and removing workers per host with -H/--hostfile) and
# answers workers' requests. The worker side is cring.elastic.
"""cringrun --elastic: the launcher's side of elastic training (docs/elastic.md)."""

from __future__ import annotations

import json
import math
import queue
import random
import signal
import subprocess
import threading
import time
from typing import Any

from .. import _elastic_protocol as protocol
from .cli import Options
from .hosts import is_local, local_host_names
from .job import (
    FAILED_RANK_OUTPUT_TIMEOUT_S,
    OUTPUT_THREAD_JOIN_TIMEOUT_S,
    HostsPlan,
    Job,
    Rank,
    count_processes,
    describe_status,
    exit_code_of,
    exit_status_nowait,
    rank_environment,
    signal_rank,
)
from .output import OutputPump
from .signals import SignalWatcher, signals_blocked

# A discovery script that runs longer than this is abandoned for that round.
_DISCOVERY_TIMEOUT_S = 30.0
# Blocking store reads of the request thread are renewed this often.
_REQUEST_WAIT_S = 3600.0


def parse_discovery(text: str) -> tuple[dict[str, int], list[str]]:
    """Lines 'host' or 'host:slots' (blank lines and '#' comments skipped):
    ({host: slots}, [problems])."""
    hosts: dict[str, int] = {}
    problems = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        host, _, slots_text = line.rpartition(":") if ":" in line else (line, "", "1")
        try:
            slots = int(slots_text)
        except ValueError:
            slots = -1
        if not host or slots < 0:
            problems.append(f"ignoring the line {line!r} (expected host or host:slots)")
            continue
        hosts[host] = hosts.get(host, 0) + slots
    return hosts, problems


class ElasticJob(Job):
    """cringrun --elastic: a worker that fails leaves the job instead of ending it.

    Every process is a *worker* with an id that is never reused (its output
    prefix); a *generation* is a list of workers in rank order. When workers
    fail, the survivors (in their previous rank order) form the next
    generation, unless fewer than --min-np would remain; the launcher
    publishes it in its store (cring._elastic_protocol's keys and records) and the
    workers re-rendezvous into it. A discovery script can add workers (up to
    --max-np); a worker can ask for a new generation (after a time-out). Once
    a worker has exited 0 the job is finishing: no generation is formed any
    more and a failure ends the job as without --elastic.

    Failure loops are bounded as in Horovod: where a worker failed (its remote
    host with -H/--hostfile, else one slot of this host) gets no new worker
    for a cool-down (--blacklist-cooldown-range; for good without it), and a
    generation whose every worker failed ends the job with the first one's
    exit code.
    """

    def __init__(
        self, options: Options, env: dict[str, str], job_id: str, hosts: HostsPlan | None = None
    ) -> None:
        super().__init__(options, env, hosts)
        self._keys = protocol.Keys(job_id)
        self._store: Any = None
        self._generation = -1
        self._resets = 0
        self._members: list[Rank] = []  # the current generation, in rank order
        self._next_worker_id = 0
        self._finishing = False
        self._next_discovery_s = 0.0
        self._discovery_problem: str | None = None
        self._local_names = local_host_names()
        self._requests: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        self._request_client: Any = None
        self._request_thread: threading.Thread | None = None
        self._watcher: SignalWatcher | None = None
        self._closing = False
        self._added_now: list[Rank] = []  # started for the current generation (not the first)
        self._abandoned: set[int] = set()  # ids of workers the launcher stopped: not failures
        # With -H/--hostfile: the hosts the discovery script reports ({} before
        # it has run: only the initial hosts) and remote hosts where a worker
        # failed, which get no new workers.
        self._discovered_hosts: dict[str, int] | None = None
        # The blacklist: remote host -> end of its cool-down (time.monotonic(),
        # math.inf: for good); one end per failed slot of this host; failures
        # per place (None: this host), which lengthen the next cool-down.
        self._blocked_hosts: dict[str, float] = {}
        self._blocked_local: list[float] = []
        self._failures: dict[str | None, int] = {}

    def run(self) -> int:
        with SignalWatcher() as watcher:
            self._watcher = watcher
            try:
                if self._connect():
                    self._spawn_all()
                    self._pump = OutputPump(self._streams())
                    with signals_blocked():  # the threads inherit the mask
                        self._pump.start()
                        self._start_request_thread()
                    self._supervise(watcher)
            finally:
                self._stop_request_thread()
                self._finish()
                if self._store is not None:
                    self._store.close()
        return self._exit_code if self._exit_code is not None else 0

    def _connect(self) -> bool:
        try:
            self._store = self._client()
            self._request_client = self._client()
        except (OSError, ConnectionError) as exc:
            self.message(f"cannot connect to its own rendezvous store: {exc}")
            self._exit_code = 1
            return False
        return True

    def _client(self) -> Any:
        return protocol.StoreClient(
            self._env["CRING_ADDR"], int(self._env["CRING_PORT"]), self._env["CRING_SECRET"], 10.0
        )

    # -- requests from workers -------------------------------------------------

    def _start_request_thread(self) -> None:
        self._request_thread = threading.Thread(
            target=self._watch_requests, name="cringrun-requests", daemon=True
        )
        self._request_thread.start()

    def _watch_requests(self) -> None:
        n = 1
        while True:
            try:
                value = self._request_client.get(self._keys.request(n), _REQUEST_WAIT_S)
            except (OSError, ConnectionError, ValueError):
                return  # the launcher is closing the connection
            if value is None:
                continue
            n += 1
            try:
                request = json.loads(value)
            except ValueError:
                continue
            if isinstance(request, dict):
                self._requests.put(request)
                if not self._closing and self._watcher is not None:
                    self._watcher.wake()

    def _stop_request_thread(self) -> None:
        self._closing = True
        if self._request_client is not None:
            self._request_client.abort()
        if self._request_thread is not None:
            self._request_thread.join(OUTPUT_THREAD_JOIN_TIMEOUT_S)

    def _handle_requests(self) -> None:
        while True:
            try:
                request = self._requests.get_nowait()
            except queue.Empty:
                return
            if self._stop_signal is not None or self._finishing:
                continue
            if request.get("generation") != self._generation:
                continue  # about a generation that has been replaced already
            self._collect_exits()  # deaths first: they may replace the generation
            if request.get("generation") != self._generation or self._stop_signal is not None:
                continue
            if not self._may_reset():
                continue
            self.message(
                f"worker {request.get('worker')} asked for a new generation "
                f"({request.get('reason', '')}); forming generation {self._generation + 1} "
                f"with the same {count_workers(len(self._members))}"
            )
            self._new_generation(self._members, 0, "asked for by a worker")

    # -- generations -----------------------------------------------------------

    def _spawn_all(self) -> None:
        if self._hosts is None:
            self._new_generation([], self._options.num_proc, "start")
        else:
            hosts = [p.host for p in self._hosts.placements]
            self._new_generation([], hosts, "start")

    def _new_generation(
        self, carried: list[Rank], added: int | list[str | None], reason: str
    ) -> None:
        """Start workers (`added`: how many here, or the host of each) and
        publish generation +1 = carried + started."""
        generation = self._generation + 1
        new_hosts = [None] * added if isinstance(added, int) else list(added)
        size = len(carried) + len(new_hosts)
        started: list[Rank] = []
        for index, host in enumerate(new_hosts):
            worker_id = self._next_worker_id
            self._next_worker_id += 1
            variables = rank_environment(len(carried) + index, size)
            if host is not None:
                on_host = [w for w in carried + started if w.host == host]
                variables.update(
                    CRING_LOCAL_RANK=str(len(on_host)),
                    CRING_LOCAL_SIZE=str(len(on_host) + new_hosts[index:].count(host)),
                    CRING_HOSTNAME=host,
                )
            variables.update(
                CRING_ELASTIC="1",
                CRING_ELASTIC_WORKER_ID=str(worker_id),
                CRING_ELASTIC_GENERATION=str(generation),
            )
            worker = self._spawn(worker_id, variables, host)
            if worker is None:
                self._begin_stop(signal.SIGTERM)
                return
            started.append(worker)
        members = carried + started
        record = protocol.make_record(
            generation, [w.rank for w in members], [w.rank for w in started], reason
        )
        try:
            self._store.set(self._keys.generation(generation), record)
            self._store.set(self._keys.latest, str(generation).encode())
        except (OSError, ConnectionError) as exc:
            self.message(f"cannot publish generation {generation} in the store: {exc}")
            if self._exit_code is None:
                self._exit_code = 1
            self._begin_stop(signal.SIGTERM)
            return
        if generation > 0:
            self._resets += 1
        self._generation = generation
        self._members = members
        self._added_now = started if generation > 0 else []
        if started and self._pump is not None:
            self._pump.add(self._streams(started))

    def _may_reset(self, *, fail: bool = True) -> bool:
        """Whether --reset-limit allows another generation; if not and `fail`,
        stop the job (exit code 1)."""
        limit = self._options.reset_limit
        if limit is None or self._resets < limit:
            return True
        if fail:
            self.message(
                f"the job has already formed {limit} new generations (--reset-limit "
                f"{limit}); stopping the job"
            )
            if self._exit_code is None:
                self._exit_code = 1
            self._begin_stop(signal.SIGTERM)
        return False

    def _wanted_workers(self) -> int:
        """Workers the discovery script asks for (0 without a script)."""
        slots = self._discovered_slots
        if slots is None:
            return 0
        limit = self._options.max_np
        return slots if limit is None else min(slots, limit)

    _discovered_slots: int | None = None

    # -- exits -------------------------------------------------------------------

    def _collect_exits(self) -> None:
        failed: list[Rank] = []
        finished: list[Rank] = []
        for worker in self._running():
            worker.status = exit_status_nowait(worker.process)
            if worker.status is not None:
                (finished if worker.status == 0 else failed).append(worker)
        if not failed and not finished:
            return
        if self._stop_signal is not None:  # already stopping: the first cause wins
            if failed and self._exit_code is None:
                self._exit_code = exit_code_of(failed[0].status or 0)
            return
        if finished and not self._finishing:
            self._finishing = True
            reason = (
                f"worker {finished[0].rank} has finished (exit code 0), so the job is ending; "
                "no new generation is formed"
            )
            try:
                self._store.set(
                    self._keys.generation(self._generation + 1),
                    protocol.make_final_record(self._generation + 1, reason),
                )
            except (OSError, ConnectionError):
                pass  # workers waiting for a generation then time out instead
            self._stop_unjoined_workers()
        for worker in finished:
            if worker in self._members:
                self._members.remove(worker)
        failed = [w for w in failed if w.rank not in self._abandoned]
        if not failed:
            return
        if self._finishing:
            first = failed[0]
            assert first.status is not None
            self._exit_code = exit_code_of(first.status)
            self._wait_for_output(failed)
            others = len(self._running())
            summary = f"worker {first.rank} {describe_status(first.status)} after another finished"
            if others:
                summary += f"; stopping the other {count_processes(others)}"
            self.message(summary)
            self._begin_stop(signal.SIGTERM)
            return
        self._reform(failed)

    def _stop_unjoined_workers(self) -> None:
        """When the job starts finishing: workers started for a generation that
        the others never formed (they finished first) would wait for them in
        vain; stop them, and do not count how they end."""
        added = [w for w in self._members if w in self._added_now and w.status is None]
        if not added:
            return
        try:
            formed = self._store.get(self._keys.formed(self._generation), 0.0) is not None
        except (OSError, ConnectionError):
            formed = False
        if formed:
            return
        self.message(
            f"stopping {count_workers(len(added))} ({', '.join(str(w.rank) for w in added)}) "
            f"started for generation {self._generation}, which the others finished without joining"
        )
        for worker in added:
            self._abandoned.add(worker.rank)
            self._members.remove(worker)
            signal_rank(worker, signal.SIGTERM)

    def _wait_for_output(self, workers: list[Rank]) -> None:
        if self._pump is not None:
            for worker in workers:
                self._pump.wait_closed(FAILED_RANK_OUTPUT_TIMEOUT_S, rank=worker.rank)

    # -- the blacklist -------------------------------------------------------------

    def _cooldown_s(self, place: str | None) -> float:
        """The cool-down after another failure at `place` (None: this host):
        Horovod's rule, MIN * 2**k + U(0, 1) * MIN seconds after the k-th
        failure there, kept within [MIN, MAX]; without a range, for good."""
        self._failures[place] = count = self._failures.get(place, 0) + 1
        cooldown = self._options.blacklist_cooldown_range
        if cooldown is None:
            return math.inf
        low, high = cooldown
        delay = low * 2.0 ** min(count, 30) + random.uniform(0.0, 1.0) * low
        return max(low, min(high, delay))

    def _blacklist(self, worker: Rank) -> None:
        """No new worker where `worker` failed until the cool-down ends."""
        remote = self._hosts is not None and not self._hosts.is_local(worker.host)
        if not remote and self._options.discovery_script is None:
            return  # nothing would start a worker on this host again anyway
        seconds = self._cooldown_s(worker.host if remote else None)
        until = time.monotonic() + seconds
        how_long = "for the rest of the job" if math.isinf(seconds) else f"for {seconds:.1f} s"
        if remote:
            assert worker.host is not None
            self._blocked_hosts[worker.host] = until
            where = f"{worker.host} gets no new workers"
        else:
            self._blocked_local.append(until)
            where = "its slot on this host gets no new worker"
        self.message(f"worker {worker.rank} failed: {where} {how_long} (blacklisted)")

    def _host_blocked(self, host: str) -> bool:
        return self._blocked_hosts.get(host, 0.0) > time.monotonic()

    def _local_slots_blocked(self) -> int:
        now = time.monotonic()
        self._blocked_local = [t for t in self._blocked_local if t > now]
        return len(self._blocked_local)

    def _reform(self, failed: list[Rank]) -> None:
        self._wait_for_output(failed)
        size = len(self._members)
        lost = []
        for worker in failed:
            assert worker.status is not None
            self._blacklist(worker)
            where = (
                f" (rank {self._members.index(worker)} of {size})"
                if worker in self._members
                else ""
            )
            lost.append(
                f"worker {worker.rank}{worker.where()}{where} {describe_status(worker.status)}"
            )
            if worker in self._members:
                self._members.remove(worker)
        carried = list(self._members)
        what = "; ".join(lost)
        if not carried:  # as Horovod: a generation that failed as a whole ends the job
            first = failed[0]
            assert first.status is not None
            self._exit_code = exit_code_of(first.status)
            self.message(
                f"{what}; every worker of generation {self._generation} has failed: "
                "stopping the job"
            )
            self._begin_stop(signal.SIGTERM)
            return
        added = self._additions(carried)
        total = len(carried) + len(added)
        if total < self._options.min_np:
            first = failed[0]
            assert first.status is not None
            self._exit_code = exit_code_of(first.status)
            self.message(
                f"{what}; {count_workers(total)} {'remains' if total == 1 else 'remain'}, "
                f"fewer than --min-np {self._options.min_np}: stopping the job"
            )
            self._begin_stop(signal.SIGTERM)
            return
        if not self._may_reset():
            return
        more = f" ({len(added)} new)" if added else ""
        self.message(
            f"{what}; continuing with {count_workers(total)}{more} as generation "
            f"{self._generation + 1}"
        )
        self._new_generation(carried, added, what)

    # -- discovery ---------------------------------------------------------------

    def _tick(self) -> float | None:
        self._handle_requests()
        script = self._options.discovery_script
        if script is None or self._finishing or self._stop_signal is not None:
            return None
        now = time.monotonic()
        if now >= self._next_discovery_s:
            self._discover(script)
            self._next_discovery_s = time.monotonic() + self._options.discovery_interval_s
            now = time.monotonic()
        return max(0.0, self._next_discovery_s - now)

    def _discovery_warning(self, problem: str | None) -> None:
        if problem is not None and problem != self._discovery_problem:
            self.message(f"warning: host discovery: {problem}")
        self._discovery_problem = problem

    def _discover(self, script: str) -> None:
        try:
            result = subprocess.run(
                [script],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=_DISCOVERY_TIMEOUT_S,
                check=False,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            self._discovery_warning(f"{script} failed: {exc}")
            return
        if result.returncode != 0:
            tail = result.stderr.decode(errors="replace").strip()[-500:]
            self._discovery_warning(f"{script} exited with code {result.returncode}: {tail}")
            return
        hosts, problems = parse_discovery(result.stdout.decode(errors="replace"))
        if self._hosts is not None:
            self._discovery_warning("; ".join(problems) or None)
            self._discover_hosts(hosts)
            return
        remote = sorted(h for h in hosts if not is_local(h, self._local_names))
        if remote:
            problems.append(
                f"cringrun starts workers on this host only; ignoring {', '.join(remote)}"
            )
        self._discovery_warning("; ".join(problems) or None)
        self._discovered_slots = sum(n for h, n in hosts.items() if is_local(h, self._local_names))
        added = len(self._additions(self._members))
        if added > 0 and not self._may_reset(fail=False):
            self._discovery_warning(
                f"not adding workers: --reset-limit {self._options.reset_limit} reached"
            )
        elif added > 0:
            self.message(
                f"host discovery: {self._discovered_slots} slots on this host; adding "
                f"{added} {'worker' if added == 1 else 'workers'} as generation "
                f"{self._generation + 1}"
            )
            self._new_generation(self._members, added, f"{added} added by host discovery")

    # -- discovery across hosts (-H/--hostfile) -----------------------------------

    def _additions(self, members: list[Rank]) -> list[str | None]:
        """Hosts of the workers to add to `members`: this host's free slots
        without -H; with it, every discovered host's free slots in the script's
        order; never a blacklisted remote host or slot of this host (until its
        cool-down ends); at most --max-np in all."""
        blocked_here = self._local_slots_blocked()
        if self._hosts is None:
            return [None] * max(0, self._wanted_workers() - len(members) - blocked_here)
        if self._discovered_hosts is None:
            return []
        room = None if self._options.max_np is None else self._options.max_np - len(members)
        hosts: list[str | None] = []
        for host, slots in self._discovered_hosts.items():
            if self._host_blocked(host):
                continue
            free = slots - sum(1 for w in members if w.host == host)
            if self._hosts.is_local(host):
                free, blocked_here = free - blocked_here, max(0, blocked_here - free)
            hosts.extend([host] * max(0, free))
        return hosts if room is None else hosts[: max(0, room)]

    def _discover_hosts(self, hosts: dict[str, int]) -> None:
        """Stop the workers of hosts gone from the script's output (or beyond
        their slots, newest first); add workers on free slots; one generation."""
        self._discovered_hosts = hosts
        removed: list[Rank] = []
        for host in dict.fromkeys(w.host for w in self._members):
            on_host = [w for w in self._members if w.host == host]
            excess = len(on_host) - hosts.get(str(host), 0)
            if excess > 0:
                removed.extend(on_host[-excess:])
        carried = [w for w in self._members if w not in removed]
        added = self._additions(carried)
        if not removed and not added:
            return
        total = len(carried) + len(added)
        if not self._may_reset(fail=False):
            self._discovery_warning(
                f"not changing workers: --reset-limit {self._options.reset_limit} reached"
            )
            return
        what = []
        if removed:
            gone = ", ".join(f"{w.rank} on {w.host}" for w in removed)
            what.append(f"stopping {count_workers(len(removed))} ({gone})")
        if added:
            what.append(f"adding {count_workers(len(added))} ({', '.join(map(str, added))})")
        if total < self._options.min_np:
            self.message(
                f"host discovery: {'; '.join(what)} would leave {count_workers(total)}, "
                f"fewer than --min-np {self._options.min_np}: stopping the job"
            )
            if self._exit_code is None:
                self._exit_code = 1
            self._begin_stop(signal.SIGTERM)
            return
        self.message(
            f"host discovery: {'; '.join(what)}; continuing with {count_workers(total)} as "
            f"generation {self._generation + 1}"
        )
        for worker in removed:
            self._abandoned.add(worker.rank)
        self._new_generation(carried, added, f"host discovery: {'; '.join(what)}")
        for worker in removed:  # after the survivors can read where to go
            signal_rank(worker, signal.SIGTERM)


def count_workers(count: int) -> str:
    return f"{count} worker" if count == 1 else f"{count} workers"

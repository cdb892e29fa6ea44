# cringrun's command line: the options, where the command starts, and the
# checks of option combinations (hosts and slots included). Parses only;
# starts nothing (--check-build and --version print their report and exit).
"""Command line of cringrun (see cring.launch for what the options do)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from .hosts import HostSlots, assign_ranks, parse_hostfile, parse_hosts
from .remote import RSH_ENV, parse_exports

PROG = "cringrun"
DEFAULT_GRACE_SECONDS = 5.0
DEFAULT_DISCOVERY_INTERVAL_S = 1.0
# --blacklist-cooldown-range bounds (Horovod's: 1 s to an hour)
COOLDOWN_MIN_S = 1.0
COOLDOWN_MAX_S = 3600.0

_USAGE = f"{PROG} -np N [options] [--] command [args ...]"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port 1..65535, got {text!r}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number of seconds >= 0, got {text!r}"
        ) from None
    if not value >= 0 or value == float("inf"):  # also rejects nan
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value


class _CheckBuildAction(argparse.Action):
    """-cb/--check-build: print what this install can do (cring.info) and exit 0,
    as horovodrun --check-build does; needs no -np or command."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # noqa: ANN001
        from cring.info import report  # only now: it loads NCCL and the CUDA runtime if it can

        print(report(), flush=True)
        parser.exit(0)


def _version() -> str:
    from cring._version import __version__

    return f"{PROG} (cring) {__version__}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        usage=_USAGE,
        description=(
            "Run N processes of a command as the ranks of one cring job, on this host "
            "or, with -H/--hostfile, on several hosts (over ssh)."
        ),
        epilog=(
            "Everything from the first non-option argument on (or after '--') is the "
            "command and its arguments. Each rank gets CRING_RANK, CRING_SIZE, "
            "CRING_LOCAL_RANK, CRING_LOCAL_SIZE, CRING_ADDR, CRING_PORT, CRING_SECRET, "
            "CRING_STORE_EXTERNAL and CRING_JOB_ID in its environment. Exit status: 0 when "
            "every rank exits 0, else the first failing rank's code (128+N for signal N), "
            "130/143 after SIGINT/SIGTERM, 2 for usage errors."
        ),
        # Abbreviations would make '--num 4' ambiguous with the start of the command.
        allow_abbrev=False,
    )
    parser.add_argument(
        "-np",
        "-n",
        "--num-proc",
        dest="num_proc",
        type=_positive_int,
        metavar="N",
        help="number of processes (ranks) to start, >= 1 (required)",
    )
    parser.add_argument(
        "-v", "--version", action="version", version=_version(), help="print cring's version"
    )
    parser.add_argument(
        "-cb",
        "--check-build",
        action=_CheckBuildAction,
        help=(
            "print what this install can do (version, frameworks, transports, kernels, "
            "NCCL and CUDA, known defects, knobs) and exit; also python -m cring.info"
        ),
    )
    parser.add_argument(
        "--no-prefix",
        action="store_true",
        help="relay output unchanged instead of prefixing each line with '[rank] '",
    )
    parser.add_argument(
        "--grace-seconds",
        type=_non_negative_float,
        default=DEFAULT_GRACE_SECONDS,
        metavar="S",
        help=(
            "seconds ranks get to exit after SIGTERM (or a forwarded signal) before "
            f"SIGKILL (default {DEFAULT_GRACE_SECONDS:g})"
        ),
    )
    hosts = parser.add_argument_group(
        "hosts",
        "Ranks fill the hosts' slots in order; ranks on this machine (localhost, its name "
        "or address) start directly, the others through the remote shell (docs/launcher.md).",
    )
    hosts.add_argument(
        "-H",
        "--hosts",
        metavar="HOSTS",
        help="hosts and their slots, 'hostA:4,hostB:4' (a host without ':N' has 1 slot)",
    )
    hosts.add_argument(
        "--hostfile",
        metavar="FILE",
        help="a file of 'host slots=N' (or 'host:N') lines; '#' starts a comment",
    )
    hosts.add_argument(
        "--rsh",
        metavar="COMMAND",
        help=(
            "remote-shell command that runs 'COMMAND HOST CMDLINE', e.g. "
            f'"ssh -o StrictHostKeyChecking=no" (default: ${RSH_ENV}, else '
            "'ssh -o BatchMode=yes')"
        ),
    )
    hosts.add_argument("--ssh-port", type=_port, metavar="PORT", help="ssh port (ssh -p)")
    hosts.add_argument("--ssh-identity-file", metavar="FILE", help="ssh private key file (ssh -i)")
    hosts.add_argument(
        "-x",
        "--env",
        dest="exports",
        action="append",
        default=[],
        metavar="VAR[=VALUE]",
        help=(
            "forward VAR (its value here, or VALUE) to every rank; remote ranks also get "
            "PATH, PYTHONPATH, LD_LIBRARY_PATH and every CRING_* variable (repeatable)"
        ),
    )
    address = hosts.add_mutually_exclusive_group()
    address.add_argument(
        "--network-interface",
        metavar="IFACE",
        help="serve the rendezvous store on this interface's IPv4 address",
    )
    address.add_argument(
        "--store-addr",
        metavar="ADDR",
        help=(
            "address the ranks reach the store on (default: this host's address on the "
            "route toward the first remote host)"
        ),
    )
    hosts.add_argument(
        "--remote-python",
        metavar="PATH",
        help="Python that runs cring's remote wrapper on other hosts (default: this one's)",
    )
    parser.add_argument(
        "--autotune",
        action="store_true",
        help="tune the fusion threshold and cycle time on the running job (CRING_AUTOTUNE=1)",
    )
    parser.add_argument(
        "--autotune-log-file",
        metavar="FILE",
        help="with --autotune: rank 0 writes one CSV row per trial here (CRING_AUTOTUNE_LOG)",
    )
    elastic = parser.add_argument_group(
        "elastic training",
        "With --elastic, a worker that fails does not end the job: the others form a new "
        "generation (new ranks and size) through the launcher's store and carry on "
        "(cring.elastic.run); see docs/elastic.md.",
    )
    elastic.add_argument(
        "--elastic",
        action="store_true",
        help="keep the job running when workers fail, as long as --min-np remain",
    )
    elastic.add_argument(
        "--min-np",
        type=_positive_int,
        metavar="M",
        help="fail the job when fewer than M workers remain (default: -np)",
    )
    elastic.add_argument(
        "--max-np",
        type=_positive_int,
        metavar="N",
        help="never run more than N workers (default: no limit beyond the discovery script)",
    )
    elastic.add_argument(
        "--host-discovery-script",
        metavar="SCRIPT",
        help=(
            "executable printing one 'host[:slots]' line per host; workers are added on "
            "free slots (only this host's, unless -H/--hostfile is given: then hosts are "
            "added and removed)"
        ),
    )
    elastic.add_argument(
        "--discovery-interval",
        type=_non_negative_float,
        default=DEFAULT_DISCOVERY_INTERVAL_S,
        metavar="S",
        help=(
            "seconds between runs of the discovery script "
            f"(default {DEFAULT_DISCOVERY_INTERVAL_S:g})"
        ),
    )
    elastic.add_argument(
        "--reset-limit",
        type=_non_negative_int,
        metavar="K",
        help="fail the job instead of forming generation K+1 (default: no limit)",
    )
    elastic.add_argument(
        "--blacklist-cooldown-range",
        type=float,
        nargs=2,
        metavar=("MIN", "MAX"),
        help=(
            "a host (with -H/--hostfile; else a slot of this host) where a worker failed gets "
            "no new worker for a cool-down between MIN and MAX seconds, growing with each "
            f"failure there ({COOLDOWN_MIN_S:g} <= MIN <= MAX <= {COOLDOWN_MAX_S:g}; "
            "default: for the rest of the job)"
        ),
    )
    timeline = parser.add_argument_group("timeline")
    timeline.add_argument(
        "--timeline-filename",
        metavar="FILE",
        help="rank 0 writes a Chrome-trace timeline in Horovod's layout here (CRING_TIMELINE)",
    )
    timeline.add_argument(
        "--timeline-mark-cycles",
        action="store_true",
        help="mark every negotiation cycle in the timeline (CRING_TIMELINE_MARK_CYCLES)",
    )
    return parser


# Launcher options that take a value as the next argument; used to find where
# the command starts without letting argparse look at the command's flags.
_OPTIONS_WITH_VALUE = frozenset(
    {
        "-np",
        "-n",
        "--num-proc",
        "--grace-seconds",
        "-H",
        "--hosts",
        "--hostfile",
        "--rsh",
        "--ssh-port",
        "--ssh-identity-file",
        "-x",
        "--env",
        "--network-interface",
        "--store-addr",
        "--remote-python",
        "--min-np",
        "--max-np",
        "--host-discovery-script",
        "--discovery-interval",
        "--reset-limit",
        "--autotune-log-file",
        "--timeline-filename",
    }
)
# ... and those that take two
_OPTIONS_WITH_TWO_VALUES = frozenset({"--blacklist-cooldown-range"})


def split_command(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split argv into (launcher arguments, command and its arguments).

    The command starts at '--' (which is dropped) or at the first argument that
    is neither an option nor the value of an option that takes one.
    """
    index = 0
    while index < len(argv):
        arg = argv[index]
        if arg == "--":
            return list(argv[:index]), list(argv[index + 1 :])
        if arg.startswith("-") and arg != "-":
            index += (
                2 if arg in _OPTIONS_WITH_VALUE else 3 if arg in _OPTIONS_WITH_TWO_VALUES else 1
            )
            continue
        return list(argv[:index]), list(argv[index:])
    return list(argv), []


@dataclass(frozen=True)
class Options:
    num_proc: int
    prefix_output: bool
    grace_seconds: float
    command: list[str]
    elastic: bool = False
    min_np: int = 1
    max_np: int | None = None
    discovery_script: str | None = None
    discovery_interval_s: float = DEFAULT_DISCOVERY_INTERVAL_S
    reset_limit: int | None = None
    # (MIN, MAX) seconds a failing host or slot gets no new worker; None: for good
    blacklist_cooldown_range: tuple[float, float] | None = None
    # Multi-host (None: every rank on this host, as without -H)
    hosts: tuple[HostSlots, ...] | None = None
    rsh: str | None = None
    ssh_port: int | None = None
    ssh_identity_file: str | None = None
    exports: tuple[tuple[str, str | None], ...] = field(default_factory=tuple)
    network_interface: str | None = None
    store_addr: str | None = None
    remote_python: str | None = None
    autotune: bool = False
    autotune_log_file: str | None = None
    timeline_filename: str | None = None
    timeline_mark_cycles: bool = False

    def rank_variables(self) -> dict[str, str]:
        """What the options add to every rank's environment."""
        env = {"CRING_AUTOTUNE": "1"} if self.autotune else {}
        if self.autotune_log_file is not None:
            env["CRING_AUTOTUNE_LOG"] = os.path.abspath(self.autotune_log_file)
        if self.timeline_filename is not None:
            env["CRING_TIMELINE"] = os.path.abspath(self.timeline_filename)
            if self.timeline_mark_cycles:
                env["CRING_TIMELINE_MARK_CYCLES"] = "1"
        return env


def parse_args(argv: Sequence[str]) -> Options:
    """Parse the command line; raises SystemExit for --help and usage errors."""
    parser = build_parser()
    launcher_args, command = split_command(argv)
    namespace = parser.parse_args(launcher_args)
    hosts = None
    try:
        if namespace.hosts is not None and namespace.hostfile is not None:
            parser.error("give -H or --hostfile, not both")
        if namespace.hosts is not None:
            hosts = tuple(parse_hosts(namespace.hosts))
        elif namespace.hostfile is not None:
            hosts = tuple(parse_hostfile(namespace.hostfile))
        exports = tuple(parse_exports(namespace.exports))
    except ValueError as exc:
        parser.error(str(exc))
    if namespace.num_proc is None and hosts is not None:
        namespace.num_proc = sum(h.slots for h in hosts)
    if namespace.num_proc is None:
        parser.error("the number of processes is required: -np N")
    if hosts is not None:
        try:
            assign_ranks(hosts, namespace.num_proc)
        except ValueError as exc:
            parser.error(str(exc))
    if not command:
        parser.error("missing the command to run after the options")
    elastic_only = {
        "--min-np": namespace.min_np,
        "--max-np": namespace.max_np,
        "--host-discovery-script": namespace.host_discovery_script,
        "--reset-limit": namespace.reset_limit,
        "--blacklist-cooldown-range": namespace.blacklist_cooldown_range,
    }
    if namespace.discovery_interval != DEFAULT_DISCOVERY_INTERVAL_S:
        elastic_only["--discovery-interval"] = namespace.discovery_interval
    if not namespace.elastic:
        for option, value in elastic_only.items():
            if value is not None:
                parser.error(f"{option} needs --elastic")
    min_np = namespace.num_proc if namespace.min_np is None else namespace.min_np
    if min_np > namespace.num_proc:
        parser.error(f"--min-np {min_np} is more than -np {namespace.num_proc}")
    if namespace.max_np is not None and namespace.max_np < namespace.num_proc:
        parser.error(f"--max-np {namespace.max_np} is less than -np {namespace.num_proc}")
    if namespace.autotune_log_file is not None and not namespace.autotune:
        parser.error("--autotune-log-file needs --autotune")
    if namespace.timeline_mark_cycles and namespace.timeline_filename is None:
        parser.error("--timeline-mark-cycles needs --timeline-filename")
    cooldown = namespace.blacklist_cooldown_range
    if cooldown is not None:
        low, high = cooldown
        if not COOLDOWN_MIN_S <= low <= high <= COOLDOWN_MAX_S:
            parser.error(
                f"--blacklist-cooldown-range {low:g} {high:g}: expected "
                f"{COOLDOWN_MIN_S:g} <= MIN <= MAX <= {COOLDOWN_MAX_S:g} seconds"
            )
        cooldown = (low, high)
    script = namespace.host_discovery_script
    if script is not None and not (os.path.isfile(script) and os.access(script, os.X_OK)):
        parser.error(f"--host-discovery-script {script!r} is not an executable file")
    return Options(
        num_proc=namespace.num_proc,
        prefix_output=not namespace.no_prefix,
        grace_seconds=namespace.grace_seconds,
        command=command,
        elastic=namespace.elastic,
        min_np=min_np,
        max_np=namespace.max_np,
        discovery_script=script,
        discovery_interval_s=namespace.discovery_interval,
        reset_limit=namespace.reset_limit,
        blacklist_cooldown_range=cooldown,
        hosts=hosts,
        rsh=namespace.rsh,
        ssh_port=namespace.ssh_port,
        ssh_identity_file=namespace.ssh_identity_file,
        exports=exports,
        network_interface=namespace.network_interface,
        store_addr=namespace.store_addr,
        remote_python=namespace.remote_python,
        autotune=namespace.autotune,
        autotune_log_file=namespace.autotune_log_file,
        timeline_filename=namespace.timeline_filename,
        timeline_mark_cycles=namespace.timeline_mark_cycles,
    )

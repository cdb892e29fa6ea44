# cringrun's hosts: parses -H and --hostfile, assigns ranks to host slots in
# Horovod's order, tells this machine's names from remote ones and picks the
# store's address. Pure functions over strings and sockets; starts nothing.
"""Hosts and slots of a multi-host cringrun job."""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# Any port will do: a UDP connect() sends nothing, it only asks for a route.
_ROUTE_PROBE_PORT = 9
# An address of TEST-NET-1 (RFC 5737): the route toward it is the default route.
_DEFAULT_ROUTE_PROBE = "192.0.2.1"
_SIOCGIFADDR = 0x8915


@dataclass(frozen=True)
class HostSlots:
    """A host of the job and how many ranks it may run."""

    name: str
    slots: int


@dataclass(frozen=True)
class Placement:
    """Where one rank runs and its place among the ranks of its host (Horovod's
    meaning: cross_rank/cross_size count the hosts that have this local rank)."""

    rank: int
    host: str
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    host_index: int  # among the hosts that run ranks


def _slots_of(text: str, where: str) -> int:
    try:
        slots = int(text)
    except ValueError:
        raise ValueError(f"{where}: slots must be an integer >= 1, got {text!r}") from None
    if slots < 1:
        raise ValueError(f"{where}: slots must be an integer >= 1, got {slots}")
    return slots


def _check_name(name: str, where: str) -> str:
    if not name or any(c.isspace() for c in name) or name.startswith("-"):
        raise ValueError(f"{where}: {name!r} is not a host name")
    return name


def _merge(entries: Iterable[tuple[str, int, str]]) -> list[HostSlots]:
    hosts: list[HostSlots] = []
    seen: dict[str, str] = {}
    for name, slots, where in entries:
        if name in seen:
            raise ValueError(f"{where}: host {name!r} is listed twice (first at {seen[name]})")
        seen[name] = where
        hosts.append(HostSlots(name, slots))
    if not hosts:
        raise ValueError("no hosts given")
    return hosts


def parse_hosts(text: str) -> list[HostSlots]:
    """-H 'hostA:4,hostB:4' (a host without ':N' has 1 slot)."""
    entries = []
    for item in text.split(","):
        item = item.strip()
        where = f"-H {text!r}"
        if not item:
            raise ValueError(f"{where}: empty host entry")
        name, sep, slots_text = item.rpartition(":")
        if not sep or item.endswith("]"):  # no slots ('[::1]' too)
            name, slots_text = item, "1"
        if name.startswith("[") and name.endswith("]"):  # an IPv6 address
            name = name[1:-1]
        entries.append((_check_name(name, where), _slots_of(slots_text, where), item))
    return _merge(entries)


def parse_hostfile_text(text: str, path: str = "hostfile") -> list[HostSlots]:
    """Lines 'host slots=N', 'host:N' or 'host' (1 slot); '#' starts a comment."""
    entries = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{path}:{number}"
        fields = line.split()
        name, slots = fields[0], None
        if len(fields) == 1 and ":" in name:
            name, _, slots_text = name.rpartition(":")
            slots = _slots_of(slots_text, where)
        for field in fields[1:]:
            key, sep, value = field.partition("=")
            if key in ("slots", "max_slots", "max-slots") and sep:
                if key == "slots":
                    slots = _slots_of(value, where)
            else:
                raise ValueError(f"{where}: expected 'host slots=N' or 'host:N', got {line!r}")
        entries.append((_check_name(name, where), 1 if slots is None else slots, where))
    if not entries:
        raise ValueError(f"{path}: no hosts in the hostfile")
    return _merge(entries)


def parse_hostfile(path: str) -> list[HostSlots]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ValueError(f"cannot read the hostfile {path!r}: {exc.strerror or exc}") from None
    return parse_hostfile_text(text, path)


def assign_ranks(hosts: Sequence[HostSlots], num_proc: int) -> list[Placement]:
    """Ranks 0..num_proc-1 fill the hosts' slots in order (hostA's first)."""
    total = sum(h.slots for h in hosts)
    if num_proc > total:
        listed = ", ".join(f"{h.name}:{h.slots}" for h in hosts)
        raise ValueError(f"-np {num_proc} is more than the {total} slots of the hosts ({listed})")
    used: list[tuple[str, int]] = []  # (host, ranks on it), in host order
    left = num_proc
    for host in hosts:
        if left == 0:
            break
        count = min(host.slots, left)
        used.append((host.name, count))
        left -= count
    placements = []
    rank = 0
    for index, (name, count) in enumerate(used):
        for local_rank in range(count):
            # Hosts before this one that also have `local_rank`, and all of them.
            cross_rank = sum(1 for _, n in used[:index] if n > local_rank)
            cross_size = sum(1 for _, n in used if n > local_rank)
            placements.append(
                Placement(rank, name, local_rank, count, cross_rank, cross_size, index)
            )
            rank += 1
    return placements


def local_host_names() -> frozenset[str]:
    """Names (lower case) that mean this machine: no ssh is needed to reach them."""
    names = {"localhost", "127.0.0.1", "::1", "localhost.localdomain"}
    for name in (socket.gethostname(), socket.getfqdn()):
        if name:
            names.add(name.lower())
            names.add(name.split(".")[0].lower())
    return frozenset(names)


def is_local(host: str, names: frozenset[str] | None = None) -> bool:
    host = host.lower()
    if host in (names if names is not None else local_host_names()):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def interface_address(interface: str) -> str:
    """The IPv4 address of a network interface (ValueError if it has none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            request = struct.pack("256s", interface.encode()[:15])
            answer = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
        except OSError as exc:
            raise ValueError(
                f"--network-interface {interface!r}: no IPv4 address ({exc.strerror or exc})"
            ) from None
    return socket.inet_ntoa(answer[20:24])


def _source_address_toward(address: str) -> str | None:
    try:
        infos = socket.getaddrinfo(address, _ROUTE_PROBE_PORT, socket.AF_INET, socket.SOCK_DGRAM)
    except (OSError, UnicodeError):
        return None
    for family, kind, proto, _, target in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.connect(target)
                return str(probe.getsockname()[0])
        except OSError:
            continue
    return None


def store_address(remote_hosts: Sequence[str]) -> str:
    """Default address of the store: this machine's address on the route toward
    the first remote host that resolves here; else on the default route; else
    127.0.0.1 (no remote host: the ranks are all here)."""
    if not remote_hosts:
        return "127.0.0.1"
    for host in remote_hosts:
        source = _source_address_toward(host)
        if source is not None:
            return source
    return _source_address_toward(_DEFAULT_ROUTE_PROBE) or "127.0.0.1"

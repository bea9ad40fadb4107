"""The simulated cluster's layout, as data: namespaces, links, addresses and the ``ip``/``tc``
command lines that build it. Nothing here runs a command, so the plan is checked without root.

One bridge lives in its own namespace (so nothing touches the machine's own network); every task
gets a namespace joined to it by a veth pair. Each pair is rate-limited on both ends (a tbf on the
task's ``eth0`` shapes what the task sends, one on the bridge's end shapes what it receives), which
makes each task's link a full-duplex NIC of the chosen rate, as between hosts.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass

from ...errors import InvalidArgument

__all__ = ["FAMILY", "Host", "Topology", "new_prefix", "tbf_args"]

FAMILY = "zfc"  # every run's namespaces are named "<family>-<run id>-<host>"; --cleanup removes the family's
SUBNET = "10.213.0"  # a /24 that exists only inside the run's namespaces
PORT = 7000  # every task has its own address, so one port serves for all
_NAME = re.compile(r"[a-z][a-z0-9]{0,7}")


def new_prefix(family: str = FAMILY) -> str:
    """A per-run prefix, ``zfc-3fa91c``: unique, so runs side by side never share a namespace."""
    if not _NAME.fullmatch(family):
        raise InvalidArgument(f"namespace family {family!r} must be 1-8 lowercase letters and digits, starting with a letter")
    return f"{family}-{secrets.token_hex(3)}"


def tbf_args(rate_bits: float) -> list[str]:
    """``tc`` arguments of a token bucket at ``rate_bits`` bit/s. The bucket holds 1 ms of traffic
    (at least 256 KiB, so a 64 KiB GSO packet always fits) and the queue 20 ms."""
    if rate_bits <= 0:
        raise InvalidArgument(f"link rate must be positive, got {rate_bits} bit/s")
    burst = max(256 * 1024, int(rate_bits / 8 * 0.001))
    return ["tbf", "rate", f"{int(rate_bits)}bit", "burst", str(burst), "latency", "20ms"]


@dataclass(frozen=True)
class Host:
    """One task's simulated machine: its namespace, the bridge's end of its link, its address."""

    label: str  # "ps0", "w1": also the name of the bridge's end of its veth
    ns: str
    ip: str


@dataclass(frozen=True)
class Topology:
    """``ps`` parameter-server hosts and ``workers`` worker hosts on one bridge, named by ``prefix``."""

    prefix: str
    ps: tuple[Host, ...]
    workers: tuple[Host, ...]

    @classmethod
    def make(cls, prefix: str, ps: int, workers: int) -> Topology:
        if not 1 <= ps <= 50 or not 1 <= workers <= 50:
            raise InvalidArgument(f"a simulated cluster holds 1-50 ps and 1-50 workers, got {ps} and {workers}")
        return cls(
            prefix,
            tuple(Host(f"ps{i}", f"{prefix}-ps{i}", f"{SUBNET}.{10 + i}") for i in range(ps)),
            tuple(Host(f"w{i}", f"{prefix}-w{i}", f"{SUBNET}.{100 + i}") for i in range(workers)),
        )

    @property
    def bridge_ns(self) -> str:
        return f"{self.prefix}-br"

    @property
    def hosts(self) -> tuple[Host, ...]:
        return self.ps + self.workers

    def namespaces(self) -> list[str]:
        """Every namespace of the run, the bridge's first (created first, deleted last)."""
        return [self.bridge_ns] + [h.ns for h in self.hosts]

    def setup_commands(self, ip: str = "ip") -> list[list[str]]:
        """The ``ip`` command lines that build the topology, in order. The veth pairs are made
        inside the bridge's namespace with the far end put straight into the task's, so nothing
        ever appears in the machine's own namespace."""
        br = self.bridge_ns
        cmds = [[ip, "netns", "add", ns] for ns in self.namespaces()]
        cmds += [[ip, "-n", br, "link", "add", "name", "br0", "type", "bridge"],
                 [ip, "-n", br, "link", "set", "br0", "up"]]
        for h in self.hosts:
            cmds += [
                [ip, "-n", br, "link", "add", "name", h.label, "type", "veth", "peer", "name", "eth0", "netns", h.ns],
                [ip, "-n", br, "link", "set", h.label, "master", "br0"],
                [ip, "-n", br, "link", "set", h.label, "up"],
                [ip, "-n", h.ns, "addr", "add", f"{h.ip}/24", "dev", "eth0"],
                [ip, "-n", h.ns, "link", "set", "eth0", "up"],
                [ip, "-n", h.ns, "link", "set", "lo", "up"],
            ]
        return cmds

    def rate_commands(self, rate_bits: float, tc: str = "tc") -> list[list[str]]:
        """The ``tc`` command lines that limit every link to ``rate_bits`` bit/s each way."""
        shape = tbf_args(rate_bits)
        cmds = []
        for h in self.hosts:
            cmds.append([tc, "-n", h.ns, "qdisc", "replace", "dev", "eth0", "root", *shape])  # what it sends
            cmds.append([tc, "-n", self.bridge_ns, "qdisc", "replace", "dev", h.label, "root", *shape])  # what it gets
        return cmds

    def exec_prefix(self, host: Host, ip: str = "ip") -> list[str]:
        """Run a command on ``host``: ``ip netns exec NS``."""
        return [ip, "netns", "exec", host.ns]

    def cluster(self, ps: int) -> dict[str, list[str]]:
        """The cluster spec of the first ``ps`` ps hosts (workers are clients, not tasks)."""
        if not 1 <= ps <= len(self.ps):
            raise InvalidArgument(f"the topology has {len(self.ps)} ps hosts, asked for {ps}")
        return {"ps": [f"{h.ip}:{PORT}" for h in self.ps[:ps]]}

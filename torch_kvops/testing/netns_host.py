"""An emulated second host for fault tests (needs root, ``ip`` and ``tc``): a network
namespace joined to this one by a veth pair, each side with an address from
198.18.0.0/15 (reserved for network tests). A consumer process enters it
(:func:`enter`, before it opens any socket) and is then reached only across the
pair, which :meth:`NetnsHost.partition` cuts (every packet dropped both ways, the way
a failed switch or a firewall does: no reset, connections hang) and
:meth:`NetnsHost.heal` restores. On close the processes still inside are ended and
namespace and pair removed (emulated_link.py's tools: the same bounded commands and
clear errors).

Packets are dropped by a ``tc tbf`` bucket too small for any packet: ``netem`` is
missing from some kernels (this project's CI machine among them).
"""
from __future__ import annotations

import ctypes
import os

from typing import Optional

from ..emulated_link import (LinkError, check_prerequisites, remove_namespace,
                             remove_stale_namespaces, run_tool)

_CLONE_NEWNET = 0x40000000
_DROP_ALL = ["tbf", "rate", "8bit", "burst", "1", "limit", "1"]


class NetnsHost:
    """Namespace ``kvops-host-<pid>-<index>`` at ``address`` (198.18.<200+index>.2),
    reached from this namespace's ``198.18.<200+index>.1``."""

    def __init__(self, index: int = 0) -> None:
        if not 0 <= index < 50:
            raise ValueError("index must be in [0, 50)")
        self.name = f"kvops-host-{os.getpid()}-{index}"
        self._outside = f"kvh{os.getpid() % 10000}x{index}"
        net = f"198.18.{200 + index}"
        self.address, self.gateway = f"{net}.2", f"{net}.1"
        self._classes = False  # hold_back's classes are in place
        check_prerequisites()  # root, ip and tc: a clear error, never a fallback
        remove_stale_namespaces()  # a killed run's host would hold this address
        holder = _interface_with(self.gateway)
        if holder is not None:
            raise LinkError(f"{self.gateway} is already on interface {holder}: another live "
                            f"NetnsHost(index={index}) (its traffic would go there)")
        run_tool(["ip", "netns", "add", self.name])
        try:
            run_tool(["ip", "link", "add", self._outside, "type", "veth", "peer", "name", "eth0", "netns", self.name])
            run_tool(["ip", "addr", "add", f"{self.gateway}/30", "dev", self._outside])
            run_tool(["ip", "link", "set", self._outside, "up"])
            run_tool(["ip", "-n", self.name, "addr", "add", f"{self.address}/30", "dev", "eth0"])
            run_tool(["ip", "-n", self.name, "link", "set", "eth0", "up"])
            run_tool(["ip", "-n", self.name, "link", "set", "lo", "up"])
        except BaseException:
            self.close()
            raise

    def partition(self) -> None:
        """Drop every packet across the pair, both ways."""
        run_tool(["tc", "qdisc", "replace", "dev", self._outside, "root", *_DROP_ALL])
        run_tool(["tc", "-n", self.name, "qdisc", "replace", "dev", "eth0", "root", *_DROP_ALL])

    def drop_inbound(self) -> None:
        """Drop every packet sent to the namespace (a host that drops what it gets)."""
        run_tool(["tc", "qdisc", "replace", "dev", self._outside, "root", *_DROP_ALL])

    def limit_rate(self, bit_s: int) -> None:
        """Shape what is sent to the namespace to ``bit_s`` (a slow host, or a slow
        path to it): a token bucket of 16 KiB, so the rate holds from the first bytes."""
        run_tool(["tc", "qdisc", "replace", "dev", self._outside, "root", "tbf", "rate",
                  f"{int(bit_s)}bit", "burst", str(16 << 10), "latency", "2s"])

    def hold_back(self, match: str, ports) -> None:
        """Drop the TCP packets sent to the namespace whose ``match`` port (``"dport"``
        or ``"sport"``) is one of ``ports``, and pass the rest: one connection (a
        Mooncake lane) stalls while the others between the same hosts move. Replaces
        what an earlier call held back; :meth:`heal` ends it."""
        if match not in ("dport", "sport"):
            raise ValueError(f"match must be 'dport' or 'sport', got {match!r}")
        dev = self._outside
        if not self._classes:  # once: replacing them would let held packets through meanwhile
            run_tool(["tc", "qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", "10"])
            for classid in ("1:10", "1:20"):  # 1:10 passes, 1:20 drops (its bucket takes no packet)
                run_tool(["tc", "class", "add", "dev", dev, "parent", "1:", "classid", classid,
                          "htb", "rate", "10gbit"])
            run_tool(["tc", "qdisc", "add", "dev", dev, "parent", "1:20", "handle", "20:", *_DROP_ALL])
            self._classes = True
        else:
            run_tool(["tc", "filter", "del", "dev", dev, "parent", "1:"])
        for port in ports:
            run_tool(["tc", "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1",
                      "u32", "match", "ip", match, str(int(port)), "0xffff", "flowid", "1:20"])

    def heal(self) -> None:
        self._classes = False
        run_tool(["tc", "qdisc", "del", "dev", self._outside, "root"], check=False)
        run_tool(["tc", "-n", self.name, "qdisc", "del", "dev", "eth0", "root"], check=False)

    def close(self) -> None:
        """End the processes still inside, remove the pair and the namespace
        (``LinkError`` if it stays)."""
        run_tool(["ip", "link", "del", self._outside], check=False)
        remove_namespace(self.name)

    def __enter__(self) -> "NetnsHost":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _interface_with(address: str) -> Optional[str]:
    """The interface of this namespace that holds IPv4 ``address``, if any."""
    for line in run_tool(["ip", "-br", "-4", "addr", "show"]).stdout.splitlines():
        name, _state, *addresses = line.split()
        if any(a.split("/")[0] == address for a in addresses):
            return name.split("@")[0]
    return None


def enter(name: str) -> None:
    """Move the calling thread (and the threads it starts later) into namespace
    ``name``: call it first thing in a child process, before any socket is opened."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns into {name}: {os.strerror(errno)}")
    finally:
        os.close(fd)

"""Emulated hosts for deployment tests (needs root and ``ip``): one network namespace per
host, each with its own address from 198.18.0.0/15 (reserved for network tests) on an
``eth0`` that a veth pair joins to a bridge in a further namespace, the switch. Each host
has loopback up and a default route out of ``eth0``, so an engine that picks "the
interface that routes out" (addresses.py) finds its host address, as on a real host;
nothing leaves the switch. On close the processes still inside are ended and every
namespace removed (the pairs go with them).

    with EmulatedHosts(["prefill", "decode", "client"]) as hosts:
        hosts.address("decode")                      # "198.18.10.2"
        hosts.namespace("decode")                    # for `ip netns exec`
"""
from __future__ import annotations

import os
from typing import Dict, List, Sequence

from ..emulated_link import (check_prerequisites, remove_namespace, remove_stale_namespaces,
                             run_tool)

__all__ = ["EmulatedHosts"]

_SUBNET = "198.18.10"


class EmulatedHosts:
    """Hosts ``names`` at 198.18.10.1, .2, ... on one switch."""

    def __init__(self, names: Sequence[str]) -> None:
        if not 1 <= len(names) <= 50 or len(set(names)) != len(names):
            raise ValueError("1 to 50 distinct host names")
        check_prerequisites()  # root and ip: a clear error, never a fallback
        remove_stale_namespaces()  # a killed run's hosts and switch
        tag = f"{os.getpid()}"
        self._switch = f"kvops-switch-{tag}"
        self._hosts: Dict[str, str] = {name: f"kvops-host-{tag}-{name}" for name in names}
        self._addresses = {name: f"{_SUBNET}.{i + 1}" for i, name in enumerate(names)}
        self._made: List[str] = []
        try:
            self._add_namespace(self._switch)
            run_tool(["ip", "-n", self._switch, "link", "add", "br0", "type", "bridge"])
            run_tool(["ip", "-n", self._switch, "link", "set", "br0", "up"])
            for i, name in enumerate(names):
                self._add_host(i, name)
        except BaseException:
            self.close()
            raise

    def _add_namespace(self, ns: str) -> None:
        run_tool(["ip", "netns", "add", ns])
        self._made.append(ns)

    def _add_host(self, index: int, name: str) -> None:
        ns, port = self._hosts[name], f"kvp{os.getpid() % 100000}x{index}"
        self._add_namespace(ns)
        run_tool(["ip", "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns])
        run_tool(["ip", "link", "set", port, "netns", self._switch])
        run_tool(["ip", "-n", self._switch, "link", "set", port, "master", "br0"])
        run_tool(["ip", "-n", self._switch, "link", "set", port, "up"])
        run_tool(["ip", "-n", ns, "addr", "add", f"{self._addresses[name]}/24", "dev", "eth0"])
        run_tool(["ip", "-n", ns, "link", "set", "eth0", "up"])
        run_tool(["ip", "-n", ns, "link", "set", "lo", "up"])
        run_tool(["ip", "-n", ns, "route", "add", "default", "dev", "eth0"])

    def address(self, name: str) -> str:
        return self._addresses[name]

    def namespace(self, name: str) -> str:
        return self._hosts[name]

    def close(self) -> None:
        """End what runs inside and remove every namespace (``LinkError`` if one stays)."""
        errors = []
        for ns in reversed(self._made):
            try:
                remove_namespace(ns)
            except Exception as exc:  # noqa: BLE001 - try every namespace, then raise the first
                errors.append(exc)
        self._made.clear()
        if errors:
            raise errors[0]

    def __enter__(self) -> "EmulatedHosts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

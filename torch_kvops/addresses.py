"""Which address an engine binds and which it tells its peers, the way vLLM picks them.

An engine on three hosts must not need address settings: its address defaults to
``$VLLM_HOST_IP``, else the source address of the route out of this host (what vLLM's
``get_ip()`` uses). A configured address is used as given; an unspecified one
(``0.0.0.0``, ``::``) is bound but never advertised: peers are told the host's address.
"""
from __future__ import annotations

import ipaddress
import logging
import os
import socket
from dataclasses import dataclass
from typing import Optional

__all__ = ["HOST_IP_ENV", "Endpoint", "endpoint", "host_address", "is_loopback", "routed_address"]

log = logging.getLogger(__name__)

HOST_IP_ENV = "VLLM_HOST_IP"
# Never contacted: connecting a UDP socket only asks the kernel for the route's source.
_PROBES = ((socket.AF_INET, "198.51.100.1"), (socket.AF_INET6, "2001:db8::1"))


def routed_address() -> Optional[str]:
    """The source address of this host's route out (IPv4 first), None without a route."""
    for family, probe in _PROBES:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((probe, 9))
                address = s.getsockname()[0]
        except OSError:
            continue
        if not ipaddress.ip_address(address).is_unspecified:
            return address
    return None


def host_address() -> str:
    """``$VLLM_HOST_IP``, else :func:`routed_address`, else loopback (a host without a
    route out can only serve itself; logged)."""
    configured = os.environ.get(HOST_IP_ENV, "").strip()
    if configured:
        return configured
    address = routed_address()
    if address is None:
        log.warning("kvops: this host has no route out and $%s is not set: using 127.0.0.1 "
                    "(peers on other hosts cannot reach this engine)", HOST_IP_ENV)
        return "127.0.0.1"
    return address


def _is_unspecified(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` names is a loopback address (names are resolved)."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback
                               for info in infos)


@dataclass(frozen=True)
class Endpoint:
    """``bind``: the address to listen on; ``advertise``: the one peers are told."""

    bind: str
    advertise: str

    @property
    def loopback_only(self) -> bool:
        """Reachable from this host alone."""
        return is_loopback(self.bind) and is_loopback(self.advertise)


def endpoint(configured: str) -> Endpoint:
    """The endpoint of a configured address: empty is the host's address
    (:func:`host_address`), unspecified is bound as is and advertised as the host's."""
    configured = (configured or "").strip()
    if not configured:
        address = host_address()
        return Endpoint(address, address)
    if _is_unspecified(configured):
        return Endpoint(configured, host_address())
    return Endpoint(configured, configured)

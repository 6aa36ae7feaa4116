"""Free local ports for the servers and front ends the harness starts."""
from __future__ import annotations

import os
import random
import re
import socket
import threading
from typing import Iterable, Optional, Set, Tuple

_FIRST = 20000  # below: well-known and registered services, ports engines pick (vLLM kv_port 14579)

# Every port handed out by this process: two servers started together (a fleet's
# proxies) are each given a port free at that moment, and without this record the same
# one twice (seen: two proxies on one port, the second dying at bind while /health
# answered from the first).
_HANDED_OUT: set = set()
_LOCK = threading.Lock()


def _ephemeral_low() -> int:
    """The first port the kernel hands out for port 0 (Linux: ip_local_port_range)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _drawn_range() -> Tuple[int, int]:
    """[first, end) of the ports :func:`free_port` draws from: below the ephemeral range,
    or part ``i`` of ``n`` of it with ``KVOPS_PORT_PART=i/n`` (processes that start
    servers side by side, as the test suite's workers, each take their own part)."""
    first, end = _FIRST, _ephemeral_low()
    part = os.environ.get("KVOPS_PORT_PART")
    if part:
        match = re.fullmatch(r"(\d+)/(\d+)", part)
        if not match or int(match[1]) >= int(match[2]):
            raise ValueError(f"KVOPS_PORT_PART={part!r}: expected i/n with 0 <= i < n")
        index, parts = int(match[1]), int(match[2])
        size = (end - first) // parts
        first, end = first + index * size, first + (index + 1) * size
    return first, end


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now, below the kernel's ephemeral range: a port picked
    here is bound later by the server it is for, and a port from the ephemeral range
    may meanwhile be handed to any process binding port 0 (seen: a vLLM engine's
    bootstrap endpoint failing with "Address already in use" as its fleet started).
    Never the same port twice in one process. Another process's explicit bind can still
    take it: a server's readiness check asks who listens (``Server.wait_ready``)."""
    first, end = _drawn_range()
    rng = random.SystemRandom()
    with _LOCK:
        for _ in range(200):
            port = rng.randrange(first, end) if end > first + 1000 else 0
            if port in _HANDED_OUT:
                continue
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                port = s.getsockname()[1]
            if port not in _HANDED_OUT:
                _HANDED_OUT.add(port)
                return port
        raise OSError(f"no free port on {host} in 200 tries")


def _listening_inodes(pid: int, port: int) -> Set[str]:
    """Inodes of the TCP sockets listening on ``port`` in ``pid``'s network namespace."""
    found = set()
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                next(f)  # the header
                for line in f:
                    fields = line.split()
                    # local address HEX_IP:HEX_PORT, state 0A is LISTEN, inode is field 9
                    if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                        found.add(fields[9])
        except (FileNotFoundError, ProcessLookupError, StopIteration):
            continue
    return found


def listens_on(pids: Set[int], port: int) -> bool:
    """Whether one of ``pids`` holds a socket listening on ``port`` (in its own network
    namespace), so that an answer on that port comes from them and not from another
    server that took the port first."""
    for pid in pids:
        wanted = {f"socket:[{inode}]" for inode in _listening_inodes(pid, port)}
        if not wanted:
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in wanted:
                    return True
            except OSError:
                continue  # the fd closed while we looked
    return False


def taken_in_log(log_path: str, offset: int, ports: Iterable[int]) -> Tuple[Optional[int], int]:
    """(the first of ``ports`` that a server's log, read from byte ``offset`` to its last
    whole line, says another process holds: "address already in use" with that port on
    the line, or None; the offset to read from next). A server may log that and stay up
    without its HTTP server (seen: SGLang's prefill server, while the harness waited out
    its 600 s), so readiness reads the log as well as /health."""
    wanted = {int(p) for p in ports if p}
    try:
        with open(log_path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return None, offset
    whole = data[:data.rfind(b"\n") + 1]  # a line still being written is read next time
    for line in whole.decode(errors="replace").splitlines():
        if "already in use" in line.lower():
            for number in re.findall(r"\d+", line):
                if int(number) in wanted:
                    return int(number), offset + len(whole)
    return None, offset + len(whole)

"""An emulated network link for benchmarks and examples: a Linux network namespace whose
loopback is shaped by ``tc`` (token bucket ``tbf`` for the rate; ``netem`` for a
one-way delay where the kernel has it).

Processes started inside the namespace (``ip netns exec NS ...``) see a loopback of
their own, so every byte between a prefill and a decode engine started there (Mooncake
data, the control channel, vLLM's side channel) crosses the shaped link. The namespace
has a name unique to the run and is removed on every exit path: normal return,
exception, SIGINT, SIGTERM and SIGHUP (the processes still inside are ended first). A
SIGKILL cannot be caught; the next :class:`EmulatedLink` removes namespaces whose
creating process is gone.

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and the ``ip`` and ``tc`` commands
(iproute2): without them :class:`LinkError` says so before anything runs, and callers
never fall back to plain loopback.

Limits: loopback has one queue for both directions (acknowledgements and reverse
control traffic queue with the data, unlike a full-duplex NIC); ``DELAY`` needs the
``sch_netem`` qdisc, which some kernels (this project's CI machine among them) lack:
then asking for a delay is refused.

    with EmulatedLink(LinkSpec.parse("1gbit")) as link:
        link.run([sys.executable, "script.py"], timeout=600)   # a CompletedProcess
"""
from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

log = logging.getLogger(__name__)

ENV_NAME = "KVOPS_LINK_NS"  # set for processes started inside the namespace
ENV_SPEC = "KVOPS_LINK_SPEC"
NAME_PREFIX = "kvops-link-"
_NAME = re.compile(rf"^{NAME_PREFIX}(\d+)-[0-9a-f]+$")
# Every namespace this project makes is named kvops-<kind>-<creator pid>[-<tag>]: links
# here, hosts and switches in testing/ (netns_host.py, emulated_hosts.py).
_OWNED_NAME = re.compile(r"^kvops-(?:link|host|switch)-(\d+)(?:-.+)?$")
_RATE_UNITS = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
_DELAY_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_CMD_TIMEOUT_S = 20.0  # every ip/tc call is bounded


class LinkError(RuntimeError):
    """The emulated link cannot be set up, or a process is not inside the one it expects."""


@dataclass(frozen=True)
class LinkSpec:
    """A link rate (bit/s) and an optional one-way delay (seconds)."""

    rate_bit_s: float
    delay_s: float = 0.0

    @classmethod
    def parse(cls, text: str) -> "LinkSpec":
        """``RATE[,DELAY]``: ``1gbit``, ``500mbit``, ``2.5gbit,1ms`` (units: gbit, mbit,
        kbit, bit; us, ms, s)."""
        parts = [p.strip().lower() for p in text.split(",")]
        if not 1 <= len(parts) <= 2 or not parts[0]:
            raise ValueError(f"link {text!r}: expected RATE[,DELAY], e.g. 1gbit or 1gbit,2ms")
        # whole bits per second and nanoseconds: a spec survives text -> parse unchanged
        rate = float(round(_number_with_unit(parts[0], _RATE_UNITS, "rate")))
        delay = round(_number_with_unit(parts[1], _DELAY_UNITS, "delay"), 9) if len(parts) == 2 else 0.0
        if rate <= 0:
            raise ValueError(f"link {text!r}: the rate must be positive")
        if delay < 0:
            raise ValueError(f"link {text!r}: the delay must not be negative")
        return cls(rate, delay)

    @property
    def text(self) -> str:
        """The spec in the form :meth:`parse` reads (and tc understands)."""
        unit = next(u for u in ("gbit", "mbit", "kbit", "bit") if self.rate_bit_s >= _RATE_UNITS[u])
        rate = f"{self.rate_bit_s / _RATE_UNITS[unit]:.12g}{unit}"
        return f"{rate},{self.delay_s * 1e6:.12g}us" if self.delay_s else rate

    @property
    def rate_gbit_s(self) -> float:
        return self.rate_bit_s / 1e9

    def tbf_args(self) -> List[str]:
        """tbf parameters: the bucket holds ~1 ms at the rate (at least 256 KiB, above
        loopback's 64 KiB packets) and the queue ~20 ms, so a bulk transfer runs at the
        rate without tail drops while a small message waits at most ~20 ms behind it."""
        rate_bytes = self.rate_bit_s / 8
        burst = max(256 << 10, int(rate_bytes * 1e-3))
        return ["rate", f"{int(self.rate_bit_s)}bit", "burst", str(burst), "latency", "20ms"]


def _number_with_unit(text: str, units: Dict[str, float], what: str) -> float:
    for unit in sorted(units, key=len, reverse=True):
        if text.endswith(unit):
            try:
                return float(text[: -len(unit)]) * units[unit]
            except ValueError:
                break
    raise ValueError(f"{what} {text!r}: expected a number with one of the units {sorted(units)}")


def run_tool(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    """Run an ``ip`` or ``tc`` command, bounded in time; :class:`LinkError` with its
    output if it fails (unless ``check`` is false)."""
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
    if check and proc.returncode != 0:
        raise LinkError(f"`{' '.join(cmd)}` failed ({proc.returncode}): "
                        f"{(proc.stderr or proc.stdout).strip()}")
    return proc


def check_prerequisites() -> None:
    """Raise :class:`LinkError` unless ``ip`` and ``tc`` exist and this process may
    create network namespaces (root, or CAP_NET_ADMIN plus CAP_SYS_ADMIN)."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise LinkError(f"the emulated link needs {' and '.join(missing)} (iproute2) on PATH")
    if not (_has_capability(12) and _has_capability(21)):  # CAP_NET_ADMIN, CAP_SYS_ADMIN
        raise LinkError("the emulated link needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) to "
                        "create and shape a network namespace; run as root or without --link")


def _apply_shape(spec: LinkSpec, netns: Optional[str]) -> None:
    """Shape loopback of namespace ``netns`` (None: the one this process is in)."""
    tc = ["tc", "-n", netns] if netns else ["tc"]
    if not spec.delay_s:
        run_tool([*tc, "qdisc", "replace", "dev", "lo", "root", "handle", "10:", "tbf", *spec.tbf_args()])
        return
    run_tool([*tc, "qdisc", "del", "dev", "lo", "root"], check=False)
    try:
        run_tool([*tc, "qdisc", "add", "dev", "lo", "root", "handle", "1:", "netem", "delay",
              f"{spec.delay_s * 1e6:.0f}us", "limit", "100000"])
    except LinkError as exc:
        raise LinkError(f"a link delay needs the netem qdisc, which this kernel lacks ({exc}); "
                        "give the rate alone") from None
    run_tool([*tc, "qdisc", "add", "dev", "lo", "parent", "1:1", "handle", "10:", "tbf", *spec.tbf_args()])


def _has_capability(bit: int) -> bool:
    try:
        with open("/proc/self/status") as f:
            status = f.read()
    except OSError:  # no /proc: root is the only capable user we can tell
        status = ""
    for line in status.splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> bit & 1)
    return os.geteuid() == 0


def _namespaces() -> List[str]:
    out = run_tool(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_inside(name: str, timeout: float = 10.0) -> List[int]:
    """End every process inside namespace ``name`` (SIGTERM, then SIGKILL); returns
    the pids found. The name is unique to one run, so these are that run's processes."""
    def pids() -> List[int]:
        proc = run_tool(["ip", "netns", "pids", name], check=False)
        return [int(p) for p in proc.stdout.split() if p.isdigit()]

    found = pids()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = pids()
        if not alive:
            break
        for pid in alive:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                continue  # it exited since pids() listed it: what we wanted
        deadline = time.monotonic() + timeout
        while pids() and time.monotonic() < deadline:
            time.sleep(0.1)
    return found


def remove_namespace(name: str) -> None:
    """End the processes inside ``name`` and delete it; raises if it is still there."""
    _kill_inside(name)
    if name in _namespaces():
        run_tool(["ip", "netns", "del", name])
    if name in _namespaces():
        raise LinkError(f"network namespace {name} is still present after `ip netns del`")


def remove_stale_namespaces() -> List[str]:
    """Delete this project's namespaces (links, emulated hosts and switches) whose
    creating process is gone (it was SIGKILLed, so it could not clean up); returns their
    names. A stale host's veth keeps its 198.18 address in this namespace, and would
    take the traffic meant for the next host made at that address."""
    removed = []
    for name in _namespaces():
        match = _OWNED_NAME.match(name)
        if match and not _pid_alive(int(match.group(1))):
            remove_namespace(name)
            removed.append(name)
    return removed


class EmulatedLink:
    """A network namespace with a shaped loopback, alive inside the ``with`` block.

    :meth:`run` / :meth:`popen` start commands inside it (``ip netns exec``), each in a
    new session so that the whole tree can be ended; :meth:`close` (also on exceptions
    and on SIGTERM/SIGHUP, turned into ``SystemExit`` while the link lives) ends the
    processes left inside and deletes the namespace.
    """

    def __init__(self, spec: LinkSpec, name: Optional[str] = None) -> None:
        self.spec = spec
        self.name = name or f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        if not _NAME.match(self.name):
            raise ValueError(f"namespace name {self.name!r} must look like {NAME_PREFIX}<pid>-<hex>")
        self._created = False
        self._children: List[subprocess.Popen] = []
        self._old_handlers: Dict[int, object] = {}

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> "EmulatedLink":
        self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self) -> None:
        check_prerequisites()
        remove_stale_namespaces()
        self._install_signal_handlers()
        try:
            run_tool(["ip", "netns", "add", self.name])
            self._created = True
            run_tool(["ip", "-n", self.name, "link", "set", "lo", "up"])
            self.shape(self.spec)
        except BaseException:
            self.close()
            raise

    def shape(self, spec: LinkSpec) -> None:
        """(Re)shape the loopback to ``spec``; callable while processes run inside."""
        _apply_shape(spec, self.name)
        self.spec = spec

    def close(self) -> None:
        """End what runs inside and delete the namespace (idempotent)."""
        try:
            for child in self._children:
                _end_session(child)
            self._children.clear()
            if self._created:
                remove_namespace(self.name)
                self._created = False
        finally:
            self._restore_signal_handlers()

    # ------------------------------------------------------------------ processes

    def env(self, base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        """Environment for a process inside: it can check where it runs (:func:`current_link`)."""
        env = dict(os.environ if base is None else base)
        env[ENV_NAME], env[ENV_SPEC] = self.name, self.spec.text
        return env

    def popen(self, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside the namespace, in a new session (ended by :meth:`close`)."""
        if not self._created:
            raise LinkError("the link is not open")
        kwargs.setdefault("env", self.env())
        child = subprocess.Popen(["ip", "netns", "exec", self.name, *argv], start_new_session=True,
                                 **kwargs)
        self._children.append(child)
        return child

    def run(self, argv: Sequence[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
        """Run ``argv`` inside and wait (``stdout=subprocess.PIPE`` etc. as for
        ``subprocess.run``); on timeout, exception or signal the child's session is
        ended before the error propagates."""
        child = self.popen(argv, **kwargs)
        try:
            out, err = child.communicate(timeout=timeout)
            return subprocess.CompletedProcess(child.args, child.returncode, out, err)
        finally:
            _end_session(child)
            self._children.remove(child)

    # ------------------------------------------------------------------ signals

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread may set handlers; close() still runs on exceptions

        def leave(signum, _frame):
            raise SystemExit(128 + signum)

        # SIGINT too: a process started in the background by a non-interactive shell
        # inherits it ignored, and would then never leave (nor remove the namespace)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, leave)

    def _restore_signal_handlers(self) -> None:
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()


def _end_session(child: subprocess.Popen, timeout: float = 15.0) -> None:
    """End a child started in its own session, and everything it started."""
    if child.poll() is None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(child.pid, sig)
            except ProcessLookupError:
                break
            try:
                child.wait(timeout)
                break
            except subprocess.TimeoutExpired:
                continue
    else:  # the leader exited; its session's other processes may live on
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            return  # no process of its session is left
        except PermissionError as exc:
            log.warning("cannot end the rest of session %d: %s", child.pid, exc)


# ---------------------------------------------------------------------- inside the link

def current_link() -> Optional[LinkSpec]:
    """The link this process runs in (it was started by :meth:`EmulatedLink.popen`), or
    None if it was not. Raises :class:`LinkError` if the environment says "inside" but
    the process is not in that namespace or its loopback is not shaped."""
    name = os.environ.get(ENV_NAME)
    if not name:
        return None
    spec = LinkSpec.parse(os.environ[ENV_SPEC])
    here = run_tool(["ip", "netns", "identify", str(os.getpid())], check=False).stdout.split()
    if name not in here:
        raise LinkError(f"{ENV_NAME}={name} but this process is in network namespace {here or 'default'}")
    qdiscs = run_tool(["tc", "qdisc", "show", "dev", "lo"]).stdout
    if "tbf" not in qdiscs:
        raise LinkError(f"namespace {name}: loopback is not shaped (tc shows: {qdiscs.strip()})")
    return spec


def shape_current(spec: LinkSpec) -> None:
    """From inside a link: reshape this namespace's loopback to ``spec`` (so one run can
    visit several rates without restarting its engines)."""
    if current_link() is None:
        raise LinkError("shape_current() runs only inside an emulated link")
    _apply_shape(spec, None)
    os.environ[ENV_SPEC] = spec.text


def run_in_link(spec: LinkSpec, argv: Sequence[str], timeout: float,
                **kwargs) -> subprocess.CompletedProcess:
    """Run ``argv`` inside a fresh link shaped to ``spec`` (keyword arguments as for
    :meth:`EmulatedLink.run`); the namespace is gone when this returns or raises."""
    with EmulatedLink(spec) as link:
        return link.run(argv, timeout, **kwargs)


def enter_link(link: str, script_argv: Sequence[str], timeout: float) -> LinkSpec:
    """For scripts with a ``--link RATE[,DELAY]`` option, called first thing.

    Outside a link: run ``script_argv`` (this script, same arguments) inside a new one
    shaped to ``link`` and leave with its exit status (``SystemExit``); its output goes
    where this process's goes. Inside (the re-run): check that this process is in the
    link it asked for and return its spec. Raises :class:`LinkError` (no root, no
    ``ip``/``tc``, not shaped): never a silent run on plain loopback."""
    spec = LinkSpec.parse(link)
    inside = current_link()
    if inside is None:
        raise SystemExit(run_in_link(spec, script_argv, timeout).returncode)
    if inside != spec:
        raise LinkError(f"asked for link {spec.text} but runs inside {inside.text}")
    return inside

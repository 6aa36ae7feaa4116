"""SGLang servers and SGLang's router for the serving harness (started, waited for and
stopped like vLLM's: ``Servers.add``). SGLang runs from its own environment
(``make setup-sglang``: ``.venv-sglang``, torch 2.14.1), on CPU: ``SGLANG_USE_CPU_ENGINE``,
``--device cpu --attention-backend torch_native``."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, List

from .fronts import _Launched, with_python_path
from .ports import free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PYTHON_ENV = "KVOPS_SGLANG_PYTHON"
ROLES = ("prefill", "decode", "monolithic")


def sglang_python() -> str:
    """The SGLang environment's interpreter: ``$KVOPS_SGLANG_PYTHON``, else
    ``.venv-sglang`` in the repository; missing, it is an error (``make setup-sglang``)."""
    path = os.environ.get(PYTHON_ENV) or os.path.join(REPO, ".venv-sglang", "bin", "python")
    if not os.access(path, os.X_OK):
        raise FileNotFoundError(f"no SGLang environment at {path}: run `make setup-sglang` "
                                f"(or set ${PYTHON_ENV})")
    return path


@dataclass
class SglangServerSpec(_Launched):
    """``python -m sglang.launch_server`` for one role on CPU. ``transfer_backend``:
    ``kvops`` (this package's plugin) or SGLang's own ``mooncake``; ``bootstrap_port``:
    P's bootstrap server (0: a free one). ``env`` adds to the server's environment
    (``PYTHONPATH`` entries go first: the test-only stand-in for sgl_kernel's CPU
    kernels goes there)."""

    name: str
    model: str
    role: str = field(default="monolithic", kw_only=True)
    transfer_backend: str = "kvops"
    bootstrap_port: int = 0
    side_channel_port: int = 0  # unused by SGLang; the harness's prefill servers all have one
    max_total_tokens: int = 16384
    dtype: str = "float32"
    page_size: int = 1
    # SGLang's scheduler loop spins while fully idle unless told to sleep (it wakes on
    # the next request): idle servers beside busy ones starve them on a few cores
    sleep_on_idle: bool = True

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role {self.role!r} is not one of {ROLES}")

    def command(self) -> List[str]:
        cmd = [sglang_python(), "-m", "sglang.launch_server", "--model-path", self.model,
               "--device", "cpu", "--attention-backend", "torch_native", "--host", self.host,
               "--port", str(self.port), "--dtype", self.dtype, "--page-size", str(self.page_size),
               "--max-total-tokens", str(self.max_total_tokens), "--random-seed", "0",
               "--enable-metrics"] + (["--sleep-on-idle"] if self.sleep_on_idle else [])
        if self.role != "monolithic":
            cmd += ["--disaggregation-mode", self.role,
                    "--disaggregation-transfer-backend", self.transfer_backend]
        if self.role == "prefill":
            cmd += ["--disaggregation-bootstrap-port", str(self.bootstrap_port)]
        if self.role == "decode":
            # the default backup calls torch.cuda.cudart()
            cmd += ["--disaggregation-decode-retraction-backup", "cpu_tensor"]
        return cmd + list(self.extra_args)

    def environment(self) -> Dict[str, str]:
        env = dict(os.environ)
        for name in [n for n in env if n.startswith(("VIRTUAL_ENV", "PYTHONHOME"))]:
            env.pop(name)
        env.update(SGLANG_USE_CPU_ENGINE="1", MC_FORCE_TCP="1", SGLANG_HOST_IP=self.host,
                   # the early send of a cached prefix records a torch.cuda.Event
                   SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX="0")
        env.update({k: v for k, v in self.env.items() if k != "PYTHONPATH"})
        return with_python_path(env, self.env.get("PYTHONPATH"))


@dataclass
class SglangRouterSpec(_Launched):
    """SGLang's router (PyPI ``sglang-router`` 0.3.2) in P/D mode, as SGLang users run
    it: each request goes to a P and a D at once with ``bootstrap_host/port/room``."""

    name: str
    prefill: List["object"]
    decode: List["object"]
    policy: str = "round_robin"
    # above SGLang's own 20 s: a server's /health runs a generation, and the router's 5 s
    # default dropped a busy D from the rotation (every request then 503)
    health_check_timeout_s: int = 25

    def command(self) -> List[str]:
        cmd = [sglang_python(), "-m", "sglang_router.launch_router", "--pd-disaggregation",
               "--host", self.host, "--port", str(self.port), "--policy", self.policy,
               "--health-check-timeout-secs", str(self.health_check_timeout_s),
               # a port of its own: two routers on one host clash on the default 29000
               "--prometheus-host", self.host, "--prometheus-port", str(free_port(self.host))]
        for p in self.prefill:
            cmd += ["--prefill", p.url, str(p.spec.bootstrap_port)]
        for d in self.decode:
            cmd += ["--decode", d.url]
        return cmd + list(self.extra_args)

    def environment(self) -> Dict[str, str]:
        return dict(os.environ, **self.env)

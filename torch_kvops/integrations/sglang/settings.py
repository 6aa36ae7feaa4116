"""The ``kvops`` backend's settings in SGLang, from ``$KVOPS_SGLANG_CONFIG`` (JSON):
SGLang's command line has no place for a backend's own settings."""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field, fields
from typing import Any, Dict, Optional

from ...addresses import is_loopback
from ...connector import ConnectorConfig
from ...connector.config import ENGINE_DETACH_SLOW_LANES_AFTER_S
from ...control.fleet_key import FLEET_KEY_ENV, load_fleet_key

log = logging.getLogger(__name__)

CONFIG_ENV = "KVOPS_SGLANG_CONFIG"
MHA_UNITS = ("page", "head")
SLIDING_LAYERS = ("window", "all")


@dataclass(frozen=True)
class KvopsSglangSettings:
    """``protocol``/``device_name``: the Mooncake transport's (``tcp``, or ``rdma`` with
    its device); ``connector``: :class:`~torch_kvops.ConnectorConfig` fields (lease,
    integrity check, timeouts); ``fleet_key_file`` (else ``$KVOPS_FLEET_KEY_FILE``):
    the key every server of the fleet shares (control-channel secrets derived from
    it, the backend's ZMQ messages signed with it: signing.py); ``allow_insecure``:
    start a server reachable beyond its host without one (a warning); ``mha_unit``: how
    an MHA model's KV moves, ``"page"`` (whole pages: equal attention TP sizes only) or
    ``"head"`` (one KV head of one token: any sizes that split the KV heads, at a cost
    per token: the destination lists and integrity digests grow by page size x local
    heads; heads.py). Every server of a fleet sets the same ``mha_unit`` (the
    connector's layout check refuses a link between the two). ``sliding_layers``: a
    prefill server pushes a sliding-window layer's pages of its ``"window"`` only
    (windows.py), or ``"all"`` of them."""

    protocol: str = "tcp"
    device_name: str = ""
    # prefill: how often it tells each decode server which of its rooms it still owes
    # (queued for prefill, or pushing): the decode side renews their leases (never past
    # the connector's max_wait_s), so a long prefill queue fails no room
    owed_notice_s: float = 5.0
    connector: Dict[str, Any] = field(default_factory=dict)
    fleet_key_file: str = ""
    allow_insecure: bool = False
    mha_unit: str = "page"
    sliding_layers: str = "window"

    @staticmethod
    def from_env() -> "KvopsSglangSettings":
        text = os.environ.get(CONFIG_ENV, "").strip()
        try:
            raw = json.loads(text) if text else {}
        except json.JSONDecodeError as exc:
            raise ValueError(f"${CONFIG_ENV} is not JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise ValueError(f"${CONFIG_ENV} must be a JSON object, got {type(raw).__name__}")
        known = {f.name for f in fields(KvopsSglangSettings)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"${CONFIG_ENV} has unknown settings {unknown}; known: {sorted(known)}")
        settings = KvopsSglangSettings(**raw)
        if not isinstance(settings.allow_insecure, bool) or not isinstance(settings.fleet_key_file, str):
            raise ValueError(f"${CONFIG_ENV} allow_insecure must be true or false and fleet_key_file "
                             "a path")
        if settings.mha_unit not in MHA_UNITS:
            raise ValueError(f"${CONFIG_ENV} mha_unit {settings.mha_unit!r} is not one of {MHA_UNITS}")
        if settings.sliding_layers not in SLIDING_LAYERS:
            raise ValueError(f"${CONFIG_ENV} sliding_layers {settings.sliding_layers!r} is not one of "
                             f"{SLIDING_LAYERS}")
        if settings.protocol not in ("tcp", "rdma"):
            raise ValueError(f"${CONFIG_ENV} protocol {settings.protocol!r} is not 'tcp' or 'rdma'")
        config = settings.connector_config()  # unknown or bad connector fields fail at start-up
        if not 0 < settings.owed_notice_s < config.lease_s:
            raise ValueError(f"${CONFIG_ENV} owed_notice_s must be in (0, lease_s="
                             f"{config.lease_s}): a lease renewed less often than it lasts expires")
        settings.fleet_key()  # a short or readable key file fails at start-up
        return settings

    def fleet_key(self) -> Optional[bytes]:
        """The fleet key (None without one), read from its file once."""
        if "_fleet_key" not in self.__dict__:  # (frozen: kept beside the fields)
            self.__dict__["_fleet_key"] = load_fleet_key(self.fleet_key_file)
        return self.__dict__["_fleet_key"]

    def check_exposure(self, host: str) -> None:
        """Refuse a server reachable beyond its host (``host``: where its Mooncake
        transport, control channel and ZMQ socket listen) without a fleet key, unless
        ``allow_insecure`` (then warn): unsigned, anyone who reaches it names the pages
        P pushes a room's KV into, or the first token D decodes from."""
        if is_loopback(host) or self.fleet_key() is not None:
            return
        what = (f"kvops: this SGLang server listens on {host}, beyond this host, without a fleet "
                "key: anyone who reaches it can name the pages P pushes a room's KV into, and "
                "the first token D decodes from")
        if not self.allow_insecure:
            raise ValueError(f"{what}. Give every server of the fleet the same key (fleet_key_file "
                             f"in ${CONFIG_ENV}, or ${FLEET_KEY_ENV}), bind to loopback "
                             "(SGLANG_HOST_IP=127.0.0.1), or set allow_insecure: true")
        log.warning("%s (allow_insecure: true)", what)

    def connector_config(self) -> ConnectorConfig:
        fields_ = dict(self.connector)
        # D expects every request before P may begin it: a begin ahead of its expect
        # waits that long, then is refused (connector/consumer_admission.py)
        fields_.setdefault("begin_timeout_s", 15.0)  # P waits that long for begin's answer
        fields_.setdefault("begin_waits_for_expect_s", 10.0)
        # a slow decode server delays P's next forward by at most this
        fields_.setdefault("detach_slow_lanes_after_s", ENGINE_DETACH_SLOW_LANES_AFTER_S)
        return ConnectorConfig(**fields_)

"""Settings and the per-step metadata the scheduler side hands the worker side."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata, KVConnectorMetadata)

from ...addresses import Endpoint, endpoint
from ...connector import ConnectorConfig
from ...connector.config import ENGINE_DETACH_SLOW_LANES_AFTER_S

if TYPE_CHECKING:
    from .side_channel import FleetAuth, TlsFiles

log = logging.getLogger(__name__)

PUSH_MODES = ("layerwise", "after_forward")
SIDE_CHANNEL_PORT_ENV = "KVOPS_SIDE_CHANNEL_PORT"
DEFAULT_SIDE_CHANNEL_PORT = 8999
BEGIN_WAITS_FOR_EXPECT_S = 10.0  # D: how long a begin waits for its request's expect()
BEGIN_TIMEOUT_S = 15.0  # P: how long it waits for the answer to a begin (D may hold it)
# kv_connector_extra_config keys of vLLM's MooncakeConnector -> ours
MOONCAKE_CONNECTOR_ALIASES = {"mooncake_protocol": "protocol"}


@dataclass
class KvopsSettings:
    """``kv_connector_extra_config`` keys (all optional).

    push_mode: "layerwise" pushes each layer as soon as it is written; "after_forward"
        pushes every layer after the forward (the baseline behaviour of vLLM's P/D
        connectors, kept for comparison). A request may override it with
        ``kv_transfer_params["kvops_push_mode"]``.
    protocol / device_name: Mooncake's transport, ``tcp`` (the default) or ``rdma``, and
        for RDMA the devices to use (comma-separated, empty: all). MooncakeConnector's
        ``mooncake_protocol`` is accepted for ``protocol``. An engine asked for RDMA
        on a host without an RDMA device refuses to start (Mooncake would silently
        fall back to TCP).
    host: this engine's address for the Mooncake transport and control channel. Empty
        (the default): ``$VLLM_HOST_IP``, else the address of the interface that routes
        out, as vLLM picks it (addresses.py); ``0.0.0.0`` binds every interface and
        advertises the host's address, never itself.
    side_channel_host / side_channel_port: prefill side: where decode instances post the
        block ids they allocated. The host defaults to ``host``; the port to
        ``$KVOPS_SIDE_CHANNEL_PORT``, else 8999 (``DEFAULT_SIDE_CHANNEL_PORT``), so a
        router or proxy knows it as it knows the bootstrap port 8998; 0 picks a free
        one (the bootstrap endpoint's ``/query`` still names it).
    allow_insecure: an engine whose addresses are not all loopback refuses to start
        without a fleet key (anyone who reaches it could choose where P pushes a
        request's KV); true starts it anyway, with a warning.
    late_binding: prefill side (default True): a request is scheduled at once, whatever
        the order in which the router sends it to P and D; its blocks go to D as soon as
        both their KV is written and D's destination arrived (docs/vllm.md). False gives
        the D-first protocol: a request waits up to ``wait_for_decode_s`` for its
        destination, then is prefilled without push.
    hold_for_decode_s / max_held_requests / max_held_pool_share: prefill side, late
        binding: a request that finished before its destination arrived keeps its
        blocks at most this long, at most this many such requests are held, and the
        holds together keep at most this share of P's KV blocks (over any bound the
        oldest hold is released; D recomputes when its lease ends).
        ``max_held_requests=0`` holds none.
    wait_for_decode_s: prefill side: how long a request waits for its decode
        destination before P schedules it (the D-first wait). With late binding it is
        then scheduled anyway and pushes when the destination comes: a short wait suits
        a D-first proxy that sends P the request right after D (every chunk then goes
        layer by layer), 0 (the default with late binding) a P-first router. Without
        late binding (default 10 s) the request is then prefilled without push.
    step_timeout_s: bound of a push step: the sender fails the step's pushes (those
        requests alone) once it has not finished by then (the connector's
        ``step_timeout_s`` unless ``connector`` sets it); ``wait_for_save`` waits that
        long plus the bound of a write in flight, so a slow decode side fails its own
        requests instead of raising into vLLM.
    idle_step_wait_s: a step with nothing to compute while transfers are in flight waits
        up to this long for one to end (it wakes when one does) instead of returning
        at once: vLLM steps such an engine in a busy loop (~1,000 empty steps a second,
        each through its executor's message queue). 0: no wait.
    connect_wait_s: P: how long a step waits for a new link to a decode rank (made on a
        connect thread, links.py) before it goes on without it, that request's part
        failing (its decode side recomputes) while the connection goes on: a decode
        instance that drops packets costs P's steps this long per attempt.
    max_decode_links: P keeps at most this many links to decode ranks (per worker); beyond
        it the least recently used with nothing in flight is released between steps.
    peer_idle_s: P closes the link to a decode instance (control channel, staging
        registration and buffer) once it failed, or carried no request for this long,
        and has none in flight; it is connected again when a request needs it. A
        restarted D is a new instance: without this, P would keep every link it ever had.
    connector: ConnectorConfig fields (lease_s, transfer_timeout_s, ...). Set here
        unless given: begin_timeout_s 15 s, begin_waits_for_expect_s 10 s, and
        detach_slow_lanes_after_s 0.5 s (a slow decode rank delays P's next step by at
        most that; null: wait_for_save waits for every write of the step).
    fleet_key_file: the fleet key (else the file ``$KVOPS_FLEET_KEY_FILE`` names): signs
        every side-channel message and derives the control channel's secrets
        (side_channel/auth.py); without one, a warning at start-up names what is exposed.
    auth_skew_s: clock difference accepted between engines (and the replay window).
    tls_cert_file / tls_key_file / tls_ca_file: mutual TLS on the side channel.
    side_channel_max_connections: P: connections open at once (the oldest is closed).
    bootstrap_server_address: P: where ``GET /query`` is served ("host:port", as vLLM's
        MooncakeConnector reads it; else ``side_channel_host`` and
        ``$VLLM_MOONCAKE_BOOTSTRAP_PORT``, 8998). bootstrap_endpoint=False: none.
    """

    push_mode: str = "layerwise"
    host: str = ""
    protocol: str = "tcp"
    device_name: str = ""
    side_channel_host: str = ""
    side_channel_port: Optional[int] = None  # None: $KVOPS_SIDE_CHANNEL_PORT, else 8999
    allow_insecure: bool = False
    late_binding: bool = True
    hold_for_decode_s: float = 30.0
    max_held_requests: int = 64
    max_held_pool_share: float = 0.5
    connect_wait_s: float = 2.0
    max_decode_links: int = 256
    wait_for_decode_s: Optional[float] = None  # None: 0 with late binding, else 10
    post_timeout_s: float = 2.0
    post_retries: int = 2
    peer_idle_s: float = 300.0
    step_timeout_s: float = 120.0
    idle_step_wait_s: float = 0.005
    connector: Dict[str, Any] = field(default_factory=dict)
    fleet_key_file: str = ""
    auth_skew_s: float = 30.0
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_ca_file: str = ""
    side_channel_max_connections: int = 64
    bootstrap_server_address: str = ""
    bootstrap_endpoint: bool = True

    def __post_init__(self) -> None:
        if self.wait_for_decode_s is None:
            self.wait_for_decode_s = 0.0 if self.late_binding else 10.0
        if self.side_channel_port is None:
            port = os.environ.get(SIDE_CHANNEL_PORT_ENV, str(DEFAULT_SIDE_CHANNEL_PORT))
            if not port.isdigit():
                raise ValueError(f"${SIDE_CHANNEL_PORT_ENV}={port!r} is not a port number")
            self.side_channel_port = int(port)

    @staticmethod
    def from_extra(extra: Optional[Dict[str, Any]]) -> "KvopsSettings":
        extra = dict(extra or {})
        for alias, key in MOONCAKE_CONNECTOR_ALIASES.items():  # a MooncakeConnector config as is
            if alias in extra:
                value = extra.pop(alias)
                if key in extra and extra[key] != value:
                    raise ValueError(f"kv_connector_extra_config: {alias}={value!r} and {key}={extra[key]!r} "
                                     "disagree (the first is MooncakeConnector's name for the second)")
                extra[key] = value
        known = set(KvopsSettings.__dataclass_fields__)
        unknown = set(extra) - known
        if unknown:
            raise ValueError(f"unknown kv_connector_extra_config keys {sorted(unknown)}; "
                             f"known: {sorted(known)}")
        settings = KvopsSettings(**extra)
        if settings.protocol not in ("tcp", "rdma"):
            raise ValueError(f"protocol must be 'tcp' or 'rdma', got {settings.protocol!r}")
        if not isinstance(settings.device_name, str):
            raise ValueError(f"device_name must be a string (comma-separated RDMA devices), got "
                             f"{settings.device_name!r}")
        if settings.push_mode not in PUSH_MODES:
            raise ValueError(f"push_mode must be one of {PUSH_MODES}, got {settings.push_mode!r}")
        if not isinstance(settings.late_binding, bool):
            raise ValueError(f"late_binding must be true or false, got {settings.late_binding!r}")
        if not settings.wait_for_decode_s >= 0:
            raise ValueError(f"wait_for_decode_s must be >= 0, got {settings.wait_for_decode_s!r}")
        if not settings.hold_for_decode_s > 0:
            raise ValueError(f"hold_for_decode_s must be > 0, got {settings.hold_for_decode_s!r}")
        if not isinstance(settings.max_decode_links, int) or settings.max_decode_links < 1:
            raise ValueError(f"max_decode_links must be an integer >= 1, got {settings.max_decode_links!r}")
        if not settings.connect_wait_s >= 0:
            raise ValueError(f"connect_wait_s must be >= 0, got {settings.connect_wait_s!r}")
        if not 0 < settings.max_held_pool_share <= 1:
            raise ValueError(f"max_held_pool_share must be in (0, 1], got {settings.max_held_pool_share!r}")
        if not isinstance(settings.max_held_requests, int) or settings.max_held_requests < 0:
            raise ValueError(f"max_held_requests must be an integer >= 0, got "
                             f"{settings.max_held_requests!r}")
        if not isinstance(settings.bootstrap_server_address, str):
            raise ValueError("bootstrap_server_address must be a host:port string")
        if not all(isinstance(h, str) for h in (settings.host, settings.side_channel_host)):
            raise ValueError("host and side_channel_host must be strings (empty: the host's address)")
        if not isinstance(settings.side_channel_port, int) or not 0 <= settings.side_channel_port < 65536:
            raise ValueError(f"side_channel_port must be a port number, got {settings.side_channel_port!r}")
        if not isinstance(settings.allow_insecure, bool):
            raise ValueError(f"allow_insecure must be true or false, got {settings.allow_insecure!r}")
        ConnectorConfig(**settings.connector)  # reject unknown fields now, not in the worker
        settings.side_channel_security()  # a missing key file or half the TLS files: now
        settings.check_exposure()
        return settings

    def data_endpoint(self) -> Endpoint:
        """Where the Mooncake transport and the control channel are reached."""
        return endpoint(self.host)

    def side_channel_endpoint(self) -> Endpoint:
        """Where P's side channel (and by default its bootstrap endpoint) listens."""
        return endpoint(self.side_channel_host or self.host)

    def check_exposure(self) -> None:
        """Refuse an engine reachable beyond this host without a fleet key (unless
        ``allow_insecure``, then warn): unsigned, anyone who reaches it chooses where
        P pushes a request's KV, or posts into D's requests."""
        exposed = [e.bind for e in (self.data_endpoint(), self.side_channel_endpoint())
                   if not e.loopback_only]
        if not exposed or self.fleet_key() is not None:
            return
        what = (f"kvops: this engine listens on {sorted(set(exposed))}, beyond this host, without a "
                "fleet key: anyone who reaches it can choose where P pushes a request's KV and "
                "read what crosses its side channel")
        if not self.allow_insecure:
            raise ValueError(f"{what}. Give every engine of the fleet the same key "
                             "(kv_connector_extra_config fleet_key_file, or $KVOPS_FLEET_KEY_FILE), "
                             "bind to loopback (host: 127.0.0.1), or set allow_insecure: true")
        log.warning("%s (allow_insecure: true)", what)

    def fleet_key(self) -> Optional[bytes]:
        """The fleet key (None without one); read from its file on every call."""
        from .side_channel import load_fleet_key
        return load_fleet_key(self.fleet_key_file)

    def side_channel_security(self) -> Tuple[Optional["FleetAuth"], Optional["TlsFiles"]]:
        """(signing, TLS) of the side channel, each None when not configured."""
        from .side_channel import FleetAuth, tls_files
        key = self.fleet_key()
        return (FleetAuth(key, self.auth_skew_s) if key is not None else None,
                tls_files(self.tls_cert_file, self.tls_key_file, self.tls_ca_file))

    def connector_config(self) -> ConnectorConfig:
        fields = dict({"step_timeout_s": self.step_timeout_s}, **self.connector)
        fields.setdefault("begin_timeout_s", BEGIN_TIMEOUT_S)
        fields.setdefault("detach_slow_lanes_after_s", ENGINE_DETACH_SLOW_LANES_AFTER_S)
        config = ConnectorConfig(**fields)
        if "begin_waits_for_expect_s" in fields:
            return config
        # D's engine expects every request it receives: a begin for one it never
        # expected is held for its expect(), then rejected (consumer_admission.py)
        return replace(config, begin_waits_for_expect_s=min(
            BEGIN_WAITS_FOR_EXPECT_S, 0.8 * config.begin_answer_timeout_s))

    def save_wait_s(self) -> float:
        """How long wait_for_save waits: the sender's step bound, plus a write already
        under way (its retries included), plus a margin. Only a sender that is stuck
        beyond its own bounds makes it raise."""
        config = self.connector_config()
        return (config.step_timeout_s + (config.max_retries + 1) * config.transfer_timeout_s
                + config.retry_backoff_s * 2 ** config.max_retries + 10.0)


@dataclass
class PushReq:
    """Producer: push these blocks of request ``req_id`` in this step. Every prefill
    rank gets the same entry and sends its share of the heads, or with MLA its share
    of the blocks (tp.py): ``block_offset`` is the position of the chunk's first block
    in the request's pushed blocks, ``total_blocks`` how many blocks the request pushes
    (the decode side's count of them)."""

    req_id: str  # this engine's request id
    transfer_id: str  # shared with the decode side; parts of it are LayerwiseConnector ids
    peers: List[dict]  # the decode engine's per-rank peer_info, by rank
    src_blocks: List[int]
    dst_blocks: List[int]
    last_chunk: bool
    push_mode: str
    # the scheduler finished the request already (a late destination of a held
    # request): its blocks are written, and freed once this push ended
    finished: bool = False
    block_offset: int = 0
    total_blocks: int = 0


@dataclass
class RecvReq:
    """Consumer: ``block_ids`` of ``req_id`` will be pushed under ``transfer_id`` by a
    prefill engine of ``prefill_tp`` ranks (0: its destination could not be posted, fail
    it); those not filled by a failed transfer are reported as load errors."""

    req_id: str
    transfer_id: str
    prefill_tp: int
    block_ids: List[int] = field(default_factory=list)


class KvopsConnectorMetadata(KVConnectorMetadata):
    """One scheduler step's transfer work for the worker."""

    def __init__(self) -> None:
        self.idle = False  # the step computes nothing (no scheduled token)
        self.push: List[PushReq] = []
        self.recv: List[RecvReq] = []
        # producer: held requests given up on (no destination within the bounds); the
        # workers report them in finished_sending, so vLLM frees their blocks once
        self.release: List[str] = []
        # consumer: requests whose prefill side still owes their push (it said so just
        # now): the workers renew their leases
        self.renew: List[str] = []


@dataclass
class KvopsHandshake(KVConnectorHandshakeMetadata):
    """Decode worker -> its scheduler: the rank's consumer peer_info (addresses, layout,
    ``tp_rank``)."""

    peer_info: dict

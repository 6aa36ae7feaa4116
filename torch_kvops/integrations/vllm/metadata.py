"""Settings and the per-step metadata the scheduler side hands the worker side."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata, KVConnectorMetadata)

from ...connector import ConnectorConfig

PUSH_MODES = ("layerwise", "after_forward")


@dataclass
class KvopsSettings:
    """``kv_connector_extra_config`` keys (all optional).

    push_mode: "layerwise" pushes each layer as soon as it is written; "after_forward"
        pushes every layer after the forward (the baseline behaviour of vLLM's P/D
        connectors, kept for comparison). A request may override it with
        ``kv_transfer_params["kvops_push_mode"]``.
    host: address the Mooncake transport and control channel bind to.
    side_channel_host / side_channel_port: prefill side: where decode instances post the
        block ids they allocated (port 0 picks a free one; the proxy must know it).
    wait_for_decode_s: prefill side: how long a request waits for its decode
        destination before it is prefilled without push (the decode side then fails or
        recomputes it when its lease expires).
    step_timeout_s: bound of wait_for_save per step.
    connector: ConnectorConfig fields (lease_s, transfer_timeout_s, ...).
    """

    push_mode: str = "layerwise"
    host: str = "127.0.0.1"
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 0
    wait_for_decode_s: float = 10.0
    post_timeout_s: float = 2.0
    post_retries: int = 2
    step_timeout_s: float = 120.0
    connector: Dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def from_extra(extra: Optional[Dict[str, Any]]) -> "KvopsSettings":
        extra = dict(extra or {})
        known = set(KvopsSettings.__dataclass_fields__)
        unknown = set(extra) - known
        if unknown:
            raise ValueError(f"unknown kv_connector_extra_config keys {sorted(unknown)}; "
                             f"known: {sorted(known)}")
        settings = KvopsSettings(**extra)
        if settings.push_mode not in PUSH_MODES:
            raise ValueError(f"push_mode must be one of {PUSH_MODES}, got {settings.push_mode!r}")
        ConnectorConfig(**settings.connector)  # reject unknown fields now, not in the worker
        return settings

    def connector_config(self) -> ConnectorConfig:
        return ConnectorConfig(**self.connector)


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
        self.push: List[PushReq] = []
        self.recv: List[RecvReq] = []


@dataclass
class KvopsHandshake(KVConnectorHandshakeMetadata):
    """Decode worker -> its scheduler: the rank's consumer peer_info (addresses, layout,
    ``tp_rank``)."""

    peer_info: dict

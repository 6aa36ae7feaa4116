"""Connector configuration: every wait in the connector is bounded by one of these."""
from __future__ import annotations

from dataclasses import dataclass

PROTOCOL_VERSION = 2  # 2: authenticated handshake, begin names destination blocks


@dataclass
class ConnectorConfig:
    """Timeouts and retry policy. Every wait is bounded by one of these."""

    transfer_timeout_s: float = 5.0  # one write of one layer to one peer
    max_retries: int = 2  # extra attempts after a transient transport error
    retry_backoff_s: float = 0.05  # doubled after each retry
    event_timeout_s: float = 60.0  # a pushed layer's device event must complete by then
    step_timeout_s: float = 600.0  # all layers of a step must be pushed by then
    lease_s: float = 30.0  # consumer: a started request must progress within this
    control_timeout_s: float = 5.0  # connect/send on the control channel
    quarantine_s: float = 1.0  # a write that failed may still land late (Mooncake#4247)
    # Staging of fragmented layers (docs/connector.md). A layer whose merged
    # descriptors average fewer bytes than the threshold goes through staging slots.
    staging_threshold_bytes: int = 256 << 10  # 0 disables staging
    staging_slot_bytes: int = 8 << 20
    staging_slots: int = 8  # per producer on the consumer; in flight before an ack
    # Device (CUDA) caches go through pinned host staging on a connector-owned stream,
    # because Mooncake's TCP transport copies device memory with a synchronous
    # cudaMemcpy on the legacy default stream: behind the whole forward of a model on
    # that stream. True lets the transport read/write device memory directly: only
    # where it does so without a host copy (RDMA with GPUDirect).
    direct_device_reads: bool = False
    # End-to-end check (integrity.py): the producer sends keyed digests of the blocks
    # it pushed, the consumer verifies its blocks before reporting a request finished
    # and fails it on a mismatch. Either side may turn it on for its links; host
    # caches only. Costs a second read of every pushed byte on both sides.
    integrity_check: bool = False

    def __post_init__(self) -> None:
        if self.staging_slots < 2:
            raise ValueError("staging_slots must be >= 2: one slot group is gathered while the "
                             f"other is on the wire, got {self.staging_slots}")

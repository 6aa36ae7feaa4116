"""Connector configuration: every wait in the connector is bounded by one of these."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

# 2: authenticated handshake, begin names destination blocks; 3: integrity digests
# per layer ("digests" notices), in the mode the link agreed on; 4: the fence: "begun"
# grants a write lease (grant_s), "failed" says whether writes may still be in flight
PROTOCOL_VERSION = 4

INTEGRITY_MODES = ("off", "checksum", "mac")  # weakest first

# The engine adapters' detach_slow_lanes_after_s: a slow consumer delays the engine's
# next step by at most this (its lane then finishes alone, peer_step.py)
ENGINE_DETACH_SLOW_LANES_AFTER_S = 0.5


def integrity_mode(value: Union[bool, str, None]) -> str:
    """``integrity_check`` as one of INTEGRITY_MODES: True means "mac" (what True always
    meant: a keyed digest), False and None "off"; anything else is refused."""
    if value is True:
        return "mac"
    if value is False or value is None:
        return "off"
    if isinstance(value, str) and value in INTEGRITY_MODES:
        return value
    raise ValueError(f"integrity_check must be one of {INTEGRITY_MODES} (or True = 'mac', "
                     f"False = 'off'), got {value!r}")


@dataclass
class ConnectorConfig:
    """Timeouts and retry policy. Every wait is bounded by one of these."""

    transfer_timeout_s: float = 5.0  # one write of one layer to one peer
    max_retries: int = 2  # extra attempts after a transient transport error
    retry_backoff_s: float = 0.05  # doubled after each retry
    event_timeout_s: float = 60.0  # a pushed layer's device event must complete by then
    step_timeout_s: float = 600.0  # all layers of a step must be pushed by then
    # producer: None, wait_for_save returns once every peer's writes of the step are
    # over; a number, once every layer is handed to the peers' lanes and each lane has
    # ended or written this long past the last hand-off: a lane still writing (a slow
    # consumer) goes on alone, its requests in flight, and the engine's next step does
    # not wait for it (peer_step.py). The engine adapters set 0.5 s.
    detach_slow_lanes_after_s: Optional[float] = None
    lease_s: float = 30.0  # consumer: a started request must progress within this
    # consumer: renewals by a producer that says it still owes the push (renew()) end
    # this long after the request was first expected
    max_wait_s: float = 300.0
    control_timeout_s: float = 5.0  # connect/send on the control channel
    # consumer: a begin naming a request nobody expected is answered once expect()
    # names it, at most this long after, and rejects it then (consumer_admission.py),
    # so a producer with a stale or wrong id writes nothing. Below begin_timeout_s.
    begin_waits_for_expect_s: float = 0.0
    # consumer: True lets a begin start requests nobody expected (a caller that never
    # calls expect()): any producer holding the secret then writes where it names
    accept_unsolicited_pushes: bool = False
    # producer: how long it waits for the answer to a begin, which a consumer may hold
    # up to its begin_waits_for_expect_s (its engine may be a few steps behind); None:
    # transfer_timeout_s. The engine adapters, whose consumers hold, set 15 s.
    begin_timeout_s: Optional[float] = None
    quarantine_s: float = 1.0  # a write that failed may still land late (Mooncake#4247)
    # The fence (docs/connector.md, "The fence"). Consumer: a request it gives up on
    # while its producer may still have writes in the transport (lease expired, the
    # producer's connection ended, integrity failure, a failure notice with writes in
    # flight) is revoked at once but reported only this long after its producer's
    # write lease ended: what the transport may still deliver of a write handed to it
    # before (Mooncake TCP keeps a timed-out transfer running until its progress
    # timeout, MC_TCP_PROGRESS_TIMEOUT_SEC, 30 s by default; plus one transfer timeout).
    fence_drain_s: float = 35.0
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
    # End-to-end check (integrity.py), "off", "checksum" or "mac": the producer sends a
    # digest of every block of every layer it pushed, the consumer verifies each layer
    # as it lands and fails the request on a mismatch. "checksum" (CRC-32C, native)
    # catches accidents (corrupt, lost, misplaced writes); "mac" (keyed BLAKE3) also a
    # writer without the key. True means "mac", False "off". Either side may turn it
    # on for its links (the stronger mode wins); host caches only.
    integrity_check: Union[bool, str] = False

    def __post_init__(self) -> None:
        integrity_mode(self.integrity_check)  # refuse a bad value now, not at the first push
        if self.fence_drain_s < 0:
            raise ValueError(f"fence_drain_s must be >= 0, got {self.fence_drain_s}")
        wait = self.begin_waits_for_expect_s
        if wait is None or not 0 <= wait < self.begin_answer_timeout_s:
            raise ValueError(f"begin_waits_for_expect_s must be in [0, begin_timeout_s="
                             f"{self.begin_answer_timeout_s}) (the producer waits that long for an "
                             f"answer), got {wait!r}; accept_unsolicited_pushes=True lets a begin "
                             f"start requests nobody expected")
        detach = self.detach_slow_lanes_after_s
        if detach is not None and not 0 <= detach < float("inf"):
            raise ValueError(f"detach_slow_lanes_after_s must be None or a number >= 0, got {detach!r}")
        if self.staging_slots < 2:
            raise ValueError("staging_slots must be >= 2: one slot group is gathered while the "
                             f"other is on the wire, got {self.staging_slots}")

    @property
    def begin_answer_timeout_s(self) -> float:
        """How long a producer waits for the answer to a begin."""
        return self.transfer_timeout_s if self.begin_timeout_s is None else self.begin_timeout_s

    @property
    def integrity_mode(self) -> str:
        """``integrity_check`` normalised: "off", "checksum" or "mac"."""
        return integrity_mode(self.integrity_check)

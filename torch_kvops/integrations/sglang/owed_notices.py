"""Owed notices: every ``owed_notice_s`` a prefill rank tells each decode rank the
rooms it accepted and has not ended (queued for prefill, or pushing), and the rooms
held while that rank's link is made (a slow connection, e.g. to a decode server just
restarted); the decode rank renews their leases, so they outlive a long prefill
queue. A prefill that stops telling (dead, frozen, cut off) renews nothing: its rooms
fail there when their leases end."""
from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Dict, List

import zmq

from . import internals as sgl

if TYPE_CHECKING:
    from .manager import KvopsKVManager

log = logging.getLogger(__name__)

STILL_OWED = b"KVOPS_OWED"  # prefill -> decode: the rooms it still owes that decode rank


def tell_owed_rooms(manager: "KvopsKVManager") -> None:
    """Prefill: the ``kvops-sglang-owed`` thread's loop."""
    while True:
        time.sleep(manager.settings.owed_notice_s)
        owed: Dict[str, List[int]] = manager.decode_peers.held_rooms()
        for room, status in list(manager.request_status.items()):
            if status in (sgl.KVPoll.WaitingForInput, sgl.KVPoll.Transferring):
                for dest in manager.destinations(room):
                    owed.setdefault(dest.endpoint, []).append(room)
        for endpoint, rooms in owed.items():
            try:
                manager.send_to_decode(endpoint, [STILL_OWED, json.dumps(rooms).encode()])
            except zmq.ZMQError as exc:
                log.warning("kvops: the rooms owed to %s were not told: %s", endpoint, exc)


def renew_owed_rooms(manager: "KvopsKVManager", frame: bytes) -> None:
    """Decode: renew the leases of the rooms a prefill rank says it still owes."""
    rooms = json.loads(frame)
    if not isinstance(rooms, list) or not all(isinstance(r, int) for r in rooms):
        raise ValueError("a list of owed rooms that is not a list of room ids")
    renewed = [r for r in rooms if any([manager.conn.renew(part) for part in manager.rooms.parts(r)])]
    manager.counts.add("kvops_sglang_lease_renewals", len(renewed))

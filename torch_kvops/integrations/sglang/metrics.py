"""The ``kvops`` backend's Prometheus counters in SGLang. SGLang serves ``/metrics`` in
multiprocess mode (``--enable-metrics``): counters created in the scheduler process
appear there."""
from __future__ import annotations

from typing import Dict

from prometheus_client import Counter

_COUNTERS: Dict[str, Counter] = {}
HELP = {
    "kvops_sglang_chunks": "Chunks pushed, by role and path: 'forward' (layer by layer, "
                           "in the forward), 'after_forward' (whole, by the push thread) or "
                           "'window' (a hybrid pool's window of a room, by the push thread)",
    "kvops_sglang_layers": "KV buffers (a layer's K or V) pushed in forwards",
    "kvops_sglang_layers_landed_during_forward": "Of those, the ones whose bytes landed "
                                                 "on the decode side before the forward ended",
    "kvops_sglang_rooms": "Rooms ended, by role and outcome",
    "kvops_sglang_decode_prefix_tokens": "Prefill, per rank: prompt tokens not sent because "
                                         "the decode side held them (its radix cache)",
    "kvops_sglang_pushed_bytes": "Prefill: KV bytes handed to the connector to push (a room "
                                 "that fails moves fewer)",
    "kvops_sglang_window_pages_skipped": "Prefill: pages of sliding-window layers' KV buffers "
                                         "not pushed, before the layer's window (windows.py)",
    "kvops_sglang_lease_renewals": "Decode: leases renewed because the prefill server said "
                                   "it still owes the room",
    "kvops_sglang_refused_messages": "The backend's ZMQ messages refused: not signed with the "
                                     "fleet key",
    "kvops_sglang_abort_notices": "Prefill: SGLang's abort notices from decode servers taken "
                                  "(signed with the fleet key where there is one)",
    "kvops_sglang_integrity_failures": "Decode: rooms failed by the integrity check (their pages "
                                       "differ from what the prefill server pushed)",
    "kvops_sglang_misaddressed_rooms": "Decode: rooms failed because the prefill server named "
                                       "pages this server did not give them (nothing written)",
    "kvops_sglang_prefill_restarts": "Decode: prefill servers found restarted between two "
                                     "heartbeats (a cached rank's endpoint moved)",
    "kvops_sglang_links": "Prefill: links to decode ranks, by event: 'made' (to a rank not "
                          "linked), 'broken' (given up by the connector), 'remade' (a broken "
                          "one connected again), 'released' (a broken or dead one closed); "
                          "live links = made - released",
}


class Counts:
    """The counters of one role (``role`` label), each with one more ``label``."""

    def __init__(self, role: str) -> None:
        self.role = role

    def add(self, name: str, amount: float = 1, label: str = "") -> None:
        if amount <= 0:
            return
        counter = _COUNTERS.get(name)
        if counter is None:
            counter = _COUNTERS[name] = Counter(name, HELP[name], ["role", "label"])
        counter.labels(role=self.role, label=label).inc(amount)

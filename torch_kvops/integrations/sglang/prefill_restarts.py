"""Decode side: a prefill server restarted between two of SGLang's heartbeats.

SGLang's decode side caches, per prefill server (its bootstrap address), the ZMQ
endpoints of its ranks, and drops the cache only when the bootstrap server misses
``SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE`` heartbeats in a row. A prefill server
that restarts faster than that (its bootstrap on the same port, its ranks on new ones)
never misses them: every room's destination would go on to the dead process's
endpoints, and the restarted server would never get a room. So after each answered
heartbeat the backend asks the bootstrap server where the cached ranks are now; an
endpoint that moved is a restart, handled as a failed prefill server (the manager's
``_handle_node_failure``: the cache is dropped, its rooms end with their transfers'
outcome).
"""
from __future__ import annotations

import logging
from typing import Dict, List, Optional, Sequence, Tuple

import requests

log = logging.getLogger(__name__)

ROUTE_TIMEOUT_S = (2, 3)  # (connect, read), as SGLang's heartbeat


def cached_endpoints(connection_pool: Dict[str, list], bootstrap_addr: str,
                     target_tp_ranks: Optional[Sequence[int]] = None) -> List[Tuple[str, dict]]:
    """(route query, cached rank info) of each rank of ``bootstrap_addr`` in SGLang's
    ``connection_pool`` (keys ``{addr}_{dp}_{cp}_{tp}``). One entry lists the infos of
    all ``target_tp_ranks`` (SGLang's rank mapping for that prefill server, in order):
    with MLA and more prefill ranks than decode ranks, the rank that sends and the
    dummies, whose endpoints differ; without the mapping, an entry is its key's rank."""
    found = []
    for key, infos in connection_pool.items():
        if not key.startswith(bootstrap_addr + "_") or not infos:
            continue
        dp, cp, tp = key[len(bootstrap_addr) + 1:].split("_")[:3]
        ranks = list(target_tp_ranks) if target_tp_ranks else [tp]
        stages = len({info.get("pp_rank", 0) for info in infos})  # of each TP rank, in order
        if len(ranks) * stages != len(infos):
            log.warning("kvops: %d cached ranks of %s for TP ranks %s: not checked for a restart",
                        len(infos), key, ranks)
            continue
        for i, info in enumerate(infos):
            query = (f"prefill_dp_rank={dp}&prefill_cp_rank={cp}&target_tp_rank={ranks[i // stages]}"
                     f"&target_pp_rank={info.get('pp_rank', 0)}")
            found.append((query, info))
    return found


def prefill_restarted(bootstrap_addr: str, cached: List[Tuple[str, dict]]) -> bool:
    """True if the bootstrap server places a cached rank at another endpoint now. An
    answer that is not a rank (the restarted server's ranks not registered yet, or any
    error) says nothing: the next heartbeat asks again."""
    for query, info in cached:
        try:
            response = requests.get(f"http://{bootstrap_addr}/route?{query}", timeout=ROUTE_TIMEOUT_S)
            now = response.json() if response.status_code == 200 else None
        except (requests.RequestException, ValueError):
            continue
        if not isinstance(now, dict) or "rank_port" not in now:
            continue
        if (str(now.get("rank_ip")), str(now["rank_port"])) != (str(info.get("rank_ip")),
                                                               str(info.get("rank_port"))):
            log.warning("prefill server %s restarted: its rank moved from %s:%s to %s:%s",
                        bootstrap_addr, info.get("rank_ip"), info.get("rank_port"),
                        now.get("rank_ip"), now["rank_port"])
            return True
    return False


class PrefillRestartWatch:
    """Decode: mixed in before SGLang's ``CommonKVManager``, whose heartbeat calls these."""

    def _handle_node_failure(self, failed_bootstrap_addr: str) -> None:
        """Decode: a prefill server's bootstrap stopped answering SGLang's heartbeat
        (or its ranks moved: a restart between two heartbeats).
        SGLang's own handling drops its cached connection details (a restarted prefill
        server gets its new ports looked up) and fails its rooms at once; here its rooms
        are taken out first, so each ends with the connector's outcome instead (its
        lease, or the fence once that prefill began it): the prefill may be cut off,
        not dead, and its writes could still land in pages failed at once."""
        with self.connection_lock:
            kept = self.addr_to_rooms_tracker.pop(failed_bootstrap_addr, set())
        log.warning("prefill server %s stopped answering: its %d rooms end with their transfers' "
                    "outcome", failed_bootstrap_addr, len(kept))
        super()._handle_node_failure(failed_bootstrap_addr)

    def _on_heartbeat_success(self, bootstrap_addr: str) -> None:
        """Decode: a prefill restarted between two heartbeats (this module's docstring)."""
        mapping = self.prefill_info_table.get(bootstrap_addr)
        with self.connection_lock:
            cached = cached_endpoints(self.connection_pool, bootstrap_addr,
                                      mapping.target_tp_ranks if mapping else None)
        if cached and prefill_restarted(bootstrap_addr, cached):
            self.counts.add("kvops_sglang_prefill_restarts")
            self._handle_node_failure(bootstrap_addr)

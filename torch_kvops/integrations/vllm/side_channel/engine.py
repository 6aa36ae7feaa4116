"""How the engine's schedulers start the side channel from their settings, and turn
its cumulative counters into per-interval metrics (metrics.py)."""
from __future__ import annotations

import errno
import logging
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Tuple, Union

from ....addresses import endpoint
from ..metrics import SIDE_CHANNEL_PREFIX
from .auth import warn_unauthenticated
from .bootstrap import BootstrapServer, bootstrap_address, rank_entry
from .dp_rank import RankRegistration, side_channel_port
from .poster import DestinationPoster
from .server import DestinationServer

if TYPE_CHECKING:
    from ..metadata import KvopsSettings

log = logging.getLogger(__name__)


def start_prefill_endpoints(settings: "KvopsSettings", tp_size: int, engine_id: str, dp_rank: int = 0
                            ) -> Tuple[DestinationServer, Union[BootstrapServer, RankRegistration, None]]:
    """P: the side channel and (unless ``bootstrap_endpoint`` is off) the bootstrap
    endpoint, or, on DP rank ``dp_rank`` >= 1, the registration of this rank's side
    channel with rank 0's endpoint (dp_rank.py). The default bootstrap port (8998) taken
    by another process is logged as an error and P starts without it; a configured
    address that cannot be bound stops P."""
    auth, tls = settings.side_channel_security()
    where = settings.side_channel_endpoint()
    port = side_channel_port(settings.side_channel_port, dp_rank)
    try:
        server = DestinationServer(where.bind, port, facts={"prefill_tp": tp_size},
                                   auth=auth, tls=tls, max_connections=settings.side_channel_max_connections,
                                   advertise=where.advertise)
    except OSError as exc:
        raise OSError(exc.errno, f"kvops: P's side channel cannot listen on {where.bind}:{port} "
                                 f"({exc.strerror}); set side_channel_port (0: a free port, which GET "
                                 "/query names; DP rank r takes side_channel_port + r) or "
                                 "$KVOPS_SIDE_CHANNEL_PORT to run more than one prefill instance on a "
                                 "host") from exc
    if auth is None:
        warn_unauthenticated(
            f"P's side channel at {server.address} accepts destinations from anyone who can reach "
            "it (they choose where P pushes a request's KV), and D's peer_info, with the control "
            f"channel's secret, crosses it{'' if tls else ' in clear'}")
    if not settings.bootstrap_endpoint:
        return server, None
    entry = rank_entry(engine_id or "kvops-prefill", server.address, tp_size, signed=auth is not None,
                       tls=tls is not None)
    try:
        host, bootstrap_port = bootstrap_address(settings.bootstrap_server_address, where.bind)
        if dp_rank > 0:
            # where rank 0's endpoint is reached: an unspecified bind at the host's address
            return server, RankRegistration(endpoint(host).advertise, bootstrap_port, dp_rank, entry, auth)
        bootstrap = BootstrapServer(host, bootstrap_port, entry, auth=auth)
    except OSError as exc:
        if settings.bootstrap_server_address or exc.errno != errno.EADDRINUSE:
            server.close()
            raise
        log.error("kvops: bootstrap endpoint not started: port %d is in use (%s). Routers that "
                  "poll GET /query (vllm-router --kv-connector mooncake) will not come up: set "
                  "bootstrap_server_address or $VLLM_MOONCAKE_BOOTSTRAP_PORT", bootstrap_port, exc)
        return server, None
    except BaseException:
        server.close()
        raise
    return server, bootstrap


def start_poster(settings: "KvopsSettings", on_result: Callable[[str, Optional[dict]], None],
                 on_pending: Optional[Callable[[str, Optional[List[str]], bool], None]] = None,
                 probe_timeout_s: Optional[float] = None) -> DestinationPoster:
    """D: the poster, signing and TLS from the settings."""
    auth, tls = settings.side_channel_security()
    if auth is None:
        warn_unauthenticated("D posts its destinations unsigned and believes any answer, and its "
                             "peer_info, with the control channel's secret, crosses the side "
                             f"channel{'' if tls else ' in clear'}")
    return DestinationPoster(on_result, settings.post_timeout_s, settings.post_retries,
                             auth=auth, tls=tls, on_pending=on_pending,
                             probe_timeout_s=probe_timeout_s)


class SideChannelCounts:
    """Cumulative side-channel counters -> per-interval ``side_channel_<event>`` counts."""

    def __init__(self) -> None:
        self._last: Dict[str, int] = {}

    def update(self, counts, snapshot: Dict[str, int], prefix: str) -> None:
        """Add each counter's growth since the last call to ``counts`` (has ``count``)."""
        for key, value in snapshot.items():
            delta = value - self._last.get(key, 0)
            self._last[key] = value
            if delta:
                counts.count(f"{SIDE_CHANNEL_PREFIX}{prefix}{key}", delta)

"""The proxy's view of its P and D instances: least-loaded choice, in-flight counts,
instances marked down for a while after a failure."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence


@dataclass
class Instance:
    """One vLLM API server behind the proxy."""

    url: str
    side_channel: Optional[str] = None  # P only: host:port D posts its destinations to
    in_flight: int = 0
    down_until: float = 0.0
    requests: int = 0
    failures: int = 0

    def is_up(self, now: float) -> bool:
        return now >= self.down_until


class Pool:
    """Instances of one role. :meth:`pick` takes the one with the fewest requests in
    flight among those not marked down (ties: the one picked least recently), or the
    least recently failed one when all are down."""

    def __init__(self, role: str, instances: Sequence[Instance], down_s: float) -> None:
        if not instances:
            raise ValueError(f"no {role} instance")
        self.role = role
        self.instances: List[Instance] = list(instances)
        self.down_s = down_s
        self._last_pick: Dict[str, int] = {i.url: 0 for i in self.instances}
        self._picks = 0

    def pick(self, exclude: Sequence[Instance] = ()) -> Optional[Instance]:
        """An instance not in ``exclude`` (None if every one is excluded)."""
        now = time.monotonic()
        candidates = [i for i in self.instances if i not in exclude]
        if not candidates:
            return None
        up = [i for i in candidates if i.is_up(now)]
        if up:
            chosen = min(up, key=lambda i: (i.in_flight, self._last_pick[i.url]))
        else:  # all down: try the one whose mark ends first rather than fail outright
            chosen = min(candidates, key=lambda i: i.down_until)
        self._picks += 1
        self._last_pick[chosen.url] = self._picks
        return chosen

    def mark_down(self, instance: Instance) -> None:
        instance.failures += 1
        instance.down_until = time.monotonic() + self.down_s

    def mark_up(self, instance: Instance) -> None:
        instance.down_until = 0.0


def parse_instances(urls: str, side_channels: Optional[str] = None) -> List[Instance]:
    """``URL[,URL...]`` (and for P the matching ``HOST:PORT[,...]``) as instances."""
    url_list = [u.strip().rstrip("/") for u in urls.split(",") if u.strip()]
    if not url_list:
        raise ValueError(f"no URL in {urls!r}")
    if side_channels is None:
        return [Instance(u) for u in url_list]
    channels = [c.strip() for c in side_channels.split(",") if c.strip()]
    if len(channels) != len(url_list):
        raise ValueError(f"{len(url_list)} prefill URLs but {len(channels)} side channels")
    for c in channels:
        host, _, port = c.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"side channel {c!r} is not HOST:PORT")
    return [Instance(u, c) for u, c in zip(url_list, channels)]

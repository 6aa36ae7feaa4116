"""Layer-wise KV transfer between a producer (prefill) and consumers (decode).

One module per job, data flowing one way:

- ``config``: :class:`ConnectorConfig` (every timeout and retry bound) and the protocol version.
- ``ledger``: which requests are in flight and the once-only report of their outcomes; counters.
- ``producer``: the send path: steps, the sender thread that waits on each layer's event.
- ``peer``: the producer's link to one consumer: control channel, writes with retries, staging.
- ``consumer``: the receive path: control server, leases, staging scatter, completion.
- ``layerwise``: :class:`LayerwiseConnector`, the public API over both roles.
"""
from .config import PROTOCOL_VERSION, ConnectorConfig
from .layerwise import LayerwiseConnector

__all__ = ["ConnectorConfig", "LayerwiseConnector", "PROTOCOL_VERSION"]

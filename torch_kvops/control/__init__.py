"""Side channel for step notices between a producer and a consumer.

Data moves one-sided through the transport; this channel carries the notices about it:
``hello``/``challenge``/``auth``/``welcome`` (mutual authentication, staging grant),
``begin`` (answered: requests the consumer no longer accepts), ``scatter``/``ack``
(staging slots), ``chunk`` (a chunk of a request landed; ``last`` on its final chunk)
and ``failed``. A notice about data is sent strictly after the transport write it
describes returned, and one connection keeps notices in order, so the consumer never
hears "done" before the bytes are there.

Trust: each consumer has a random secret that travels only inside its ``peer_info``
(which the engine hands to the producer over its own channel), or, with a fleet key,
a secret derived from the key and the consumer's engine id (:func:`derived_secret`)
that never travels at all. A connection proves it
knows the secret before anything else it sends is read, and the consumer proves it
too (challenge-response with HMAC-SHA256 over fresh random nonces from both sides, see
:func:`proof`). The secret itself never crosses this channel and is never logged.

Messages are newline-delimited JSON with a size bound; a line over the bound, bad
JSON, a message that is not an object, or anything but the handshake before it
completes drops only that connection. Every socket call has a timeout. A broken
connection is a failed peer, never silently reconnected: notices (and staging acks)
sent on the old connection could otherwise be lost without anyone noticing.

The package: protocol.py (line bounds, secrets, the proof), server.py (consumer side),
client.py (producer side).
"""
from .client import ControlClient
from .protocol import (DEFAULT_MAX_LINE, MAX_HANDSHAKE_LINE, MAX_PENDING_HANDSHAKES, ProtocolError,
                       derived_secret, new_secret, proof)
from .server import ControlServer, Session

__all__ = ["ControlClient", "ControlServer", "DEFAULT_MAX_LINE", "MAX_HANDSHAKE_LINE",
           "MAX_PENDING_HANDSHAKES", "ProtocolError", "Session", "derived_secret", "new_secret",
           "proof"]

"""Decode -> prefill side channel: the decode scheduler posts, for each request it
allocated blocks for, ``{transfer_id, block_ids, start_token, peers}`` (``peers``: the
decode engine's per-rank peer_info) to a small TCP endpoint of the prefill scheduler.

One JSON line per connection, answered with one line: ``{"ok": true, ...}`` carrying
the prefill engine's facts the decode side needs (its tensor-parallel size), or a
refusal word (``bad``, ``full``, ``unsigned``, ...). With a fleet key (auth.py) both
lines are signed envelopes; with TLS files, the connection is mutual TLS.

- server.py: P's endpoint (concurrent connections, a total deadline per message,
  bounded connections, message size and table; refusals counted by cause);
- poster.py: D's posters (one worker per prefill address: a slow or dead P delays only
  its own requests; addresses validated; ``http://`` bootstrap addresses resolved);
- bootstrap.py: P's ``GET /query`` endpoint (vLLM's MooncakeConnector format);
- auth.py: fleet key, signed envelopes, derived control-channel secrets, TLS files.
"""
from ....control.fleet_key import FLEET_KEY_ENV, load_fleet_key
from .auth import AuthError, FleetAuth, TlsFiles, control_secret, tls_files, warn_unauthenticated
from .bootstrap import BOOTSTRAP_PORT_ENV, DEFAULT_BOOTSTRAP_PORT, BootstrapServer, bootstrap_address
from .poster import DestinationPoster, parse_address
from .server import MAX_MESSAGE_BYTES, REFUSALS, DestinationServer, parse_destination

__all__ = ["AuthError", "BOOTSTRAP_PORT_ENV", "BootstrapServer", "DEFAULT_BOOTSTRAP_PORT",
           "DestinationPoster", "DestinationServer", "FLEET_KEY_ENV", "FleetAuth",
           "MAX_MESSAGE_BYTES", "REFUSALS", "TlsFiles", "bootstrap_address", "control_secret",
           "load_fleet_key", "parse_address", "parse_destination", "tls_files",
           "warn_unauthenticated"]

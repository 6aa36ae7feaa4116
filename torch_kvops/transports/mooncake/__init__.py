"""Mooncake transfer engine transport (``mooncake.engine.TransferEngine``).

Peer-to-peer mode (no metadata server; a peer is ``"host:rpc_port"``). See
docs/mooncake-notes.md for the measured numbers and failure behaviours behind the
choices. One module per job:

* :mod:`.engine` - loading Mooncake, starting and initialising the engine (TCP forced
  when TCP is asked for, RDMA confirmed when RDMA is), the slot holding it;
  :mod:`.engine_log` - ``KVOPS_MOONCAKE_LOG`` and the filter of Mooncake's start-up log.
* :mod:`.regions` - memory registration and the index of registered regions;
  :mod:`.descriptors` - validating, merging and cutting a write's descriptors against it.
* :mod:`.handshake` - the handshake with a new peer on a helper thread, port probes.
* :mod:`.write` - the write loop (bounded window, polling) and the classification of a
  failure (probe and one re-send); :mod:`.pins` - regions that transfers still read and
  the transfers failed writes left behind.
* :mod:`.transport` - ``MooncakeTransport``, which composes them and owns ``close()``.

Importing this package does not need Mooncake; constructing a ``MooncakeTransport``
without it raises ImportError with :data:`MOONCAKE_INSTALL_HINT`.
"""
from .engine import MOONCAKE_INSTALL_HINT
from .engine_log import BENIGN_START_LINES, LOG_SWITCH_ENV
from .transport import MooncakeTransport

__all__ = ["BENIGN_START_LINES", "LOG_SWITCH_ENV", "MOONCAKE_INSTALL_HINT", "MooncakeTransport"]

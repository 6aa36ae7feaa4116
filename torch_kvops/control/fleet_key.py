"""The fleet key: one secret file shared by every engine of a P/D fleet (vLLM's and
SGLang's adapters alike). Producers derive each consumer's control-channel secret
from it (:func:`~torch_kvops.control.protocol.derived_secret`), so no secret crosses
the wire; each adapter also signs its own engine-to-engine messages with it."""
from __future__ import annotations

import os
from typing import Optional

FLEET_KEY_ENV = "KVOPS_FLEET_KEY_FILE"
MIN_KEY_BYTES = 32


def load_fleet_key(path: Optional[str]) -> Optional[bytes]:
    """The fleet key from ``path``, else from the file ``$KVOPS_FLEET_KEY_FILE`` names,
    else None. A key shorter than 32 bytes, or a file others can read, is refused."""
    path = path or os.environ.get(FLEET_KEY_ENV) or None
    if path is None:
        return None
    with open(path, "rb") as f:
        key = f.read().strip()
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"fleet key file {path!r} holds {len(key)} bytes; at least "
                         f"{MIN_KEY_BYTES} random bytes are needed (e.g. `head -c 32 /dev/urandom "
                         "| xxd -p -c 64 > fleet.key`)")
    mode = os.stat(path).st_mode
    if mode & 0o077:
        raise ValueError(f"fleet key file {path!r} is readable by group or others "
                         f"(mode {oct(mode & 0o777)}): chmod 600 it")
    return key

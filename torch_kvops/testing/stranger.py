"""A stranger on the network (tests only): a bare Mooncake engine in its own process
that completes Mooncake's unauthenticated handshake with a peer and tries to read
``length`` bytes at ``ptr`` of it, as anyone who reaches the peer's port could.

``python -m torch_kvops.testing.stranger HOST:PORT PTR LENGTH`` prints one JSON line:
``{"rc": <Mooncake's return code>, "data": <hex of the local buffer after the read>}``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Tuple


def read_from(address: str, ptr: int, length: int, timeout_s: float = 60.0) -> Tuple[int, bytes]:
    """Run the stranger against ``address``: (Mooncake's rc, the bytes it holds after)."""
    out = subprocess.run([sys.executable, "-m", "torch_kvops.testing.stranger", address, str(ptr),
                          str(length)], capture_output=True, text=True, timeout=timeout_s,
                         check=True)
    answer = json.loads(out.stdout.strip().splitlines()[-1])
    return answer["rc"], bytes.fromhex(answer["data"])


def main(argv) -> None:
    address, ptr, length = argv[0], int(argv[1]), int(argv[2])
    os.environ["MC_FORCE_TCP"] = "1"
    import ctypes

    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize("127.0.0.1" if address.startswith("127.") else "0.0.0.0",
                         "P2PHANDSHAKE", "tcp", "") != 0:
        raise SystemExit("Mooncake initialize failed")
    buf = ctypes.create_string_buffer(length)  # zeros
    engine.register_memory(ctypes.addressof(buf), length)
    rc = engine.transfer_sync_read(address, ctypes.addressof(buf), ptr, length)
    print(json.dumps({"rc": rc, "data": buf.raw.hex()}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

"""End-to-end integrity check of pushed KV blocks (``ConnectorConfig.integrity_check``).

Per layer, the producer digests every block it pushed (on a worker thread, while the
sender writes the next layer: digest_pipeline.py) and sends the layer's digests in a
``digests`` notice once the layer's bytes landed; the consumer recomputes them over
the blocks as they sit in its own caches, as each notice arrives (on its verifier
thread, while later layers are still on the wire), and fails the request on the first
mismatch, or when a chunk lands without the digests of every layer. A block cut by a
chunk boundary is pushed again, whole, with the next chunk, and verified again.

Two modes (docs/connector.md), each a 16-byte digest per block and layer:

- ``checksum``: four CRC-32C lanes over the block's quarters, seeded by the layer, in
  the native op ``torch.ops.kvops.block_digests`` (SSE4.2, blocks in parallel, the GIL
  released). Catches accidents: bytes corrupted, lost or written to the wrong place.
  Anyone who knows the bytes can compute it: it does not protect against a writer who
  also changes the digests.
- ``mac``: keyed BLAKE3 (``blake3`` wheel; releases the GIL from 2 KiB inputs), one key
  per layer derived from the consumer's control-channel secret, which only producers
  that passed the handshake know: a match also proves that nobody else wrote into
  those blocks over Mooncake's unauthenticated data plane between the producer's
  write and the consumer's verification of that layer.

Host (CPU) caches only: device caches would need a device-to-host read of every block
on the consumer (refused at registration).
"""
from __future__ import annotations

import hashlib
from typing import Optional, Sequence

import numpy as np
import torch

from .config import INTEGRITY_MODES, integrity_mode

DIGEST_BYTES = 16

__all__ = ["DIGEST_BYTES", "BlockDigester", "ChecksumDigester", "MacDigester", "integrity_key",
           "make_digester", "stronger_mode"]


def integrity_key(secret: str) -> bytes:
    """The MAC key both sides derive from the consumer's secret (never the secret itself)."""
    return hashlib.blake2b(secret.encode(), digest_size=32, person=b"kvops-integrity").digest()


def stronger_mode(a: str, b: str) -> str:
    """The stronger of two integrity modes ("off" < "checksum" < "mac")."""
    return max(integrity_mode(a), integrity_mode(b), key=INTEGRITY_MODES.index)


def _check_host(caches: Sequence[torch.Tensor]) -> None:
    for i, cache in enumerate(caches):
        if cache.device.type != "cpu":
            raise ValueError(f"integrity_check needs host (CPU) KV caches; layer {i} is on "
                             f"{cache.device}")


class BlockDigester:
    """Per-block, per-layer digests over the caches of one side (one tensor per layer,
    dim 0 = block, each block contiguous). ``id_bases``: per layer, the id of its block
    0 (block spaces, ``KVLayout.of``); ids are global, as requests name them."""

    mode = "off"

    def __init__(self, caches: Sequence[torch.Tensor], id_bases: Optional[Sequence[int]] = None) -> None:
        _check_host(caches)
        self._caches = list(caches)
        self._id_bases = list(id_bases) if id_bases is not None and any(id_bases) else None

    @property
    def num_layers(self) -> int:
        return len(self._caches)

    def layer_digests(self, layer: int, blocks: np.ndarray) -> bytes:
        """``DIGEST_BYTES`` per block of ``layer``, concatenated in the order given."""
        if self._id_bases is not None:
            blocks = np.asarray(blocks, dtype=np.int64) - self._id_bases[layer]
        return self._digests(layer, blocks)

    def _digests(self, layer: int, blocks: np.ndarray) -> bytes:
        """As ``layer_digests``, of the layer's own block indices."""
        raise NotImplementedError


class ChecksumDigester(BlockDigester):
    """``checksum``: the native CRC-32C op, all blocks of a layer in one call."""

    mode = "checksum"

    def _digests(self, layer: int, blocks: np.ndarray) -> bytes:
        ids = torch.from_numpy(np.ascontiguousarray(blocks, dtype=np.int64))
        return torch.ops.kvops.block_digests(self._caches[layer], ids, layer).numpy().tobytes()


class MacDigester(BlockDigester):
    """``mac``: keyed BLAKE3, one key per layer (a block's bytes cannot pass for
    another layer's)."""

    mode = "mac"

    def __init__(self, caches: Sequence[torch.Tensor], key: bytes,
                 id_bases: Optional[Sequence[int]] = None) -> None:
        super().__init__(caches, id_bases)
        try:
            import blake3  # a dependency of the "mac" mode only
        except ImportError as exc:
            raise ImportError("integrity_check='mac' needs the blake3 package "
                              "(pip install 'torch_kvops[integrity]')") from exc

        self._blake3 = blake3.blake3
        self._layer_keys = [blake3.blake3(b"kvops layer %d" % i, key=key).digest()
                            for i in range(len(caches))]
        # Byte views, made once: hashing a block is then one slice and one C call.
        self._bytes = [cache.view(-1).view(torch.uint8).view(cache.size(0), -1).numpy()
                       if cache.is_contiguous() else None for cache in caches]

    def _block(self, layer: int, block: int):
        flat = self._bytes[layer]
        if flat is not None:
            return flat[block]
        return self._caches[layer][block].contiguous().view(torch.uint8).numpy()

    def _digests(self, layer: int, blocks: np.ndarray) -> bytes:
        key, h = self._layer_keys[layer], self._blake3
        return b"".join(h(self._block(layer, int(b)), key=key).digest(DIGEST_BYTES) for b in blocks)


def make_digester(mode: str, caches: Sequence[torch.Tensor], secret: str,
                  id_bases: Optional[Sequence[int]] = None) -> Optional[BlockDigester]:
    """The digester of ``mode`` over ``caches`` (None for "off"); ``secret`` keys "mac";
    ``id_bases`` as ``BlockDigester``'s."""
    mode = integrity_mode(mode)
    if mode == "checksum":
        return ChecksumDigester(caches, id_bases)
    if mode == "mac":
        return MacDigester(caches, integrity_key(secret), id_bases)
    return None

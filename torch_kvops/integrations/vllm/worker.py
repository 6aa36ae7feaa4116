"""Worker side: registers vLLM's KV caches with a LayerwiseConnector and drives it
from vLLM's hooks. The role-specific work is in worker_producer.py (bind_connector_metadata
-> start_step, save_kv_layer -> the layer-wise push ops, wait_for_save, finished_sending)
and worker_consumer.py (expect, finished_recving, load errors)."""
from __future__ import annotations

import logging
import re
from typing import Dict, List, Optional, Set, Tuple

import torch

from ...connector import LayerwiseConnector
from ...transports import MooncakeTransport
from .metadata import KvopsConnectorMetadata, KvopsSettings
from .kv_layout import HEAD_MAJOR, in_physical_order
from .metrics import KvopsConnectorStats, StatsCollector
from ...heads import rank_heads

log = logging.getLogger(__name__)

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def _layer_index(name: str) -> int:
    found = _LAYER_INDEX.findall(name)
    if len(found) != 1:
        raise ValueError(f"cannot tell the layer index of KV cache {name!r}")
    return int(found[0])


def block_views(name: str, cache: torch.Tensor, num_blocks: int,
                local_heads: Optional[int] = None) -> List[torch.Tensor]:
    """Views of one layer's cache with dim 0 = transfer unit and contiguous units, which
    is what LayerwiseConnector moves.

    Supported: ``[num_blocks, kv_heads, ...]`` contiguous (vLLM's CPU backend:
    ``[num_blocks, kv_heads, block_size, 2 * head_size]``), moved by KV head of a block
    (``[num_blocks * kv_heads, ...]``, tp.py) when ``local_heads`` names dim 1; and
    ``[num_blocks, ...]`` or ``[2, num_blocks, ...]`` (K and V planes, e.g. the
    flash-attention layout) with contiguous blocks, moved by whole blocks (equal
    tensor parallelism only: a head range of a block is not contiguous there)."""
    if (local_heads is not None and cache.dim() >= 3 and cache.size(0) == num_blocks
            and cache.size(1) == local_heads and cache.is_contiguous()):
        return [cache.view(num_blocks * local_heads, *cache.shape[2:])]
    if cache.dim() >= 2 and cache.size(0) == num_blocks and cache[0].is_contiguous():
        return [cache]
    if (cache.dim() >= 3 and cache.size(0) == 2 and cache.size(1) == num_blocks
            and cache[0, 0].is_contiguous() and cache[1, 0].is_contiguous()):
        return [cache[0], cache[1]]
    raise ValueError(
        f"KV cache {name!r}: unsupported layout shape={tuple(cache.shape)} "
        f"stride={cache.stride()} for {num_blocks} blocks; KvopsLayerwiseConnector needs "
        "[num_blocks, ...] or [2, num_blocks, ...] with each block contiguous")


class KvopsWorker:
    """What both roles share, one per worker process (one per tensor-parallel rank):
    the transport and LayerwiseConnector, the cache views it moves, metrics.
    ``total_kv_heads`` is the model's, ``tp_rank``/``tp_size`` this engine's; ``latent``:
    an MLA model, whose cache (one latent per token, the same on every rank) moves by
    whole blocks, each prefill rank sending its share of them (tp.py)."""

    role = ""  # "producer" (P) or "consumer" (D), set by the subclass
    kv_cache_layout: Optional[str] = None  # vLLM's, set at registration (kv_layout.py)

    def __init__(self, settings: KvopsSettings, num_blocks: int, total_kv_heads: int = 1,
                 tp_rank: int = 0, tp_size: int = 1, latent: bool = False) -> None:
        self.settings, self.num_blocks = settings, num_blocks
        self.total_kv_heads, self.tp_rank, self.tp_size = total_kv_heads, tp_rank, tp_size
        self.latent = latent
        self.heads = rank_heads(1 if latent else total_kv_heads, tp_size, tp_rank)
        self._by_head = False  # units are heads of blocks (tp.py), else whole blocks
        self.transport = MooncakeTransport(host=settings.data_endpoint().advertise, protocol=settings.protocol,
                                           device_name=settings.device_name)
        try:
            self.conn = LayerwiseConnector(self.role, self.transport, settings.connector_config(),
                                           fleet_key=settings.fleet_key(),
                                           control_tls=settings.side_channel_security()[1])
        except BaseException:
            self.transport.close()
            raise
        self._views: Dict[str, List[Tuple[int, torch.Tensor]]] = {}
        self._all_views: List[Tuple[int, torch.Tensor]] = []
        self.metrics = StatsCollector(self.role)
        self._idle_step = False

    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor],
                           kv_cache_layout: Optional[str] = None) -> None:
        """Register vLLM's caches, laid out as ``kv_cache_layout`` says (vLLM's resolved
        ``cache_config.kv_cache_layout``; None where it resolved none)."""
        caches = []
        self.kv_cache_layout = kv_cache_layout
        if not self.latent:
            kv_caches = {name: in_physical_order(name, cache, self.kv_cache_layout)
                         for name, cache in kv_caches.items()}
        first = kv_caches[min(kv_caches, key=_layer_index)]
        if self.latent and not (first.dim() >= 2 and first.size(0) == self.num_blocks
                                and first[0].is_contiguous()):
            raise ValueError(f"MLA KV cache layout shape={tuple(first.shape)} stride={first.stride()}: "
                             "KvopsLayerwiseConnector needs [num_blocks, block_size, latent] with "
                             "each block contiguous")
        head_major = self.kv_cache_layout in (None, HEAD_MAJOR)  # None: vLLM resolved none
        self._by_head = (not self.latent and head_major and first.dim() >= 3
                         and first.size(0) == self.num_blocks and first.size(1) == len(self.heads)
                         and first.is_contiguous())
        if not self._by_head and not self.latent and self.tp_size > 1:
            raise ValueError(f"KV cache layout {self.kv_cache_layout or 'unresolved'} shape="
                             f"{tuple(first.shape)}: tensor parallelism needs vLLM's {HEAD_MAJOR} "
                             "layout ([num_blocks, kv_heads, ...] with contiguous blocks: a head range "
                             "of a block must be contiguous to move it between ranks); the connector "
                             "asks vLLM for it, and an attention backend that cannot use it "
                             "made vLLM pick another")
        for name in sorted(kv_caches, key=_layer_index):
            views = block_views(name, kv_caches[name], self.num_blocks,
                                len(self.heads) if self._by_head else None)
            self._views[name] = [(len(caches) + i, v) for i, v in enumerate(views)]
            caches.extend(views)
        self._all_views = [iv for name in self._views for iv in self._views[name]]
        self.conn.register_kv_caches(caches)
        log.info("kvops %s: %d attention layers as %d caches of %s (vLLM layout %s, %s)", self.role,
                 len(kv_caches), len(caches), tuple(caches[0].shape), self.kv_cache_layout,
                 "by head" if self._by_head else "by block")

    # ------------------------------------------------------------------ per step (the roles')

    def begin_step(self, meta: KvopsConnectorMetadata) -> None:
        """The step's transfer work, before its forward (bind_connector_metadata)."""
        raise NotImplementedError

    def bind(self, meta: KvopsConnectorMetadata) -> None:
        """The step's metadata, before its forward (bind_connector_metadata)."""
        self._idle_step = meta.idle and not (meta.push or meta.recv or meta.release)
        self.begin_step(meta)

    def wait_if_idle(self) -> None:
        """Before get_finished: in a step with nothing to compute or start, wait up to
        ``idle_step_wait_s`` for an in-flight transfer to end (at once if none is)."""
        if self._idle_step:
            self.conn.wait_for_finished(self.settings.idle_step_wait_s)

    def save_kv_layer(self, layer_name: str) -> None:
        """After a layer's KV write: a producer pushes it."""

    def wait_for_save(self) -> None:
        """After the forward: a producer waits for the step's pushes."""

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Set[str], Set[str], Set[str]]:
        """(finished_sending, finished_recving, failed_recving) as vLLM request ids."""
        raise NotImplementedError

    def get_block_ids_with_load_errors(self) -> Set[int]:
        """Blocks a transfer that failed part-way did not fill (consumer)."""
        return set()

    def recent_steps(self, transfer_id: Optional[str] = None) -> List[dict]:
        """Timings of recent push steps (producer)."""
        return []

    def connector_stats(self) -> Optional[KvopsConnectorStats]:
        """This interval's metrics (None if nothing happened): metrics.py."""
        return self.metrics.take(self.conn.stats)

    def close(self) -> None:
        try:
            self.conn.close()
        finally:
            self.transport.close()

"""``KvopsOffloadingSpec``: the spec vLLM's ``OffloadingConnector`` loads with

    {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
     "kv_connector_extra_config": {"spec_name": "KvopsOffloadingSpec",
                                   "spec_module_path": "torch_kvops.integrations.vllm.offload",
                                   "cpu_bytes_to_use": N}}

Scheduler side: vLLM's ``CPUOffloadingManager`` (LRU/ARC), sized exactly as
``CPUOffloadingSpec`` sizes it. Worker side: :class:`KvopsOffloadingWorker`, which
runs on the CPU, CUDA and Ascend NPU (vLLM's own worker needs CUDA or XPU).
"""
from __future__ import annotations

import dataclasses
import mmap
from typing import Any, Mapping, Optional

from vllm.platforms import current_platform
from vllm.utils.math_utils import round_up
from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingWorker
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from ....offload import GroupRef, OffloadConfigError, build_host_tier
from .worker import KvopsOffloadingWorker

SIZE_KEYS = ("cpu_bytes_to_use", "num_cpu_blocks")


class KvopsOffloadingSpec(CPUOffloadingSpec):
    """Offloads KV blocks to a host-memory tier through ``swap_blocks_batch``.

    ``kv_connector_extra_config`` takes the size of the tier as either
    ``cpu_bytes_to_use`` (bytes, as vLLM's ``CPUOffloadingSpec``) or ``num_cpu_blocks``
    (host chunks of ``blocks_per_chunk`` engine blocks, as vllm-ascend's
    ``NPUOffloadingSpec``), plus the ``CPUOffloadingSpec`` keys (``blocks_per_chunk``
    or ``block_size``, ``eviction_policy``, ``store_threshold``, ...). A missing or
    bad size, a tier too small for one chunk, ``canonical_layout``, or engine KV
    tensors the worker cannot address fail at start-up with a message naming the
    setting.
    """

    def __init__(self, config: OffloadingConfig):
        super().__init__(_with_tier_bytes(config))
        if self.config.canonical_layout:
            raise OffloadConfigError(
                "KvopsOffloadingSpec does not support kv_connector_extra_config "
                "'canonical_layout': its host tier keeps each worker's pages as they are")
        if self.config.worker_kv_bytes_per_block > 0 and self.num_chunks < 1:
            raise OffloadConfigError(
                f"KvopsOffloadingSpec: kv_connector_extra_config 'cpu_bytes_to_use' = "
                f"{self.extra_config['cpu_bytes_to_use']} holds no chunk: one chunk of "
                f"{self.blocks_per_chunk} blocks takes {_chunk_bytes(self.config)} bytes")
        self._kvops_worker: Optional[KvopsOffloadingWorker] = None

    def _uses_shared_region(self) -> bool:
        # CPUOffloadingSpec keeps one host copy per block (``replicated_layout``: an MLA
        # model with TP on one machine, mp executor, every rank's cache a replica) only
        # when the workers share their host buffer. Ours can on the CPU: the ranks map
        # one /dev/shm region and all address the slot of rank 0; vLLM's connector then
        # lets rank 0 alone store and every rank load. On devices each rank keeps a
        # private (pinned) tier and its own copy.
        return current_platform.is_cpu()

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._kvops_worker is None:
            groups = kv_caches.group_data_refs
            if len(groups) != len(self.config.groups):
                raise OffloadConfigError(
                    f"KvopsOffloadingSpec: the worker got KV tensors for {len(groups)} cache groups, "
                    f"the offloading config names {len(self.config.groups)}")
            region = self._shared_region() if self.replicated_layout and self.num_chunks > 0 else None
            try:
                # The refs' canonical mappings are not used: canonical_layout is refused above.
                tier = build_host_tier(
                    [t.tensor for t in kv_caches.tensors], [t.page_size_bytes for t in kv_caches.tensors],
                    [[GroupRef(r.tensor_idx, r.page_size_bytes) for r in refs] for refs in groups],
                    self.num_chunks, self.blocks_per_chunk,
                    host_rows=None if region is None else region.create_next_worker_view)
            except BaseException:
                if region is not None:
                    region.cleanup()
                raise
            if region is not None:
                tier.on_release.append(region.cleanup)
            self._kvops_worker = KvopsOffloadingWorker(tier)
        return self._kvops_worker


    def _shared_region(self):
        """The host tier every rank of this engine maps (replicated layout): one slot
        per chunk row, the slot of rank 0 for every rank (vLLM's layout and file,
        ``/dev/shm/vllm_offload_<engine_id>.mmap``, unlinked once every rank mapped it)."""
        from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
        from vllm.v1.kv_offload.cpu.spec import _all_workers_barrier

        return SharedOffloadRegion(engine_id=self.config.engine_id, num_chunks=self.num_chunks, rank=0,
                                   kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                                   cpu_page_size=self.cpu_page_size_per_worker, barrier=_all_workers_barrier)


def _chunk_bytes(config: OffloadingConfig) -> int:
    """Bytes of one host chunk across all workers, page-rounded (CPUOffloadingSpec's
    arithmetic: its ``num_chunks`` is ``cpu_bytes_to_use`` divided by this)."""
    copies = 1 if _single_copy(config) else max(config.parallel.world_size, 1)
    per_block = config.worker_kv_bytes_per_block * copies
    return round_up(per_block * config.cache.blocks_per_chunk, mmap.PAGESIZE)


def _single_copy(config: OffloadingConfig) -> bool:
    """One host copy per block for all ranks (KvopsOffloadingSpec._uses_shared_region)."""
    return bool(config.replicated_layout) and current_platform.is_cpu()


def _positive_int(extra: Mapping[str, Any], key: str) -> int:
    value = extra[key]
    try:
        number = int(value)
        exact = not isinstance(value, bool) and float(value) == number
    except (TypeError, ValueError):
        exact = False
    if not exact or number < 1:
        raise OffloadConfigError(f"KvopsOffloadingSpec: kv_connector_extra_config {key!r} must be "
                                 f"a positive integer, got {value!r}")
    return number


def _with_tier_bytes(config: OffloadingConfig) -> OffloadingConfig:
    """The config with ``cpu_bytes_to_use`` set: checked as given, or computed from
    ``num_cpu_blocks`` so that the manager gets exactly that many chunks."""
    extra = config.extra_config
    given = [k for k in SIZE_KEYS if extra.get(k) is not None]
    if len(given) != 1:
        raise OffloadConfigError(
            "KvopsOffloadingSpec: kv_connector_extra_config needs exactly one of "
            f"'cpu_bytes_to_use' (bytes of host memory) or 'num_cpu_blocks' (host chunks); got "
            f"{given or 'neither'}")
    value = _positive_int(extra, given[0])
    if given[0] == "cpu_bytes_to_use":
        num_bytes = value
    else:
        # a chunk of 0 bytes (no KV blocks at all) leaves the tier empty either way
        num_bytes = value * max(_chunk_bytes(config), 1)
    return dataclasses.replace(config, extra_config={**extra, "cpu_bytes_to_use": num_bytes})

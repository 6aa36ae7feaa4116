"""KvopsLayerwiseConnector: the KVConnectorBase_V1 subclass vLLM loads. It only
dispatches: scheduler-side calls go to scheduler.py, worker-side calls to worker.py."""
from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any, Dict, Optional, Set, Tuple

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorHandshakeMetadata, KVConnectorMetadata, KVConnectorRole,
    KVConnectorTransferResults)

from . import metrics
from .kv_layout import HEAD_MAJOR
from .metadata import KvopsConnectorMetadata, KvopsHandshake, KvopsSettings
from .scheduler import ConsumerScheduler, ProducerScheduler
from .tp import check_tp, merge_decode_peers
from .worker import KvopsWorker
from .worker_consumer import ConsumerWorker
from .worker_producer import ProducerWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics, KVConnectorStats, PromMetric, PromMetricT)
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

_ROLES = {"kv_producer": "producer", "kv_consumer": "consumer"}


def _kv_role_of(extra_config: Dict[str, Any]) -> Optional[str]:
    """The ``kv_role`` of the KVTransferConfig that holds this very ``extra_config``
    dict, or None. vLLM (0.32) asks requires_piecewise_for_cudagraph with the extra
    config alone, from a VllmConfig method; the role is on that VllmConfig's
    kv_transfer_config, found by identity in the calling frames (never by value: a
    MultiConnector's child config is another dict and gets None)."""
    frame = sys._getframe(1)
    for _ in range(6):
        if frame is None:
            break
        config = getattr(frame.f_locals.get("self"), "kv_transfer_config", None)
        if config is not None and getattr(config, "kv_connector_extra_config", None) is extra_config:
            return getattr(config, "kv_role", None)
        frame = frame.f_back
    return None


class KvopsLayerwiseConnector(KVConnectorBase_V1):
    """Layer-wise KV push from a prefill engine (``kv_role="kv_producer"``) into a
    decode engine (``kv_role="kv_consumer"``) over the Mooncake transfer engine.

    Settings come from ``kv_connector_extra_config`` (:class:`KvopsSettings`); the
    request pairing protocol is described in ``scheduler.py`` and docs/vllm.md.
    """

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig") -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        kv_role = self._kv_transfer_config.kv_role
        if kv_role not in _ROLES:
            raise ValueError(f"KvopsLayerwiseConnector needs kv_role kv_producer or kv_consumer, "
                             f"got {kv_role!r}")
        parallel = vllm_config.parallel_config
        if kv_role == "kv_producer" and parallel.local_engines_only and parallel.data_parallel_index > 0:
            # each rank is its own instance there: rank 0's endpoint may be on another host
            raise ValueError("KvopsLayerwiseConnector: a prefill rank under external or hybrid DP load "
                             "balancing is not supported in this version; run one `vllm serve "
                             "--data-parallel-size N` per host (internal load balancing), or each "
                             "rank as an instance of its own, without --data-parallel-rank")
        total_kv_heads = vllm_config.model_config.get_total_num_kv_heads()
        check_tp(total_kv_heads, parallel.tensor_parallel_size, vllm_config.model_config.use_mla,
                 parallel.pipeline_parallel_size)
        groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
        if len(groups) > 1:
            raise ValueError("KvopsLayerwiseConnector supports one KV cache group "
                             "(full attention models) in this version")
        self.settings = KvopsSettings.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        self.kv_role = _ROLES[kv_role]
        self._scheduler: Optional[ProducerScheduler | ConsumerScheduler] = None
        self._worker: Optional[KvopsWorker] = None
        if role == KVConnectorRole.SCHEDULER:
            block_size = vllm_config.cache_config.block_size
            # data_parallel_index: the DP rank, kept where vLLM runs dense-model ranks as DP=1
            self._scheduler = (ProducerScheduler(self.settings, block_size, parallel.tensor_parallel_size,
                                                 engine_id=self._kv_transfer_config.engine_id or "",
                                                 dp_rank=parallel.data_parallel_index)
                               if self.kv_role == "producer" else ConsumerScheduler(self.settings, block_size))
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            worker = ProducerWorker if self.kv_role == "producer" else ConsumerWorker
            self._worker = worker(self.settings, kv_cache_config.num_blocks, total_kv_heads,
                                  get_tensor_model_parallel_rank(), parallel.tensor_parallel_size,
                                  latent=vllm_config.model_config.use_mla)

    @property
    def side_channel_address(self) -> str:
        """Prefill scheduler: where decode instances post destinations."""
        if not isinstance(self._scheduler, ProducerScheduler):
            raise RuntimeError("only the prefill (kv_producer) scheduler has a side channel")
        return self._scheduler.server.address

    @property
    def requires_kv_delivery(self) -> bool:
        """Prefill: a preempted request's in-flight output is dropped and the request
        computed again, and its pushes start again with that recompute (scheduler.py).
        No ``handle_preemptions`` is needed: a step's pushes end before the step does,
        so none reads the blocks a preemption frees."""
        return self.kv_role == "producer"

    @classmethod
    def supports_sleep_mode(cls) -> bool:
        """vLLM 0.33: no. The caches stay registered with the transport (and peers may
        be writing into them), so vLLM must not release their memory while asleep."""
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: "VllmConfig") -> Optional[str]:
        """LBHNC (kv_layout.py): one KV head of one block contiguous, so unequal tensor
        parallelism moves head ranges. None for MLA (no head axis)."""
        if vllm_config.model_config is not None and vllm_config.model_config.use_mla:
            return None
        return HEAD_MAJOR

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: Dict[str, Any]) -> bool:
        """Only P: the push ops themselves are capturable, but vLLM calls save_kv_layer
        from Python around the attention op, which full CUDA graphs skip on replay. D's
        layer hooks do nothing, so D keeps vLLM's full decode graphs. Unsure of the
        role (see :func:`_kv_role_of`): piecewise, which is always correct."""
        return _kv_role_of(extra_config) != "kv_consumer"

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        # the layout vLLM resolved (and allocated the caches in) by now
        self._worker.register_kv_caches(kv_caches, self._vllm_config.cache_config.kv_cache_layout)

    def get_handshake_metadata(self) -> Optional[KVConnectorHandshakeMetadata]:
        if self._worker is None or self.kv_role != "consumer":
            return None
        return KvopsHandshake(peer_info=self._worker.peer_info())

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # vLLM 0.32 calls start_load_kv *after* launching the forward when no load is
        # synchronous, but the push plan must be in place before the first layer's
        # save_kv_layer: binding the metadata is the last hook before the forward.
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            assert isinstance(connector_metadata, KvopsConnectorMetadata)
            self._worker.bind(connector_metadata)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        return  # the step began in bind_connector_metadata; D receives pushes passively

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # D waits for whole requests (finished_recving), never per layer

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: "AttentionMetadata", **kwargs: Any) -> None:
        self._worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        self._worker.wait_for_save()

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: Set[str]) -> KVConnectorTransferResults:
        self._worker.wait_if_idle()
        sending, recving, failed = self._worker.get_finished(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> Set[int]:
        """Decode: blocks a transfer that failed part-way did not fill; the request was
        reported received in the same step, and vLLM recomputes from the first of these
        (with ``kv_load_failure_policy="recompute"``)."""
        return self._worker.get_block_ids_with_load_errors()

    def recent_steps(self, transfer_id: Optional[str] = None) -> list:
        """Worker side, prefill: per recent push step, the time the engine waited after
        its forward for the push (``exposed_after_forward_s``) and the last layer's
        transfer time; for benchmarks and debugging."""
        return self._worker.recent_steps(transfer_id) if self._worker is not None else []

    def stats(self) -> dict:
        """Worker side: the LayerwiseConnector's counters (bytes, layers, requests
        finished/failed, integrity failures, ...; docs/connector.md)."""
        return self._worker.conn.stats() if self._worker is not None else {}

    # ------------------------------------------------------------------ metrics (metrics.py)

    def get_kv_connector_stats(self) -> Optional["KVConnectorStats"]:
        if self._worker is not None:
            return self._worker.connector_stats()
        return self._scheduler.connector_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[Dict[str, Any]] = None) -> "KVConnectorStats":
        return metrics.build_stats(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig",
                           metric_types: Dict[type["PromMetric"], type["PromMetricT"]],
                           labelnames: list, per_engine_labelvalues: Dict[int, list]
                           ) -> "KVConnectorPromMetrics":
        return metrics.build_prom_metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # ------------------------------------------------------------------ scheduler side

    def bind_kv_cache_manager(self, kv_cache_manager: "KVCacheManager") -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._scheduler.kv_cache_manager = kv_cache_manager

    def set_xfer_handshake_metadata(self, metadata: Dict[int, KVConnectorHandshakeMetadata]) -> None:
        if isinstance(self._scheduler, ConsumerScheduler):
            # one per worker; pipeline parallelism is refused, so the ranks are TP ranks
            self._scheduler.peers = merge_decode_peers(
                {h.peer_info["tp_rank"]: h.peer_info for h in metadata.values()})

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int
                                   ) -> Tuple[Optional[int], bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        if isinstance(self._scheduler, ConsumerScheduler):
            self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = KvopsConnectorMetadata()
        meta.idle = scheduler_output.total_num_scheduled_tokens == 0
        self._scheduler.build_connector_meta(scheduler_output, meta)
        return meta

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request: "Request", block_ids: list
                         ) -> Tuple[bool, Optional[Dict[str, Any]]]:
        return self._scheduler.request_finished(request)

    def has_pending_push_work(self) -> bool:
        return isinstance(self._scheduler, ProducerScheduler) and self._scheduler.has_pending_push_work()

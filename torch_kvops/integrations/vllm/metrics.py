"""vLLM stats and Prometheus metrics of KvopsLayerwiseConnector.

vLLM 0.32 asks the worker-side connector for stats after every step
(``get_kv_connector_stats``), ships them to the frontend as ``KVConnectorStats.data``,
rebuilds them there with the connector class's ``build_kv_connector_stats`` (periodic
log line: ``reduce``) and hands the same data to the object ``build_prom_metrics``
returned (``observe``). Read them with ``LLM(..., disable_log_stats=False)`` and
``llm.get_metrics()``, or from the ``/metrics`` endpoint of ``vllm serve``.

What is counted (each engine counts its own role; the other role's metrics stay 0):

- prefill (P): bytes and layers pushed, per-layer transfer time (KV ready -> landed,
  one sample per layer and step), the transfer exposed after the forward (time P's
  engine waited in ``wait_for_save``, one sample per push step), staging waits (a layer
  waited for the decode side to free a staging slot) and their time, retries and
  transport errors;
- decode (D): bytes received;
- both: requests finished and failed, failures by cause, integrity failures (when
  the connector's integrity check counts them).

Collection stays off the push path: the per-layer samples come from the step trace the
sender thread records anyway, read once after the step, and the connector's counters
are read only after a step or an outcome (not on every decode step).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics, KVConnectorStats, PromMetric, PromMetricT)
from vllm.v1.metrics.utils import create_metric_per_engine

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# ConnectorStats counter -> stats key, per role. "failed_*" counters become causes.
_COUNTERS = {
    "producer": {"bytes_sent": "pushed_bytes", "layers_sent": "pushed_layers",
                 "steps": "push_steps", "retries": "retries", "transport_errors": "transport_errors",
                 "staged_writes": "staged_writes", "staging_waits": "staging_waits",
                 "staging_wait_s": "staging_wait_s", "write_lease_ended": "write_lease_ended",
                 "write_lease_renewals": "write_lease_renewals"},
    "consumer": {"bytes_sent": "received_bytes", "fenced": "fenced",
                 "revokes_acknowledged": "revokes_acknowledged",
                 "begin_blocks_refused": "misaddressed_begins"},
}
_BOTH = {"requests_finished": "requests_finished", "requests_failed": "requests_failed",
         "integrity_failures": "integrity_failures"}
# lists of samples (seconds)
SAMPLES = ("layer_transfer_s", "exposed_after_forward_s")
FAILURE_PREFIX = "failed_"  # failed_<cause>: failures by cause
# side_channel_<event>: P's side channel (accepted, or a refusal cause) and D's posts
# (post_<outcome>): side_channel/engine.py
SIDE_CHANNEL_PREFIX = "side_channel_"


@dataclass
class KvopsConnectorStats(KVConnectorStats):
    """Counters (numbers, summed when aggregated) and samples (lists, concatenated).

    ``data`` is a flat, serializable dict: counter names from the module docstring,
    ``failed_<cause>`` per failure cause, and the sample lists in ``SAMPLES``."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {name: [] for name in SAMPLES}

    def aggregate(self, other: KVConnectorStats) -> "KvopsConnectorStats":
        for key, value in other.data.items():
            if isinstance(value, list):
                self.data.setdefault(key, []).extend(value)
            else:
                self.data[key] = self.data.get(key, 0) + value
        return self

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def clone_and_reset(self) -> "KvopsConnectorStats":
        old = copy.copy(self)
        self.reset()
        return old

    def failures_by_cause(self) -> Dict[str, float]:
        return {k[len(FAILURE_PREFIX):]: v for k, v in self.data.items()
                if k.startswith(FAILURE_PREFIX) and v}

    def reduce(self) -> Dict[str, Any]:
        """The interval's summary for vLLM's periodic log line."""
        out: Dict[str, Any] = {}
        if self.data.get("pushed_bytes"):
            out["Pushed MB"] = round(self.data["pushed_bytes"] / 2**20, 3)
            out["Pushed layers"] = int(self.data.get("pushed_layers", 0))
        if self.data.get("received_bytes"):
            out["Received MB"] = round(self.data["received_bytes"] / 2**20, 3)
        for key, label in (("layer_transfer_s", "layer transfer"),
                           ("exposed_after_forward_s", "exposed after forward")):
            samples = np.asarray(self.data.get(key, []), dtype=np.float64)
            if samples.size:
                out[f"Avg {label} (ms)"] = round(float(samples.mean()) * 1e3, 3)
                out[f"P90 {label} (ms)"] = round(float(np.percentile(samples, 90)) * 1e3, 3)
        for key, label in (("requests_finished", "Finished requests"),
                           ("requests_failed", "Failed requests"), ("staging_waits", "Staging waits"),
                           ("integrity_failures", "Integrity failures")):
            if self.data.get(key):
                out[label] = int(self.data[key])
        if self.data.get("holds"):
            out["Held for a late destination"] = int(self.data["holds"])
        if self.data.get("lease_renewals"):
            out["Lease renewals"] = int(self.data["lease_renewals"])
        for cause, count in self.failures_by_cause().items():
            out[f"Failed ({cause})"] = int(count)
        for key, count in self.data.items():
            if key.startswith(SIDE_CHANNEL_PREFIX) and count:
                out[f"Side channel ({key[len(SIDE_CHANNEL_PREFIX):]})"] = int(count)
        return out


class SchedulerCounts:
    """Scheduler-side events (failures by cause, re-pushes after a preemption, holds),
    handed to vLLM's stats once."""

    def __init__(self) -> None:
        self._counts: Dict[str, int] = {}

    def failure(self, cause: str, n: int = 1) -> None:
        """``n`` failures of ``cause`` (``vllm:kvops_failures{cause=...}``)."""
        self.count(FAILURE_PREFIX + cause, n)

    def count(self, key: str, n: int = 1) -> None:
        """Add ``n`` (may be negative for ``held_change``) to counter ``key``."""
        self._counts[key] = self._counts.get(key, 0) + n

    def take(self) -> Optional[KvopsConnectorStats]:
        """The counts since the last call, or None."""
        counts = {k: v for k, v in self._counts.items() if v}
        self._counts = {}
        if not counts:
            return None
        stats = KvopsConnectorStats()
        stats.data.update(counts)
        return stats


class StatsCollector:
    """Worker side: turns the connector's cumulative counters and the step traces into
    per-interval :class:`KvopsConnectorStats`."""

    def __init__(self, role: str) -> None:
        self._names = {**_COUNTERS[role], **_BOTH}
        self._last: Dict[str, float] = {}
        self._pending = KvopsConnectorStats()
        self._dirty = False  # a step ran or an outcome came since the last take()

    def on_step(self, trace: List[dict], exposed_s: float) -> None:
        """After a push step: its per-layer transfer times and exposed time."""
        samples = self._pending.data["layer_transfer_s"]
        samples.extend(t["landed"] - t["event_ready"] for t in trace)
        self._pending.data["exposed_after_forward_s"].append(exposed_s)
        self._dirty = True

    def count(self, key: str, value: float = 1) -> None:
        """A worker-level event (e.g. ``failed_decode_unreachable``)."""
        self._pending.data[key] = self._pending.data.get(key, 0) + value
        self._dirty = True

    def touch(self) -> None:
        """Something happened that may have moved the connector's counters."""
        self._dirty = True

    def take(self, connector_stats) -> Optional[KvopsConnectorStats]:
        """The interval's stats (None when nothing happened). ``connector_stats`` is a
        callable returning ``LayerwiseConnector.stats()``: called only when dirty."""
        if not self._dirty:
            return None
        self._dirty = False
        snapshot = connector_stats()
        for key, value in snapshot.items():
            name = self._names.get(key) or (key if key.startswith(FAILURE_PREFIX) else None)
            if name is None or not isinstance(value, (int, float)):
                continue
            delta = value - self._last.get(key, 0)
            self._last[key] = value
            if delta:
                self._pending.data[name] = self._pending.data.get(name, 0) + delta
        if self._pending.is_empty():
            return None
        return self._pending.clone_and_reset()


class KvopsPromMetrics(KVConnectorPromMetrics):
    """Prometheus metrics (``vllm:kvops_*``), one child per engine label set."""

    _COUNTERS = {
        "pushed_bytes": ("vllm:kvops_pushed_bytes", "Bytes of KV pushed to decode instances (prefill)."),
        "pushed_layers": ("vllm:kvops_pushed_layers", "Layer pushes (one per layer per push step; prefill)."),
        "received_bytes": ("vllm:kvops_received_bytes", "Bytes of KV received from prefill instances (decode)."),
        "requests_finished": ("vllm:kvops_requests_finished", "Requests whose KV transfer finished."),
        "requests_failed": ("vllm:kvops_requests_failed", "Requests whose KV transfer failed."),
        "retries": ("vllm:kvops_retries", "Layer writes retried after a transient transport error."),
        "transport_errors": ("vllm:kvops_transport_errors", "Transport errors (retried or not)."),
        "staging_waits": ("vllm:kvops_staging_waits",
                          "Layer writes that waited for the decode side to free a staging slot."),
        "staging_wait_s": ("vllm:kvops_staging_wait_seconds", "Time spent waiting for staging slots."),
        "integrity_failures": ("vllm:kvops_integrity_failures",
                               "Chunks refused by the integrity check (0 without the check)."),
        "preempted_repushes": ("vllm:kvops_preempted_repushes",
                               "Prefill requests preempted mid-push whose pushes restart with "
                               "their recompute."),
        "partial_loads": ("vllm:kvops_partial_loads",
                          "Transfers that failed part-way whose landed prefix was kept (decode)."),
        "load_error_blocks": ("vllm:kvops_load_error_blocks",
                              "Blocks reported to vLLM as not loaded, recomputed (decode)."),
        "holds": ("vllm:kvops_holds",
                  "Requests that finished on the prefill engine before their decode destination "
                  "arrived, whose blocks it held (late binding)."),
        "holds_pushed": ("vllm:kvops_holds_pushed",
                         "Held requests pushed when their destination arrived (prefill)."),
        "misaddressed_begins": ("vllm:kvops_misaddressed_begins",
                                "Transfers whose prefill side named blocks this engine did not "
                                "give them: refused before a byte was written, recomputed (decode)."),
        "fenced": ("vllm:kvops_fenced",
                   "Transfers given up on while the prefill side might still write, whose blocks "
                   "were kept until no write could land (decode; docs/connector.md, the fence)."),
        "revokes_acknowledged": ("vllm:kvops_revokes_acknowledged",
                                 "Given-up transfers the prefill side acknowledged stopping, so "
                                 "their blocks returned before the fence's bound (decode)."),
        "write_lease_ended": ("vllm:kvops_write_lease_ended",
                              "Writes not started because the decode side's write lease had "
                              "ended (prefill)."),
        "write_lease_renewals": ("vllm:kvops_write_lease_renewals",
                                 "Steps that outlasted half their write lease and were granted "
                                 "a new one by the decode side (prefill; a slow forward)."),
        "peer_link_broken": ("vllm:kvops_peer_link_broken",
                             "Links to a decode instance given up on (a write failed after its "
                             "retries, a broken control channel); connected again later (prefill)."),
        "peer_reconnected": ("vllm:kvops_peer_reconnected",
                             "Links to a decode instance connected again after a failure (prefill)."),
        "peer_connect_pending": ("vllm:kvops_peer_connect_pending",
                                 "Pushes that went without their decode rank because its link "
                                 "was still connecting after connect_wait_s (prefill)."),
        "peers_released": ("vllm:kvops_peers_released",
                           "Links to decode ranks released because they failed or idled for "
                           "peer_idle_s (prefill)."),
        "reused_transfer_ids": ("vllm:kvops_reused_transfer_ids",
                                "Requests whose transfer id this decode rank had already used: "
                                "recomputed (decode)."),
        "incomplete_transfers": ("vllm:kvops_incomplete_transfers",
                                 "Transfer parts reported finished whose chunks did not cover "
                                 "every block expected: the blocks not covered are load errors "
                                 "(decode)."),
        "lease_renewals": ("vllm:kvops_lease_renewals",
                           "Leases renewed because the prefill engine said it still owes the "
                           "push, e.g. the request waits in its queue (decode)."),
    }
    _HISTOGRAMS = {
        "layer_transfer_s": ("vllm:kvops_layer_transfer_seconds",
                             "Per layer and push step: KV ready -> landed on the decode side.",
                             [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]),
        "exposed_after_forward_s": ("vllm:kvops_exposed_transfer_seconds",
                                    "Per push step: time the prefill engine waited for its pushes "
                                    "after the forward (the transfer not hidden by compute).",
                                    [0.0001, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]),
    }

    def __init__(self, vllm_config: "VllmConfig", metric_types: Dict[type, type],
                 labelnames: List[str], per_engine_labelvalues: Dict[int, List[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            key: create_metric_per_engine(
                self._counter_cls(name=name, documentation=doc, labelnames=labelnames),
                per_engine_labelvalues)
            for key, (name, doc) in self._COUNTERS.items()}
        self._histograms = {
            key: create_metric_per_engine(
                self._histogram_cls(name=name, documentation=doc, buckets=buckets, labelnames=labelnames),
                per_engine_labelvalues)
            for key, (name, doc, buckets) in self._HISTOGRAMS.items()}
        # changes summed from held_change deltas (scheduler side), so aggregation is exact
        self._held = create_metric_per_engine(
            self._gauge_cls(name="vllm:kvops_held_requests", documentation=(
                "Finished requests whose blocks the prefill engine holds for a late "
                "destination."), labelnames=labelnames, multiprocess_mode="livesum"),
            per_engine_labelvalues)
        self._links = create_metric_per_engine(
            self._gauge_cls(name="vllm:kvops_decode_links", documentation=(
                "Links of the prefill workers to decode ranks, connected (prefill)."),
                labelnames=labelnames, multiprocess_mode="livesum"),
            per_engine_labelvalues)
        self._links_backing_off = create_metric_per_engine(
            self._gauge_cls(name="vllm:kvops_decode_links_backing_off", documentation=(
                "Decode ranks whose link failed and waits out its backoff before the next "
                "connection attempt (prefill)."), labelnames=labelnames, multiprocess_mode="livesum"),
            per_engine_labelvalues)
        self._failures = self._counter_cls(
            name="vllm:kvops_failures", documentation="Failed KV transfers by cause.",
            labelnames=[*labelnames, "cause"])
        self._failure_children: Dict[tuple, Any] = {}
        self._side_channel = self._counter_cls(
            name="vllm:kvops_side_channel",
            documentation="Side-channel events: on P each destination accepted or refused (by "
                          "cause), on D each post's outcome (post_<outcome>).",
            labelnames=[*labelnames, "event"])

    def observe(self, transfer_stats_data: Dict[str, Any], engine_idx: int = 0) -> None:
        for key, metric in self._counters.items():
            value = transfer_stats_data.get(key)
            if value:
                metric[engine_idx].inc(value)
        for key, gauge in (("held_change", self._held), ("links_change", self._links),
                           ("links_backing_off_change", self._links_backing_off)):
            if transfer_stats_data.get(key):
                gauge[engine_idx].inc(transfer_stats_data[key])
        for key, metric in self._histograms.items():
            for sample in transfer_stats_data.get(key, ()):
                metric[engine_idx].observe(sample)
        for key, value in transfer_stats_data.items():
            if key.startswith(FAILURE_PREFIX) and value:
                cause = key[len(FAILURE_PREFIX):]
                child = self._failure_children.get((engine_idx, cause))
                if child is None:
                    child = self._failures.labels(*self.per_engine_labelvalues[engine_idx], cause)
                    self._failure_children[(engine_idx, cause)] = child
                child.inc(value)
            elif key.startswith(SIDE_CHANNEL_PREFIX) and value:
                event = key[len(SIDE_CHANNEL_PREFIX):]
                child = self._failure_children.get((engine_idx, "side:" + event))
                if child is None:
                    child = self._side_channel.labels(*self.per_engine_labelvalues[engine_idx], event)
                    self._failure_children[(engine_idx, "side:" + event)] = child
                child.inc(value)


def build_stats(data: Optional[Dict[str, Any]] = None) -> KvopsConnectorStats:
    """``KVConnectorBase_V1.build_kv_connector_stats`` for this connector."""
    return KvopsConnectorStats(data=data) if data is not None else KvopsConnectorStats()


def build_prom_metrics(vllm_config: "VllmConfig", metric_types: Dict[type[PromMetric], type[PromMetricT]],
                       labelnames: List[str], per_engine_labelvalues: Dict[int, List[object]]
                       ) -> KvopsPromMetrics:
    """``KVConnectorBase_V1.build_prom_metrics`` for this connector."""
    return KvopsPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

"""Unit tests of the connector's metrics plumbing (torch_kvops/integrations/vllm/metrics.py):
interval deltas, aggregation, the log summary and the Prometheus metrics on a private
registry. The end-to-end check with real engines is in test_vllm_connector.py."""
import functools
import json
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from torch_kvops.integrations.vllm import KvopsLayerwiseConnector
from torch_kvops.integrations.vllm.metrics import KvopsConnectorStats, StatsCollector

pytestmark = [pytest.mark.unit, pytest.mark.vllm]


class _Counters:
    """Cumulative counters as LayerwiseConnector.stats() returns them; counts reads."""

    def __init__(self):
        self.values = {"bytes_sent": 0, "layers_sent": 0, "requests_finished": 0, "requests_failed": 0,
                       "staging_waits": 0, "layer_transfer_s_mean": [0.0], "role": "producer"}
        self.reads = 0

    def __call__(self):
        self.reads += 1
        return dict(self.values)


def test_collector_reports_interval_deltas_and_reads_counters_only_after_activity():
    counters, collector = _Counters(), StatsCollector("producer")
    assert collector.take(counters) is None and counters.reads == 0  # idle decode steps: free
    counters.values.update(bytes_sent=1000, layers_sent=4)
    trace = [{"event_ready": 1.0, "landed": 1.5}, {"event_ready": 2.0, "landed": 2.25}]
    collector.on_step(trace, exposed_s=0.01)
    first = collector.take(counters)
    assert first.data["pushed_bytes"] == 1000 and first.data["pushed_layers"] == 4
    assert first.data["layer_transfer_s"] == [0.5, 0.25]
    assert first.data["exposed_after_forward_s"] == [0.01]
    counters.values.update(bytes_sent=1500, requests_finished=1, failed_push=2)
    collector.touch()
    second = collector.take(counters)
    assert second.data["pushed_bytes"] == 500 and second.data["requests_finished"] == 1
    assert second.failures_by_cause() == {"push": 2}
    assert "pushed_layers" not in second.data and second.data["layer_transfer_s"] == []
    collector.touch()
    assert collector.take(counters) is None  # nothing moved: no empty stats to ship
    collector.count("failed_decode_unreachable")
    assert collector.take(counters).failures_by_cause() == {"decode_unreachable": 1}


def test_stats_aggregate_and_reduce_and_survive_serialization():
    a = KvopsLayerwiseConnector.build_kv_connector_stats(
        {"pushed_bytes": 3 << 20, "pushed_layers": 8, "layer_transfer_s": [0.001, 0.003],
         "exposed_after_forward_s": [0.0], "failed_push": 1})
    b = KvopsLayerwiseConnector.build_kv_connector_stats(json.loads(json.dumps(a.to_dict())))  # as shipped
    total = a.aggregate(KvopsConnectorStats(data={"pushed_bytes": 1 << 20, "failed_lease_expired": 2,
                                                  "layer_transfer_s": [0.002]}))
    assert total.data["pushed_bytes"] == 4 << 20 and total.data["layer_transfer_s"] == [0.001, 0.003, 0.002]
    summary = total.reduce()
    assert summary["Pushed MB"] == 4.0 and summary["Pushed layers"] == 8
    assert summary["Avg layer transfer (ms)"] == 2.0
    assert summary["Failed (push)"] == 1 and summary["Failed (lease_expired)"] == 2
    assert b.data == {"pushed_bytes": 3 << 20, "pushed_layers": 8, "layer_transfer_s": [0.001, 0.003],
                      "exposed_after_forward_s": [0.0], "failed_push": 1}
    assert KvopsLayerwiseConnector.build_kv_connector_stats().is_empty()


def test_prometheus_metrics_count_per_engine_and_cause():
    registry = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry) for cls in (Gauge, Counter, Histogram)}
    prom = KvopsLayerwiseConnector.build_prom_metrics(
        SimpleNamespace(kv_transfer_config=None), types, ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]})
    prom.observe({"pushed_bytes": 4096, "layer_transfer_s": [0.01, 0.02], "failed_push": 1}, engine_idx=1)
    prom.observe({"pushed_bytes": 1024, "failed_push": 2, "failed_lease_expired": 1}, engine_idx=1)

    def value(name, **labels):
        return registry.get_sample_value(name, {"model_name": "m", "engine": "1", **labels})
    assert value("vllm:kvops_pushed_bytes_total") == 5120
    assert registry.get_sample_value("vllm:kvops_pushed_bytes_total", {"model_name": "m", "engine": "0"}) == 0
    assert value("vllm:kvops_layer_transfer_seconds_count") == 2
    assert abs(value("vllm:kvops_layer_transfer_seconds_sum") - 0.03) < 1e-9
    assert value("vllm:kvops_failures_total", cause="push") == 3
    assert value("vllm:kvops_failures_total", cause="lease_expired") == 1

"""A transient partition between P and D (issue 33): D runs in a network namespace this
test creates (an emulated second host, torch_kvops/testing/netns_host.py), and for a
few seconds every packet between the hosts is dropped, both ways (no reset: the
connections hang, as behind a failed switch). While it lasts, P's pushes to D fail
and P's step calls never raise; once it heals, transfers land again, byte-exact,
without restarting anything: P's link to D (integrations/vllm/links.py) is connected
again behind its circuit breaker, and D replaces the producer's lingering control
session. Real producer connector and consumer process over the real Mooncake engine."""
import time
from collections import Counter

import numpy as np
import pytest
import torch

from torch_kvops import ConnectorConfig, LayerwiseConnector, MooncakeTransport, TransferRequest
from torch_kvops.integrations.vllm.links import DecodeLinks
from torch_kvops.integrations.vllm.metadata import KvopsSettings
from torch_kvops.integrations.vllm.metrics import StatsCollector
from torch_kvops.testing.consumer_process import ConsumerProcess
from torch_kvops.testing.netns_host import NetnsHost

pytestmark = [pytest.mark.netns]

LAYERS, BLOCKS, BLOCK_SHAPE = 2, 32, (2, 8, 16)
CONFIG = dict(transfer_timeout_s=2.0, max_retries=0, control_timeout_s=1.5, lease_s=5.0,
              fence_drain_s=2.0, step_timeout_s=10.0)
SRC, DST = [0, 1, 2, 3], [4, 5, 6, 7]
PARTITION_S = 4.0
RECOVERY_BOUND_S = 15.0  # the breaker's backoff after a few failures (<= 8 s), plus one connect


def _push(conn, links, consumer, caches, req_id, seed):
    """One request to D through P's link: "landed" (byte-exact on D), "failed", or
    "no link" (P had none to use yet)."""
    peer = links.peer(consumer.info)
    if peer is None:
        return "no link"
    consumer.call("expect", [req_id])
    gen = torch.Generator().manual_seed(seed)
    conn.start_step([TransferRequest(req_id, peer, SRC, DST)])
    for layer, cache in enumerate(caches):
        cache[SRC] = torch.randn(len(SRC), *BLOCK_SHAPE, generator=gen)
        conn.save_kv_layer(layer, cache)
    conn.wait_for_save(timeout=60)  # never raises: a failed push fails its request
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, failed = conn.get_finished()
        if req_id in failed:
            return "failed"
        if req_id in done:
            break
        time.sleep(0.02)
    else:
        raise AssertionError(f"{req_id}: no outcome on P within 30 s")
    assert consumer.call("wait", [req_id], 30.0)[0] == {req_id}
    received = consumer.call("caches")
    for layer in range(LAYERS):
        assert np.array_equal(received[layer][DST], caches[layer][SRC].numpy()), (req_id, layer)
    return "landed"


@pytest.mark.parametrize("reconnect", [True, False], ids=["breaker", "never_reconnect"])
def test_transfers_resume_without_restarts_after_a_transient_partition(reconnect):
    """Negative control (never_reconnect): a link given up on is never connected again
    (P before its circuit breaker): after the partition heals, nothing lands."""
    with NetnsHost(index=2) as host:
        consumer = ConsumerProcess(LAYERS, BLOCKS, BLOCK_SHAPE, host=host, **CONFIG)
        transport = MooncakeTransport(host="127.0.0.1")
        caches = [torch.zeros(BLOCKS, *BLOCK_SHAPE) for _ in range(LAYERS)]
        conn = LayerwiseConnector("producer", transport, ConnectorConfig(**CONFIG))
        links = DecodeLinks(conn, KvopsSettings(connect_wait_s=2.0), StatsCollector("producer"))
        if not reconnect:
            failed = set()
            record = links._breaker.failed
            links._breaker.failed = lambda engine, why: failed.add(engine) or record(engine, why)
            links._breaker.may_try = lambda engine: engine not in failed
        pid = consumer.proc.pid
        seq = 0

        def push():
            nonlocal seq
            seq += 1
            return _push(conn, links, consumer, caches, f"r{seq}", seq)

        try:
            conn.register_kv_caches(caches)
            assert [push() for _ in range(3)] == ["landed"] * 3
            host.partition()
            cut = time.monotonic()
            during = []
            while time.monotonic() - cut < PARTITION_S:
                during.append(push())
                time.sleep(0.2)
            host.heal()
            healed = time.monotonic()
            after = []
            while "landed" not in after and time.monotonic() - healed < RECOVERY_BOUND_S:
                after.append(push())
                if after[-1] != "landed":
                    time.sleep(0.2)
            recovered_s = time.monotonic() - healed
            print(f"during the {PARTITION_S:.0f} s partition: {Counter(during)}; after it healed: "
                  f"{Counter(after)}, landed again {recovered_s:.1f} s after")
            assert "landed" not in during and "failed" in during, during
            if not reconnect:
                assert "landed" not in after, "the control reconnected: it guards nothing"
                return
            assert after[-1] == "landed" and recovered_s < RECOVERY_BOUND_S, (after, recovered_s)
            assert [push() for _ in range(3)] == ["landed"] * 3
            assert consumer.proc.pid == pid and consumer.proc.is_alive()  # nothing restarted
        finally:
            links.close()
            conn.close()
            transport.close()
            consumer.stop()

"""The optional end-to-end integrity check (ConnectorConfig.integrity_check) between
real processes over the real Mooncake engine.

Sabotage is applied from this test to the producer's transport (bytes not written,
or written one block off): with the check on, the consumer must report the request
failed and count it; with the check off, the same sabotage goes unnoticed by the
connector (the control that shows the check is what catches it).
"""
import numpy as np
import pytest
import torch

from torch_kvops import ConnectorConfig, LayerwiseConnector, MooncakeTransport, TransferRequest
from torch_kvops.connector.integrity import BlockDigester, integrity_key
from torch_kvops.testing.consumer_process import ConsumerProcess

LAYERS, BLOCKS, BLOCK_SHAPE = 3, 64, (2, 8, 16)  # 1 KiB blocks
BLOCK_BYTES = 2 * 8 * 16 * 4
FAST = dict(transfer_timeout_s=3.0, max_retries=0, retry_backoff_s=0.02, lease_s=10.0,
            control_timeout_s=2.0, quarantine_s=0.05)
PATHS = {"staged": {}, "direct": {"staging_threshold_bytes": 0}}
SRC, DST = [0, 1, 2, 7, 30], [10, 11, 12, 20, 40]  # chunk 1: first three, chunk 2: the rest


def sabotage(transport, how):
    """Replace ``transport.write`` (this process only) with a faulty one."""
    original = transport.write

    def drop(peer, src, dst, lengths, **kw):
        return None  # reports success, moves nothing

    def misplace(peer, src, dst, lengths, **kw):
        return original(peer, src, [int(d) + BLOCK_BYTES for d in dst], lengths, **kw)

    transport.write = {"drop": drop, "misplace": misplace}[how]


def push_two_chunks(conn, caches, peer):
    gen = torch.Generator().manual_seed(5)
    for src, dst, last in ((SRC[:3], DST[:3], False), (SRC[3:], DST[3:], True)):
        conn.start_step([TransferRequest("r", peer, src, dst, last_chunk=last)])
        idx = torch.tensor(src)
        for layer, cache in enumerate(caches):
            cache.index_copy_(0, idx, torch.randn(len(src), *BLOCK_SHAPE, generator=gen))
            conn.save_kv_layer(layer, cache)
        conn.wait_for_save(timeout=30)


def run(path: str, how, consumer_check: bool, producer_check: bool):
    """Push request "r" in two chunks; returns (finished, failed, consumer stats, bytes right)."""
    consumer = ConsumerProcess(LAYERS, BLOCKS, BLOCK_SHAPE, integrity_check=consumer_check,
                               **FAST, **PATHS[path])
    transport = MooncakeTransport(host="127.0.0.1")
    try:
        caches = [torch.zeros(BLOCKS, *BLOCK_SHAPE) for _ in range(LAYERS)]
        config = ConnectorConfig(integrity_check=producer_check, **FAST, **PATHS[path])
        with LayerwiseConnector("producer", transport, config) as conn:
            conn.register_kv_caches(caches)
            peer = conn.add_peer(consumer.info)
            consumer.call("expect", ["r"])
            if how:
                sabotage(transport, how)
            push_two_chunks(conn, caches, peer)
            finished, failed, _ = consumer.call("wait", ["r"], 15.0)
            received = consumer.call("caches")
            right = all(np.array_equal(received[layer][d], caches[layer][s].numpy())
                        for layer in range(LAYERS) for s, d in zip(SRC, DST))
            return finished, failed, consumer.call("stats"), right
    finally:
        consumer.stop()
        transport.close()


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("how", ["drop", "misplace"])
def test_sabotaged_writes_fail_the_request_when_the_check_is_on(path, how):
    finished, failed, stats, right = run(path, how, consumer_check=True, producer_check=False)
    assert not right, "the sabotage did not corrupt the blocks: this test proves nothing"
    assert failed == {"r"} and not finished
    assert stats["integrity_failures"] == 1


def test_without_the_check_the_same_sabotage_is_reported_finished():
    finished, failed, stats, right = run("staged", "misplace", consumer_check=False, producer_check=False)
    assert not right and finished == {"r"} and not failed
    assert stats["integrity_failures"] == 0


@pytest.mark.parametrize("path,consumer_check,producer_check",
                         [("staged", True, False), ("direct", False, True)],
                         ids=["staged-consumer-asks", "direct-producer-offers"])
def test_intact_pushes_pass_the_check(path, consumer_check, producer_check):
    finished, failed, stats, right = run(path, None, consumer_check, producer_check)
    assert right and finished == {"r"} and not failed
    assert stats["integrity_failures"] == 0 and stats["integrity_us"] > 0


def test_digests_are_keyed_and_cover_every_layer():
    caches = [torch.randn(4, 8) for _ in range(3)]
    a = BlockDigester(caches, integrity_key("secret-a")).block_digests([1, 2])
    assert a == BlockDigester(caches, integrity_key("secret-a")).block_digests([1, 2])
    assert a != BlockDigester(caches, integrity_key("secret-b")).block_digests([1, 2])
    caches[2][1, 3] += 1.0  # one element of the last layer
    b = BlockDigester(caches, integrity_key("secret-a")).block_digests([1, 2])
    assert b[1] != a[1] and b[2] == a[2]


def test_device_caches_are_refused_with_the_setting_named():
    caches = [torch.zeros(4, 8, device="meta")]
    transport = MooncakeTransport(host="127.0.0.1")
    try:
        conn = LayerwiseConnector("producer", transport, ConnectorConfig(integrity_check=True))
        with pytest.raises(ValueError, match="integrity_check"):
            conn.register_kv_caches(caches)
    finally:
        transport.close()
